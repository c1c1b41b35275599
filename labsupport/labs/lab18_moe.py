"""Lab 18, mixture of experts and expert parallelism: a batch routed on 4 ranks, expert
parallelism against one process, the bytes of its all-to-alls against the formula, and
the busiest rank's wait. The exercises' checkers are in :mod:`labsupport.labs.lab18_checks`.

The lab's MoE layer (:func:`lab_moe`) routes with dyadic numbers: its router weights and
the tokens (:func:`tokens`) are multiples of 1/32 below 16, so every router logit (a sum
of 16 products) is computed exactly, in any order of summation, on any CPU, and two
different logits differ by at least 1/1024. With no two of a token's top logits equal
(:func:`compare` measures the smallest gap), routing, hence every count this lab
prints, is the same on every machine.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist

from labsupport.comm import traced
from labsupport.launch.runtime import device
from labsupport.models import MoE, MoEConfig
from labsupport.parallel import expert_parallel as xp

#: float32 sums of a few dozen products, in another order: ~1e-6 relative at most; a
#: token sent to the wrong expert or a gate applied twice is off by far more.
TOL = {"rtol": 1e-5, "atol": 1e-6}
N_EMBD, N_EXPERT, TOKENS = 16, 8, 32  # width, experts, tokens per rank
CONFIGS = {
    "top-1, dropless": MoEConfig(N_EXPERT, 1),
    "top-2, dropless": MoEConfig(N_EXPERT, 2),
    "top-2, capacity 1.0": MoEConfig(N_EXPERT, 2, capacity_factor=1.0),
    "top-2, capacity 1.25": MoEConfig(N_EXPERT, 2, capacity_factor=1.25),
}


def dyadic(t: torch.Tensor, bits: int = 5) -> torch.Tensor:
    """``t`` rounded to a multiple of ``2**-bits``."""
    return torch.round(t * 2**bits) / 2**bits


def router_weight(seed: int = 0) -> torch.Tensor:
    """The lab's router weights, ``E x h``, dyadic."""
    return dyadic(torch.randn(N_EXPERT, N_EMBD, generator=torch.Generator().manual_seed(seed)))


def lab_moe(config: MoEConfig = CONFIGS["top-2, dropless"], seed: int = 0) -> MoE:
    """The lab's MoE layer (8 experts of width 16) with :func:`router_weight`."""
    torch.manual_seed(seed)
    moe = MoE(N_EMBD, config)
    with torch.no_grad():
        moe.router.gate.weight.copy_(router_weight(seed))
    return moe


def tokens(rank: int, skew: float = 0.0) -> torch.Tensor:
    """Rank ``rank``'s :data:`TOKENS` tokens, dyadic; ``skew`` pulls them all towards
    experts 0 and 1 (the first rank's), as a batch on one topic would."""
    x = dyadic(torch.randn(TOKENS, N_EMBD, generator=torch.Generator().manual_seed(100 + rank)))
    return x + skew * router_weight()[:2].sum(0)


def compare(name: str) -> dict:
    """One :data:`CONFIGS` layer split over the ranks (run on every rank) against one
    process running every rank's batch: the routing, the rows moved, the collectives and
    their bytes, and whether the output and every gradient equal one process's."""
    ep, rank = dist.get_world_size(), dist.get_rank()
    moe = lab_moe(CONFIGS[name])
    reference, layer = copy.deepcopy(moe), xp.ExpertParallelMoE(moe.to(device()))
    wanted = []
    for r in range(ep):  # one process: each rank's batch, the losses added
        x = tokens(r).requires_grad_(True)
        y = reference(x)
        (y.square().sum() + reference.aux_loss).backward()
        wanted.append((y.detach(), x.grad))
    x = tokens(rank).to(device()).requires_grad_(True)
    with traced.trace_collectives() as forward:
        y = layer(x)
    with traced.trace_collectives() as backward:
        (y.square().sum() + layer.aux_loss).backward()
    traced.all_reduce(layer.router.gate.weight.grad)  # the router: data-parallel
    local = reference.experts[layer.first_expert : layer.first_expert + len(layer.experts)]
    pairs = zip(layer.experts.parameters(), local.parameters(), strict=True)
    routing = layer.routing
    top = layer.router.gate(x).detach().topk(routing.experts.shape[1] + 1).values
    return {
        "rank": rank,
        "load": routing.load.tolist(),
        "kept": routing.tokens_per_expert.tolist(),
        "dropped": int((~routing.kept).sum()),
        "sent": torch.bincount(routing.experts[routing.kept], minlength=N_EXPERT)
        .view(ep, -1)
        .sum(1)
        .tolist(),
        "received": layer.received.tolist(),
        "logit gap": float((top[:, -2] - top[:, -1]).min()),
        "output": _close(y, wanted[rank][0]),
        "input gradient": _close(x.grad, wanted[rank][1]),
        "expert gradients": all(_close(p.grad, q.grad) for p, q in pairs),
        "router gradient": _close(layer.router.gate.weight.grad, reference.router.gate.weight.grad),
        "forward": [n for n, _, _ in forward.calls],
        "backward": [n for n, _, _ in backward.calls],
        "bytes": xp.all_to_all_bytes(forward) + xp.all_to_all_bytes(backward),
    }


def compare_all() -> dict:
    """:func:`compare` for every layer of :data:`CONFIGS` (run on every rank)."""
    return {name: compare(name) for name in CONFIGS}


def _close(a, b) -> bool:
    return bool(torch.allclose(a.detach().cpu(), b.detach().cpu(), **TOL))


def count_bytes(ep: int, bytes_per_value: int = 8) -> int:
    """The bytes of the count exchange per rank: its counts for the other ranks' experts."""
    return (ep - 1) * N_EXPERT // ep * bytes_per_value


class ExpertWait(torch.autograd.Function):
    """The identity, which also waits ``per_row`` seconds for each of its rows in the
    forward pass and twice that in the backward pass: an expert's matrix products on
    an accelerator of its own, whose time grows with the rows it gets (lab 11's wait,
    proportional to the work)."""

    @staticmethod
    def forward(ctx, x, per_row: float):
        ctx.per_row = per_row
        time.sleep(len(x) * per_row)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * len(grad) * ctx.per_row)
        return grad, None


def timed_step(skew: float, per_row: float = 1e-3, repeats: int = 3) -> dict:
    """One training step of the lab's layer under expert parallelism (run on every rank),
    its experts waiting :class:`ExpertWait`: the rows this rank computed, the seconds it
    waited for them, and the step's time, from a barrier to the slowest rank's end (the
    fastest of ``repeats``)."""
    layer = xp.ExpertParallelMoE(lab_moe().to(device()))
    for expert in layer.experts:
        expert.register_forward_hook(lambda _m, _a, out: ExpertWait.apply(out, per_row))
    x = tokens(dist.get_rank(), skew).to(device())
    layer(x).square().sum().backward()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        layer(x).square().sum().backward()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        best = min(best, elapsed.item())
    rows = int(layer.received.sum())
    return {"rank": dist.get_rank(), "rows": rows, "waited": 3 * rows * per_row, "step": best}


def busiest_rank(skews=(0.0, 1.0)) -> dict:
    """:func:`timed_step` for each skew (run on every rank)."""
    return {skew: timed_step(skew) for skew in skews}

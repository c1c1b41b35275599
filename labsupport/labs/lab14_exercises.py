"""Lab 14's mechanism exercise: the ZeRO-1 step, written by the learner as a class
``ZeRO1(params, lr)`` with a ``step()``, run on 2 and 3 real ranks against plain Adam in
one process and against PyTorch's ``ZeroRedundancyOptimizer``.

The model has 53 parameters, which neither 2 nor 3 divides, so the flat buffers must be
padded. The checker reads the learner's optimizer (a ``torch.optim`` optimizer the
object keeps as an attribute) to find the shard it steps: where it starts, its size on
every rank, Adam's momentum after each step (which shows a gradient summed rather than
averaged: Adam's step itself barely changes when every gradient is N times larger), and
the bytes of Adam's states each rank holds. The learner's class only ever runs on the
ranks, under a timeout: collectives that not every rank calls come back as a verdict.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport.labs.cells import exercise, expect_close, launch_answer
from labsupport.launch.runtime import device
from labsupport.models import batch_share

WORLDS, STEPS, LR, BATCH = (2, 3), 3, 1e-2, 12
#: float32 sums of the ranks' gradients in another order than one process's, ~1e-7
#: relative, which Adam's steps of about lr carry through 3 steps.
TOL = {"rtol": 1e-4, "atol": 1e-6}


def toy_model() -> nn.Module:
    """6 -> 5 -> 3 with a tanh: 35 + 18 = 53 parameters, the same on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(device())


def toy_batch(step: int) -> tuple:
    """Step ``step``'s whole batch (inputs, targets), the same in every process."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)
    return x.to(device()), y.to(device())


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).cpu() for t in tensors])


def _named(model) -> dict:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _optimizers(obj) -> list:
    """The ``torch.optim`` optimizers ``obj`` keeps in its attributes (or in a list,
    tuple or dict there)."""
    found = []
    for value in vars(obj).values():
        if isinstance(value, dict):
            value = list(value.values())
        for v in value if isinstance(value, list | tuple) else [value]:
            if isinstance(v, torch.optim.Optimizer) and v not in found:
                found.append(v)
    return found


def _stepped(optimizers) -> list:
    return [p for o in optimizers for g in o.param_groups for p in g["params"]]


def _torch_zero(steps: int) -> list:
    """``ZeroRedundancyOptimizer`` with Adam, the gradients averaged first as DDP does:
    the parameters after each step."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model, world = toy_model(), dist.get_world_size()
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    mine, out = batch_share(BATCH, dist.get_rank(), world), []
    for step in range(steps):
        x, y = toy_batch(step)
        opt.zero_grad()
        F.mse_loss(model(x[mine]), y[mine]).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        out.append(_named(model))
    return out


def zero1_case(cls, steps: int = STEPS) -> dict:
    """The learner's ``cls`` on this rank for ``steps`` steps, each on this rank's share
    of the batch; beside it, plain Adam on the whole batch in this process, and then
    (its collectives after all of the learner's) ``ZeroRedundancyOptimizer``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = toy_model()
    reference = copy.deepcopy(model)
    opt = cls(list(model.parameters()), lr=LR)
    optimizers = _optimizers(opt)
    stepped = _stepped(optimizers)
    sizes = [None] * world  # every rank's shard size, so that every rank stops together
    dist.all_gather_object(sizes, sum(p.numel() for p in stepped) if optimizers else 0)
    numel = sum(p.numel() for p in model.parameters())
    found = {"optimizer": bool(optimizers), "sizes": sizes, "numel": numel}
    if not optimizers or len(set(sizes)) > 1:
        return found
    found["start"], found["steps"] = _flat(stepped), []
    ref_opt = torch.optim.Adam(reference.parameters(), lr=LR)
    mine = batch_share(BATCH, rank, world)
    for step in range(steps):
        x, y = toy_batch(step)
        for p in model.parameters():
            p.grad = None
        F.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        states = [o.state.get(p, {}) for o in optimizers for p in _stepped([o])]
        found["steps"].append(
            {
                "params": _named(model),
                "reference": _named(reference),
                "exp_avg": _flat(s["exp_avg"] for s in states) if all(states) else None,
                "reference exp_avg": _flat(
                    ref_opt.state[p]["exp_avg"] for p in reference.parameters()
                ),
            }
        )
    found["torch"] = _torch_zero(steps)
    found["state bytes"] = sum(
        t.nbytes
        for o in optimizers
        for s in o.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim()
    )
    return found


def _shard(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``flat`` padded with zeros to a multiple of ``world``."""
    n = math.ceil(flat.numel() / world)
    return F.pad(flat, (0, n * world - flat.numel()))[rank * n : (rank + 1) * n]


def _start_hint(got, want_flat, rank, world) -> str:
    for other in range(world):
        if other != rank and torch.equal(got, _shard(want_flat, other, world)):
            return (
                f"rank {rank} holds shard {other} of the parameters: the reduce-scatter gives "
                f"rank r the r-th slice of the gradient, so rank r steps the r-th slice of "
                "the flat parameters"
            )
    return "this rank's slice of the flat parameters, flattened in model.parameters() order"


def _scale_hint(got, want, world) -> str:
    close = lambda a, b: bool(torch.allclose(a, b, **TOL))  # noqa: E731
    if close(got, want * world):
        return (
            f"{world} times the average: a reduce-scatter sums the ranks' gradients; divide "
            "by the world size"
        )
    if close(got, want / world):
        return f"1/{world} of the average: the sum is divided by the world size twice"
    return "Adam's momentum follows the average over the ranks of their gradients"


def _check_world(results: list, world: int) -> int:
    """Verdicts for one launch; returns the shard size."""
    r0 = results[0]
    numel = r0["numel"]
    n = math.ceil(numel / world)
    if not r0["optimizer"]:
        raise AssertionError(
            "ZeRO1 keeps no torch.optim optimizer: make one, torch.optim.Adam([shard], "
            "lr=lr), and keep it as an attribute (self.adam)"
        )
    sizes = r0["sizes"]
    if len(set(sizes)) > 1:
        raise AssertionError(
            f"on {world} ranks the shards your Adams step have sizes {sizes}, for {numel} "
            f"parameters: every rank's shard must be the same size for reduce-scatter and "
            f"all-gather. Pad the flat buffer to a multiple of the world size "
            f"({n * world}) and give each rank ceil({numel}/{world}) = {n} elements"
        )
    whole = sizes[0] in (numel, n * world)
    if not whole and sizes[0] != n:
        raise AssertionError(
            f"on {world} ranks each rank's Adam steps {sizes[0]} elements: the shard of "
            f"{numel} parameters padded to {n * world} is {n}"
        )
    start = _flat(toy_model().parameters())
    padded = F.pad(start, (0, n * world - numel))
    hint = (
        "after Adam's step on its shard, every rank all-gathers the shards and copies "
        "the whole flat buffer back into the model's parameters"
    )
    for rank, found in enumerate(results):
        got = found["start"]
        want = padded[: got.numel()] if whole else _shard(start, rank, world)
        where = "the shard your Adam steps, before any step"
        expect_close(got, want, where, rank, _start_hint(got, start, rank, world), **TOL)
        for step, s in enumerate(found["steps"], 1):
            if s["exp_avg"] is not None:
                ref = s["reference exp_avg"]
                want = _shard(ref, rank, world)
                if whole:
                    want = F.pad(ref, (0, n * world - numel))[: s["exp_avg"].numel()]
                where = f"Adam's exp_avg of your shard after step {step}"
                scale = _scale_hint(s["exp_avg"], want, world)
                expect_close(s["exp_avg"], want, where, rank, scale, **TOL)
            for name, want in s["reference"].items():
                where = f"{name} after step {step} (plain Adam's)"
                expect_close(s["params"][name], want, where, rank, hint, **TOL)
            for name, want in found["torch"][step - 1].items():
                where = f"{name} after step {step} (ZeroRedundancyOptimizer's)"
                expect_close(s["params"][name], want, where, rank, hint, **TOL)
    held = [found["state bytes"] for found in results]
    if max(held) > 8 * n:
        raise AssertionError(
            f"the parameters are right, but on {world} ranks each rank holds {held} bytes "
            f"of Adam's states, one process's 8 x {numel}: {max(held) / (8 * n):.1f} times "
            f"ZeRO-1's 8 x {n} (two fp32 moments for its shard only). Step only this "
            "rank's shard: reduce-scatter the gradients, not all-reduce them"
        )
    return n


@exercise
def check_zero1(cls, timeout: float = 120) -> str:
    """Exercise 4: ``cls(params, lr)``, a ZeRO-1 Adam whose ``step()`` reduce-scatters
    the flat gradient, steps this rank's shard with Adam and all-gathers the parameters;
    :data:`STEPS` steps on 2 and 3 ranks against plain Adam and ZeroRedundancyOptimizer."""
    hint = (
        "Every rank must call the same collectives, in the same order, with tensors of "
        "the same size: is one of yours under an `if rank == ...`?"
    )
    shards = [
        _check_world(launch_answer(zero1_case, world, hint, timeout, args=(cls,)), world)
        for world in WORLDS
    ]
    numel = sum(p.numel() for p in toy_model().parameters())
    return (
        f"on 2 and 3 ranks, {STEPS} steps give plain Adam's parameters and "
        f"ZeroRedundancyOptimizer's; each rank holds Adam's states for {shards[0]} and "
        f"{shards[1]} of the {numel} parameters"
    )

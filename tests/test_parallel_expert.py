"""Expert parallelism against one process, on 2, 3 and 4 ranks: top-1 and top-2, dropless
and with a capacity, a shared expert, a rank that gets nothing; outputs and every
gradient, the rows each expert gets, the bytes sent against the formula, the all-to-all
against torch's differentiable one; EP 2 x DP 2 training of the course GPT against one
process, with the right groups and two wrong ones; the sizes it refuses."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from labsupport import launch
from labsupport.comm import traced
from labsupport.estimate.moe import all_to_all_bytes
from labsupport.models import GPT, GPTConfig, MoE, MoEConfig, random_tokens
from labsupport.models import moe as moe_model
from labsupport.parallel import expert_parallel as xp

TOL = {"rtol": 1e-5, "atol": 1e-6}
H, T = 8, 12  # width, tokens per rank


def batch(rank: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(10 + rank))


def layer_case(config: MoEConfig, bias: torch.Tensor | None = None) -> dict:
    """The layer over every rank against one process running each rank's batch."""
    ep, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    moe = MoE(H, config)
    if bias is not None:
        moe.router.expert_bias.copy_(bias)
    reference = copy.deepcopy(moe)
    outputs, loads = [], []
    for r in range(ep):
        x = batch(r).requires_grad_(True)
        y = reference(x)
        (y.square().sum() + reference.aux_loss).backward()
        outputs.append((y.detach(), x.grad))
        loads.append(reference.routing.tokens_per_expert)
    parallel = xp.ExpertParallelMoE(moe)
    x = batch(rank).requires_grad_(True)
    with traced.trace_collectives() as forward:
        y = parallel(x)
    with traced.trace_collectives() as backward:
        (y.square().sum() + parallel.aux_loss).backward()
    replicated = [parallel.router.gate.weight]
    if config.shared_expert:
        replicated += list(parallel.shared_expert.parameters())
    for p in replicated:
        dist.all_reduce(p.grad)
    ours = [p.grad for p in [*parallel.experts.parameters(), *replicated]]
    first, local = parallel.first_expert, len(parallel.experts)
    theirs = [p.grad for p in reference.experts[first : first + local].parameters()]
    theirs += [reference.router.gate.weight.grad]
    if config.shared_expert:
        theirs += [p.grad for p in reference.shared_expert.parameters()]
    rows_to = [torch.stack(loads)[r].view(ep, -1).sum(1).tolist() for r in range(ep)]
    return {
        "output": (y.detach(), outputs[rank][0]),
        "input gradient": (x.grad, outputs[rank][1]),
        "gradients": list(zip(ours, theirs, strict=True)),
        "received": parallel.received,
        "want received": torch.stack(loads)[:, first : first + local],
        "forward": [n for n, _, _ in forward.calls],
        "backward": [n for n, _, _ in backward.calls],
        "bytes": xp.all_to_all_bytes(forward) + xp.all_to_all_bytes(backward),
        "want bytes": all_to_all_bytes(rows_to, H)[rank] + (ep - 1) * config.n_expert // ep * 8,
    }


def layer_cases(n_expert: int) -> list[dict]:
    cases = [MoEConfig(n_expert, k, capacity_factor=cf) for k in (1, 2) for cf in (None, 1.0)]
    results = [layer_case(c) for c in cases]
    results.append(layer_case(MoEConfig(n_expert, 2, shared_expert=True)))
    nothing_for_others = torch.zeros(n_expert)
    nothing_for_others[:2] = 10.0  # every token picks experts 0 and 1, on rank 0
    results.append(layer_case(MoEConfig(n_expert, 2), nothing_for_others))
    results.append(all_to_all_against_torch())
    try:  # one more expert than divides over the group
        xp.ExpertParallelMoE(MoE(H, MoEConfig(n_expert + 1, 2)))
        results.append("accepted")
    except ValueError as exc:
        results.append(str(exc))
    return results


def all_to_all_against_torch() -> dict:
    """Uneven splits, rank r sending r + j + 1 rows to rank j: ours and torch's
    differentiable all_to_all_single give the same rows and the same gradient."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    ep, rank = dist.get_world_size(), dist.get_rank()
    send = [rank + j + 1 for j in range(ep)]
    receive = [r + rank + 1 for r in range(ep)]
    x = torch.randn(sum(send), 3, generator=torch.Generator().manual_seed(rank))
    weights = torch.arange(sum(receive) * 3.0).view(-1, 3)
    ours, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ours = xp.all_to_all(ours, receive, send, None)
    y_theirs = all_to_all_single_autograd(theirs, receive, send, dist.group.WORLD)
    (y_ours * weights).sum().backward()
    (y_theirs * weights).sum().backward()
    return {"all_to_all": (y_ours.detach(), y_theirs.detach(), ours.grad, theirs.grad)}


@pytest.mark.parametrize("ep", [2, 3, 4])
def test_expert_parallel_equals_one_process(ep):
    n_expert = 6 if ep == 3 else 8
    for rank in launch(layer_cases, ep, args=(n_expert,), timeout=240):
        *cases, against_torch, refused = rank
        assert refused.startswith(
            f"{n_expert + 1} experts do not divide over an expert-parallel group"
        )
        for case in cases:
            torch.testing.assert_close(*case["output"], **TOL)
            torch.testing.assert_close(*case["input gradient"], **TOL)
            for got, want in case["gradients"]:
                torch.testing.assert_close(got, want, **TOL)
            assert torch.equal(case["received"], case["want received"])
            assert case["forward"] == ["all_to_all"] * 3  # counts, dispatch, combine
            assert case["backward"] == ["all_to_all"] * 2  # the combine's and dispatch's twins
            assert case["bytes"] == case["want bytes"]
        y_ours, y_theirs, g_ours, g_theirs = against_torch["all_to_all"]
        assert torch.equal(y_ours, y_theirs) and torch.equal(g_ours, g_theirs)
    # the last case: every token on rank 0's experts, the other ranks receive nothing
    assert int(cases[-1]["received"].sum()) == 0


def test_sizes_expert_parallelism_cannot_run_are_refused():
    with pytest.raises(
        ValueError, match="6 experts do not divide over an expert-parallel group of 4"
    ):
        xp.check_expert_parallel(6, 2, 4)
    with pytest.raises(ValueError, match="top_k=9 must be between 1 and n_expert=8"):
        xp.check_expert_parallel(8, 9, 2)
    with pytest.raises(ValueError, match="does not divide a world of 4"):
        xp.expert_parallel_ranks(4, 3)
    assert xp.expert_parallel_ranks(8, 4) == (
        [[0, 1, 2, 3], [4, 5, 6, 7]],
        [[0, 4], [1, 5], [2, 6], [3, 7]],
    )


# --------------------------------------------------------------------------- EP x DP

GPT_CONFIG = {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}
SHARE, STEPS = 2, 3


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**GPT_CONFIG, moe=MoEConfig(4, 2, capacity_factor=1.5)))


def share(step: int, rank: int, world: int):
    idx, targets = random_tokens(SHARE * world, 8, 32, seed=step)
    return idx[rank * SHARE : (rank + 1) * SHARE], targets[rank * SHARE : (rank + 1) * SHARE]


def one_process(world: int) -> tuple[dict, list[float]]:
    """The first step's gradients and every step's mean loss: each rank's share run in
    turn, each share's loss (plus its auxiliary loss) divided by ``world``."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    grads, losses = {}, []
    for step in range(STEPS):
        total = 0.0
        for r in range(world):
            loss = model(*share(step, r, world))[1]
            ((loss + moe_model.aux_loss(model)) / world).backward()
            total += loss.item() / world
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return grads, losses


def wrong_experts(model, dp_group, expert_dp_group):
    xp.all_reduce_gradients(model, dp_group, dp_group)


def wrong_rest(model, dp_group, expert_dp_group):
    xp.all_reduce_gradients(model, expert_dp_group, expert_dp_group)


def ep_dp(ep: int) -> dict:
    """EP x DP with each reduction: the first step's gradients, by reference name, and
    every step's mean loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = xp.expert_parallel_groups(ep)
    out = {}
    for name, reduce in [
        ("right", xp.all_reduce_gradients),
        ("experts over all ranks", wrong_experts),
        ("rest over expert-dp", wrong_rest),
    ]:
        model = xp.parallelize(build(), groups["ep"])
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        grads, losses = {}, []
        for step in range(STEPS):
            loss = model(*share(step, rank, world))[1]
            (loss + moe_model.aux_loss(model)).backward()
            reduce(model, groups["dp"], groups["expert_dp"])
            if not grads:
                for n, p in model.named_parameters():
                    layer = (
                        model.get_submodule(n.split(".experts.")[0]) if ".experts." in n else None
                    )
                    if layer is not None:  # this rank's expert i is the reference's first + i
                        i = int(n.split(".experts.")[1].split(".")[0])
                        n = n.replace(f".experts.{i}.", f".experts.{layer.first_expert + i}.")
                    grads[n] = p.grad.clone()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        out[name] = (grads, losses)
    return out


def test_ep2_dp2_training_equals_one_process_and_wrong_groups_do_not():
    want_grads, want_losses = one_process(4)
    for rank in launch(ep_dp, 4, args=(2,), timeout=300):
        grads, losses = rank["right"]
        for name, got in grads.items():
            torch.testing.assert_close(got, want_grads[name], **TOL, msg=name)
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(want_losses), rtol=0, atol=1e-5
        )
        for wrong in ("experts over all ranks", "rest over expert-dp"):
            grads, losses = rank[wrong]
            off = max((g - want_grads[n]).abs().max().item() for n, g in grads.items())
            assert off > 1e-3, wrong  # gradients of other experts added, or replicas drifting
            assert max(abs(a - b) for a, b in zip(losses[1:], want_losses[1:], strict=True)) > 1e-4

"""ZeRO stages 1-3 from scratch: the same training as plain Adam, the memory each rank
holds against the formula, the bytes each rank sends against 2Ψ / 2Ψ / 3Ψ, and the same
parameters as PyTorch's ZeroRedundancyOptimizer (stage 1) and fully_shard (stage 3)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labsupport import launch
from labsupport.comm import traced
from labsupport.estimate.memory import training_memory
from labsupport.models import GPT, GPTConfig, random_tokens
from labsupport.parallel.zero import ZeRO

# vocabulary 61 and width 18: 9,522 parameters, divisible by neither 4 nor 3 (padding)
CONFIG = {"vocab_size": 61, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 18}
STEPS, BATCH, LR = 3, 12, 1e-3
# Adam's step is lr·m/(√v + ε), at most ~lr per element and step; the gradients differ
# from one process's by float32 rounding (reduction order, the /N), ~1e-6 relative, which
# moves a step by a few 1e-6 of lr only where a gradient is far from zero. 3 steps.
TOL = {"rtol": 1e-4, "atol": 1e-6}


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**CONFIG))


def params(m) -> dict:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def adam_reference() -> dict:
    m = model()
    opt = torch.optim.Adam(m.parameters(), lr=LR)
    for step in range(STEPS):
        idx, targets = random_tokens(BATCH, 8, 61, seed=step)
        opt.zero_grad()
        m(idx, targets)[1].backward()
        opt.step()
    return params(m)


def shard_of_batch(step: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    idx, targets = random_tokens(BATCH, 8, 61, seed=step)
    part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return idx[part], targets[part]


def train(stage: int) -> dict:
    m = model()
    zero = ZeRO(m, stage, lr=LR)
    for step in range(STEPS):
        idx, targets = shard_of_batch(step)
        zero.zero_grad()
        with traced.trace_collectives() as trace:
            m(idx, targets)[1].backward()
            after_backward = zero.state_bytes()
            zero.step()
    if stage == 3:  # gather the shards to compare whole parameters
        for _, unit in zero.units:
            unit.gather()
    padded = sum(u.padded for _, u in zero.units)
    return {"params": params(m), "memory": after_backward, "bytes": traced.bytes_per_rank(trace),
            "padded": padded}  # fmt: skip


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_trains_like_plain_adam(stage, world):
    want = adam_reference()
    for r in launch(train, world, args=(stage,), timeout=180):
        for n in want:
            torch.testing.assert_close(r["params"][n], want[n], **TOL, msg=n)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_each_rank_holds_is_the_formula(stage):
    world, numel = 4, sum(p.numel() for p in model().parameters())
    formula = training_memory(numel, "fp32", stage, world)
    for r in launch(train, world, args=(stage,), timeout=180):
        padding = (r["padded"] - numel) * 4  # each unit padded to a multiple of 4
        got = r["memory"]
        full = stage < 2  # stage 1 keeps the full gradients until step()
        assert got["gradients"] == (numel * 4 if full else r["padded"] * 4 // world)
        assert got["optimizer states"] == r["padded"] * 8 // world
        params_formula = formula["weights"]
        assert params_formula <= got["parameters"] <= params_formula + padding
        assert formula["momentum"] + formula["variance"] <= got["optimizer states"]
        assert got["optimizer states"] <= formula["momentum"] + formula["variance"] + 2 * padding


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_each_rank_sends_per_step(stage):
    world = 4
    for r in launch(train, world, args=(stage,), timeout=180):
        times = 3 if stage == 3 else 2  # 2Ψ: reduce-scatter + all-gather; stage 3: + a gather
        assert r["bytes"] == pytest.approx(times * r["padded"] * 4 * (world - 1) / world)


def torch_zero(kind: str) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    m = model()
    if kind == "zero1":
        ddp = torch.nn.parallel.DistributedDataParallel(m)
        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in m.h:
            fully_shard(block, mesh=mesh)
        ddp = fully_shard(m, mesh=mesh)
        opt = torch.optim.Adam(m.parameters(), lr=LR)
    for step in range(STEPS):
        idx, targets = shard_of_batch(step)
        opt.zero_grad()
        ddp(idx, targets)[1].backward()
        opt.step()
    if kind == "zero1":
        return params(m)
    return {n: p.full_tensor().detach().clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize(("stage", "kind"), [(1, "zero1"), (3, "fsdp2")])
def test_the_same_training_as_pytorchs_own(stage, kind):
    ours = launch(train, 4, args=(stage,), timeout=180)
    theirs = launch(torch_zero, 4, args=(kind,), timeout=180)
    for mine, torch_rank in zip(ours, theirs, strict=True):
        for n in torch_rank:
            torch.testing.assert_close(mine["params"][n], torch_rank[n], **TOL, msg=n)


def peak_inside_backward(stage: int) -> dict:
    """The most bytes of full-size gradients and of gathered weights this rank holds at
    any point of a backward pass (looked at after every gradient arrives), on a GPT of
    4 blocks; and each unit's full size."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(**{**CONFIG, "n_layer": 4}))
    zero = ZeRO(m, stage, lr=LR)
    peak = {"gradients": 0, "gathered": 0}

    def look(_):
        grads = sum(p.grad.nbytes for _, u in zero.units for p in u.params if p.grad is not None)
        gathered = sum(u.full.untyped_storage().nbytes() for _, u in zero.units)
        peak["gradients"] = max(peak["gradients"], grads)
        peak["gathered"] = max(peak["gathered"], gathered)

    for p in m.parameters():  # after ZeRO's own hooks
        p.register_post_accumulate_grad_hook(look)
    idx, targets = shard_of_batch(0)
    m(idx, targets)[1].backward()
    sizes = [u.padded * 4 for _, u in zero.units]  # the blocks, then the root
    numel = sum(p.numel() for p in m.parameters())
    return {**peak, "sizes": sizes, "full": numel * 4}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stages_2_and_3_free_as_the_backward_goes(stage):
    """Stage 1 holds every gradient before it reduce-scatters; stage 2 never holds more
    than the root's and two blocks' (the one finishing, the next starting); stage 3 also
    holds gathered weights for at most the root and two blocks."""
    for r in launch(peak_inside_backward, 3, args=(stage,), timeout=180):
        if stage == 1:  # one unit, the whole model
            assert r["gradients"] == r["full"]
            continue
        *blocks, root = r["sizes"]
        bound = root + 2 * max(blocks)
        assert r["gradients"] <= bound < r["full"]
        if stage == 3:
            assert r["gathered"] <= bound < sum(r["sizes"])

"""ZeRO stages 1-3 from scratch.

* Exactly torch's optimizers, at every stage and on 2, 3 and 4 ranks: a toy model with a
  branch one rank uses, a layer some steps use, a layer no step uses, a frozen layer and
  a tied weight, stepped by Adam, Adam with L2 decay and AdamW, against one process; the
  per-parameter step counts too, across a checkpoint.
* The lab's GPT: the same training as plain Adam, the memory each rank holds against the
  formula, the bytes each rank sends against 2Ψ / 2Ψ / 3Ψ, the same parameters as
  PyTorch's ZeroRedundancyOptimizer (stage 1) and fully_shard (stage 3), and stages 2 and
  3 freeing as the backward pass goes.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport import LaunchError, launch
from labsupport.comm import traced
from labsupport.estimate.memory import training_memory
from labsupport.labs.lab14_zero import param_mismatches
from labsupport.models import GPT, GPTConfig, random_tokens
from labsupport.parallel import checkpoint as ck
from labsupport.parallel.zero import ZeRO

STAGES = (1, 2, 3)


def params(m) -> dict:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def gather_all(zero) -> None:
    if zero.stage == 3:  # gather the shards to compare whole parameters
        for _, unit in zero.units:
            unit.gather()


def part(rank: int, world: int, batch: int) -> slice:
    return slice(rank * batch // world, (rank + 1) * batch // world)


# --------------------------------------------------------------------------- exactness

# width 5, vocabulary 11: units of 103 and 85 (the blocks) and 65 (the root) elements,
# 253 in all, which none of 2, 3 and 4 divides
D, VOCAB, SEQ, TOY_BATCH, TOY_STEPS = 5, 11, 4, 12, 4
SOMETIMES = (0, 2)  # the steps that use each block's `sometimes` layer
OPTIMIZERS = {
    "Adam": (torch.optim.Adam, {"lr": 1e-2}),
    "Adam, L2 decay": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}
# the gradients differ from one process's by float32 rounding (reduction order, the /N)
TOY_TOL = {"rtol": 1e-5, "atol": 1e-7}


class Block(nn.Module):
    """`fc` always; `branch` on one rank only; `sometimes` at some steps; `never` (if
    any), never; `frozen`, always, frozen."""

    def __init__(self, branch_rank: int, never: bool):
        super().__init__()
        self.fc, self.branch = nn.Linear(D, D), nn.Linear(D, D)
        self.sometimes = nn.Linear(D, D, bias=False)
        if never:
            self.never = nn.Linear(D, 3)
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        self.branch_rank, self.rank, self.step = branch_rank, 0, 0

    def forward(self, x):
        h = torch.tanh(self.fc(x)) + self.frozen(x)
        if self.rank == self.branch_rank:
            h = h + self.branch(x)
        if self.step in SOMETIMES:
            h = h * torch.sigmoid(self.sometimes(x))
        return x + h


class Toy(nn.Module):
    """Two blocks (block i's branch runs on rank i; block 1 has no `never`: so on rank 1
    only, every one of its parameters gets a gradient) between an embedding and a head
    that share their weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(VOCAB, D)
        self.h = nn.ModuleList([Block(0, never=True), Block(1, never=False)])
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets, rank: int, step: int):
        x = self.wte(idx)
        for block in self.h:
            block.rank, block.step = rank, step
            x = block(x)
        logits = self.head(self.ln_f(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def toy_batch(step: int, rank: int, world: int):
    idx, targets = random_tokens(TOY_BATCH, SEQ, VOCAB, seed=step)
    share = part(rank, world, TOY_BATCH)
    return idx[share], targets[share]


def toy_reference(name: str, worlds) -> tuple[dict, dict]:
    """One process: at step ``s``, every one of ``worlds[s]`` ranks' shares with that
    rank's branches, the losses averaged (DDP's average gradient); the parameters and
    each one's step count."""
    optimizer_class, options = OPTIMIZERS[name]
    m = Toy()
    opt = optimizer_class(m.parameters(), **options)
    for step, world in enumerate(worlds):
        opt.zero_grad()
        losses = [m(*toy_batch(step, r, world), r, step)[1] for r in range(world)]
        (sum(losses) / world).backward()
        opt.step()
    steps = {n: opt.state[p].get("step") for n, p in m.named_parameters()}
    return params(m), {n: None if s is None else float(s) for n, s in steps.items()}


def toy_zero(stage: int, name: str, m=None, zero=None, steps=range(TOY_STEPS), prefetch=0):
    optimizer_class, options = OPTIMIZERS[name]
    if zero is None:
        m = Toy()
        zero = ZeRO(m, stage, optimizer_class=optimizer_class, prefetch=prefetch, **options)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        zero.zero_grad()
        with traced.trace_collectives() as trace:
            m(*toy_batch(step, rank, world), rank, step)[1].backward()
            zero.step()
    counts = {}
    for _, unit in zero.units:
        for n, piece in zip(unit.names, unit.pieces, strict=True):
            count = zero.optimizer.state.get(piece, {}).get("step")
            counts[n] = None if count is None else float(count)
    gather_all(zero)
    return {"params": params(m), "steps": counts, "calls": [c[:2] for c in trace.calls]}


def toy_runs() -> dict:
    runs = {(stage, name): toy_zero(stage, name) for stage in STAGES for name in OPTIMIZERS}
    for k in (1, 2):  # stage 3 gathering the next unit(s) ahead, in the same launch
        runs[f"3, prefetch {k}", "AdamW"] = toy_zero(3, "AdamW", prefetch=k)
    return runs


@functools.cache
def toy_launch(world: int) -> list:
    """Every stage with every optimizer on ``world`` ranks, in one launch (shared)."""
    return launch(toy_runs, world, timeout=300)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_stage_steps_each_parameter_as_torchs_optimizer_does(world):
    """A parameter no rank used is not stepped (value, moments, step count: unchanged),
    one some ranks used gets the average with the others' zeros, and each keeps its own
    step count; every rank calls the same collectives in the same order, whichever
    parameters it used."""
    ranks = toy_launch(world)
    first = params(Toy())
    untouched = [n for n in first if ".never." in n or ".frozen." in n]
    trainable = {n for n, p in Toy().named_parameters() if p.requires_grad}
    for name in OPTIMIZERS:
        want, want_steps = toy_reference(name, [world] * TOY_STEPS)
        for stage in STAGES:
            for rank, runs in enumerate(ranks):
                got, where = runs[stage, name], f"{name}, stage {stage}, rank {rank}"
                for n in want:
                    torch.testing.assert_close(got["params"][n], want[n], **TOY_TOL, msg=where)
                for n in untouched:
                    assert torch.equal(got["params"][n], first[n]), f"{where}: {n} moved"
                assert got["steps"] == {n: want_steps[n] for n in got["steps"]}, where
                assert set(got["steps"]) == trainable, where
                assert got["calls"] == ranks[0][stage, name]["calls"], where
    want, want_steps = toy_reference("AdamW", [world] * TOY_STEPS)
    for k in (1, 2):  # prefetching moves the gathers earlier, in the same order on every rank
        for rank, runs in enumerate(ranks):
            got, where = runs[f"3, prefetch {k}", "AdamW"], f"prefetch {k}, rank {rank}"
            for n in want:
                torch.testing.assert_close(got["params"][n], want[n], **TOY_TOL, msg=where)
            assert got["steps"] == {n: want_steps[n] for n in got["steps"]}, where
            assert got["calls"] == ranks[0][f"3, prefetch {k}", "AdamW"]["calls"], where
            assert sorted(got["calls"]) == sorted(runs[3, "AdamW"]["calls"]), where


def test_only_elementwise_optimizers_are_accepted():
    with pytest.raises(TypeError, match="Adafactor"):
        ZeRO(Toy(), 1, optimizer_class=torch.optim.Adafactor, lr=1e-2)
    with pytest.raises(TypeError, match="optimizer class"):
        m = Toy()
        ZeRO(m, 2, optimizer_class=torch.optim.Adam(m.parameters()))


def borrowing(stage: int) -> None:
    """The embedding also multiplies by block 1's `fc` weight: a parameter used outside
    its unit, and before it, so its gradient is complete only after block 1's backward."""
    m = Toy()
    m.wte.forward = lambda idx, e=m.wte: F.embedding(idx, e.weight) @ m.h[1].fc.weight
    zero = ZeRO(m, stage, lr=1e-2)
    m(*toy_batch(0, dist.get_rank(), dist.get_world_size()), 0, 0)[1].backward()
    zero.step()


def test_a_gradient_after_its_units_backward_is_refused():
    with pytest.raises(LaunchError, match=r"h\.1\.fc\.weight.*after their unit's backward"):
        launch(borrowing, 2, args=(2,), timeout=120)


def toy_resume(path: str, resume: bool) -> dict:
    """AdamW at stages 1 and 3, saved after 2 steps (the `sometimes` layers stepped once,
    the rest twice) or resumed from there."""
    out = {}
    for stage in (1, 3):
        m = Toy()
        zero = ZeRO(m, stage, optimizer_class=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        where = f"{path}/stage{stage}"
        if resume:
            ck.load({"zero": ck.zero_state(zero)}, where)
            ck.restore_zero(zero)
            out[stage] = toy_zero(stage, "AdamW", m, zero, range(2, TOY_STEPS))
        else:
            out[stage] = toy_zero(stage, "AdamW", m, zero, range(2))
            ck.save({"zero": ck.zero_state(zero)}, where)
    return out


def test_per_parameter_step_counts_survive_a_checkpoint_and_a_new_world_size(tmp_path):
    """Saved on 3 ranks after 2 steps; resumed on 3 (bitwise the straight run) and on 2
    (one process doing the same: 2 steps as 3 ranks, 2 as 2)."""
    launch(toy_resume, 3, args=(str(tmp_path), False), timeout=180)
    straight = toy_launch(3)[0]
    same = launch(toy_resume, 3, args=(str(tmp_path), True), timeout=180)[0]
    fewer = launch(toy_resume, 2, args=(str(tmp_path), True), timeout=180)[0]
    want, want_steps = toy_reference("AdamW", [3, 3, 2, 2])
    # a parameter never stepped comes back with step 0: the state Adam would start from
    want_steps = {n: s or 0.0 for n, s in want_steps.items()}
    for stage in (1, 3):
        for n, p in straight[stage, "AdamW"]["params"].items():
            assert torch.equal(same[stage]["params"][n], p), (stage, n)
            torch.testing.assert_close(fewer[stage]["params"][n], want[n], **TOY_TOL)
        for got in (same[stage], fewer[stage]):
            assert got["steps"] == {n: want_steps[n] for n in got["steps"]}, stage
            assert got["steps"]["h.0.sometimes.weight"] == len(SOMETIMES)


# --------------------------------------------------------------------------- the lab's GPT

# vocabulary 61 and width 18: 9,522 parameters, divisible by neither 4 nor 3 (padding)
CONFIG = {"vocab_size": 61, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 18}
STEPS, BATCH, LR = 3, 12, 1e-3


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**CONFIG))


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
    idx, targets = random_tokens(BATCH, 8, 61, seed=step)
    share = part(dist.get_rank(), dist.get_world_size(), BATCH)
    return idx[share], targets[share]


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
    gather_all(zero)
    flags = traced.Trace([c for c in trace.calls if c[0] == "all_reduce"])
    states = traced.Trace([c for c in trace.calls if c[0] != "all_reduce"])
    return {
        "params": params(m),
        "memory": after_backward,
        "bytes": traced.bytes_per_rank(states),
        "flag bytes": traced.bytes_per_rank(flags),
        "padded": sum(u.padded for _, u in zero.units),
        "tensors": sum(len(u.params) for _, u in zero.units),
    }


def train_stages() -> dict:
    return {stage: train(stage) for stage in STAGES}


@functools.cache
def gpt_runs(world: int) -> list:
    """Every stage on ``world`` ranks, in one launch (shared by the tests below)."""
    return launch(train_stages, world, timeout=300)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_stage_trains_like_plain_adam(world):
    want = adam_reference()
    for r in gpt_runs(world):
        for stage in STAGES:
            assert not param_mismatches(r[stage]["params"], want), (stage, world)


@pytest.mark.parametrize("stage", STAGES)
def test_memory_each_rank_holds_is_the_formula(stage):
    world, numel = 4, sum(p.numel() for p in model().parameters())
    formula = training_memory(numel, "fp32", stage, world)
    moments = formula["momentum"] + formula["variance"]
    ranks = [r[stage] for r in gpt_runs(world)]
    for r in ranks:
        padding = (r["padded"] - numel) * 4  # each unit padded to a multiple of 4
        got = r["memory"]
        full = stage < 2  # stage 1 keeps the full gradients until step()
        assert got["gradients"] == (numel * 4 if full else r["padded"] * 4 // world)
        assert formula["weights"] <= got["parameters"] <= formula["weights"] + padding
        # the optimizer steps the parameters' pieces, never the padding
        assert abs(got["optimizer states"] - moments) <= 2 * padding
    assert sum(r["memory"]["optimizer states"] for r in ranks) == 8 * numel


@pytest.mark.parametrize("stage", STAGES)
def test_bytes_each_rank_sends_per_step(stage):
    world = 4
    for r in (r[stage] for r in gpt_runs(world)):
        times = 3 if stage == 3 else 2  # 2Ψ: reduce-scatter + all-gather; stage 3: + a gather
        assert r["bytes"] == pytest.approx(times * r["padded"] * 4 * (world - 1) / world)
        # one byte per parameter tensor: which got a gradient on some rank
        assert r["flag bytes"] == pytest.approx(2 * r["tensors"] * (world - 1) / world)


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
    theirs = launch(torch_zero, 4, args=(kind,), timeout=180)
    for mine, torch_rank in zip(gpt_runs(4), theirs, strict=True):
        assert not param_mismatches(mine[stage]["params"], torch_rank)


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

    for p in m.parameters():
        p.register_post_accumulate_grad_hook(look)
    idx, targets = shard_of_batch(0)
    m(idx, targets)[1].backward()
    sizes = [u.padded * 4 for _, u in zero.units]  # the blocks, then the root
    numel = sum(p.numel() for p in m.parameters())
    return {**peak, "sizes": sizes, "full": numel * 4}


def peaks() -> dict:
    return {stage: peak_inside_backward(stage) for stage in STAGES}


def test_stages_2_and_3_free_as_the_backward_goes():
    """Stage 1 holds every gradient before it reduce-scatters; stage 2 never holds more
    than the root's and two blocks' (the one finishing, the next starting); stage 3 also
    holds gathered weights for at most the root and two blocks."""
    for by_stage in launch(peaks, 3, timeout=180):
        for stage, r in by_stage.items():
            if stage == 1:  # one unit, the whole model
                assert r["gradients"] == r["full"]
                continue
            *blocks, root = r["sizes"]
            bound = root + 2 * max(blocks)
            assert r["gradients"] <= bound < r["full"]
            if stage == 3:
                assert r["gathered"] <= bound < sum(r["sizes"])


def prefetch_peaks() -> dict:
    """A 4-block GPT, one step of ZeRO-3 with 0, 1 and 2 units prefetched: the most bytes
    of gathered weights held at once, the unit sizes, the loss and the parameters."""
    out = {}
    for k in (0, 1, 2):
        torch.manual_seed(0)
        m = GPT(GPTConfig(**{**CONFIG, "n_layer": 4}))
        zero = ZeRO(m, 3, prefetch=k, lr=LR)
        idx, targets = shard_of_batch(0)
        loss = m(idx, targets)[1]
        loss.backward()
        zero.step()
        gather_all(zero)
        units = [4 * u.padded for _, u in zero.units]  # the blocks, then the root
        out[k] = {
            "peak": zero.gathered_peak,
            "units": units,
            "loss": loss.item(),
            "params": params(m),
        }
    return out


def test_prefetching_holds_the_root_the_running_unit_and_the_prefetched_ones():
    for r in launch(prefetch_peaks, 2, timeout=300):
        *blocks, root = r[0]["units"]
        assert len(set(blocks)) == 1
        for k in (0, 1, 2):
            assert r[k]["peak"] == root + (1 + k) * blocks[0], k
            assert r[k]["loss"] == r[0]["loss"]
            for n, p in r[0]["params"].items():
                assert torch.equal(r[k]["params"][n], p), (k, n)
    with pytest.raises(ValueError, match="only stage 3"):
        ZeRO(model(), 2, prefetch=1)

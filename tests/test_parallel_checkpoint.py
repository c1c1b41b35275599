"""Distributed checkpoints: resume exactly, reshard from 4 ranks to 2, lose nothing, and
refuse, clearly and before changing anything, a checkpoint that is missing, incomplete or
damaged: a block zeroed or a bit flipped in place, a truncated ``.metadata``, a shard of
another run copied in."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.utils._pytree import tree_leaves

from labsupport import LaunchError, launch
from labsupport.models import GPT, GPTConfig, random_tokens
from labsupport.parallel import checkpoint as ck
from labsupport.parallel.zero import ZeRO

CONFIG = {"vocab_size": 61, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 18}
BATCH = 12


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**CONFIG))


def train(m, zero, first: int, last: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(first, last):
        idx, targets = random_tokens(BATCH, 8, 61, seed=step)
        part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        zero.zero_grad()
        m(idx[part], targets[part])[1].backward()
        zero.step()


def whole(m, zero) -> list[torch.Tensor]:
    if zero.stage == 3:
        for _, unit in zero.units:
            unit.gather()
    return [p.detach().clone() for p in m.parameters()]


def run(path: str, stage: int, resume: bool) -> list:
    m = model()
    zero = ZeRO(m, stage, lr=1e-2)
    state = {"zero": ck.zero_state(zero), "step": torch.tensor(0), "rng": ck.rng_state()}
    if resume:
        ck.load(state, path)
        ck.restore_zero(zero)
        ck.set_rng_state(state["rng"])
    else:
        train(m, zero, 0, 3)
        torch.manual_seed(100 + dist.get_rank())  # a different generator state per rank
        state = {"zero": ck.zero_state(zero), "step": torch.tensor(3), "rng": ck.rng_state()}
        ck.save(state, path)
    draw = torch.rand(1).item()  # the same on resume only if the RNG state came back
    train(m, zero, int(state["step"]), 5)
    return [whole(m, zero), draw]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_is_exact_and_a_checkpoint_of_4_ranks_loads_on_2(tmp_path, stage):
    path = str(tmp_path / "ckpt")
    straight = launch(run, 4, args=(path, stage, False), timeout=180)
    same = launch(run, 4, args=(path, stage, True), timeout=180)
    for a, b in zip(straight, same, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
        assert a[1] == b[1]
    fewer = launch(run, 2, args=(path, stage, True), timeout=180)
    for x, y in zip(straight[0][0], fewer[0][0], strict=True):
        # 2 ranks average gradients in another order than 4: float32 rounding, two steps
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def parts(path: str, load: tuple) -> dict:
    """Save a ZeRO-1 run's parameters and optimizer states under keys of their own (with
    nothing in ``load``), or load the parts named in ``load`` into a fresh run: what the
    fresh run's shards and Adam's first moments then hold."""
    m = model()
    zero = ZeRO(m, 1, lr=1e-2)
    if not load:
        train(m, zero, 0, 2)
        state = {"parameters": ck.zero_parameters(zero), "optimizer": ck.zero_optimizer(zero)}
        ck.save(state, path)
    else:
        ck.load({part: getattr(ck, f"zero_{part}")(zero) for part in load}, path)
        ck.restore_zero(zero)
    adam = [zero.optimizer.state[p].get("exp_avg") for _, u in zero.units for p in u.pieces]
    return {
        "shard": [u.shard.detach().clone() for _, u in zero.units],
        "exp_avg": [a.clone() if a is not None else None for a in adam],
        "whole": [p.detach().clone() for p in m.parameters()],
    }


def test_the_parameters_and_the_optimizer_states_load_apart(tmp_path):
    path = str(tmp_path / "parts")
    saved = launch(parts, 2, args=(path, ()), timeout=180)
    only_model = launch(parts, 2, args=(path, ("parameters",)), timeout=180)
    both = launch(parts, 2, args=(path, ("parameters", "optimizer")), timeout=180)
    for want, model_only, whole in zip(saved, only_model, both, strict=True):
        for key in ("shard", "whole"):
            assert all(torch.equal(a, b) for a, b in zip(want[key], model_only[key], strict=True))
            assert all(torch.equal(a, b) for a, b in zip(want[key], whole[key], strict=True))
        assert all(a is None for a in model_only["exp_avg"])  # Adam would start over
        assert all(
            torch.equal(a, b) for a, b in zip(want["exp_avg"], whole["exp_avg"], strict=True)
        )


def plain_per_rank(path: str, resume: bool) -> list:
    mine = torch.full((3,), float(dist.get_rank()))
    state = {"mine": mine if not resume else torch.zeros(3)}
    if resume:
        dcp.load(state, checkpoint_id=path)
    else:
        dcp.save(state, checkpoint_id=path)
    return state["mine"].tolist()


def test_the_trap_per_rank_plain_tensors_under_one_key_are_kept_once(tmp_path):
    """Why the shards are DTensors: DCP takes a plain tensor as replicated."""
    path = str(tmp_path / "plain")
    launch(plain_per_rank, 3, args=(path, False), timeout=120)
    loaded = launch(plain_per_rank, 3, args=(path, True), timeout=120)
    assert loaded == [[0.0] * 3] * 3  # ranks 1 and 2 saved 1s and 2s: lost


def trained(steps: int) -> dict:
    """A state of a ZeRO-1 run after ``steps`` steps: Adam's moments far from zero."""
    m = model()
    zero = ZeRO(m, 1, lr=1e-2)
    train(m, zero, 0, steps)
    return {"zero": ck.zero_state(zero), "step": steps, "rng": ck.rng_state()}


def values(state: dict) -> list:
    leaves = tree_leaves(state)
    return [x.to_local().clone() if hasattr(x, "to_local") else x for x in leaves]


def save_trained(path: str, steps: int) -> list:
    state = trained(steps)
    ck.save(state, path)
    return values(state)


def try_loads(cases: list) -> list:
    """Load each checkpoint of ``cases`` (``(path, extra_key)``) into a state trained
    for 1 step; for each, the error and the state's values before and after."""
    outcomes = []
    for path, extra_key in cases:
        state = trained(1)
        if extra_key:
            state["extra"] = torch.ones(2)
        before, error = values(state), None
        try:
            ck.load(state, path)
        except RuntimeError as exc:  # ck.CheckpointError is a RuntimeError
            error = str(exc)
        outcomes.append((error, before, values(state)))
    return outcomes


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=False)
    )


def inside_a_tensor(folder: Path, name: str) -> int:
    """An offset in ``name`` that falls in a tensor's bytes, not in the headers of the
    ``torch.save`` archive around them: the middle of the file's largest item, on the
    last byte of a float32 (its sign and exponent), as ``.metadata`` places it."""
    storage = FileSystemReader(str(folder)).read_metadata().storage_data
    item = max((s for s in storage.values() if s.relative_path == name), key=lambda s: s.length)
    return item.offset + item.length // 2 // 4 * 4 + 3


def damage(folder: Path, name: str, how: str, other: Path) -> None:
    file = folder / name
    data = bytearray(file.read_bytes())
    if how == "a 4 KiB block zeroed":
        middle = inside_a_tensor(folder, name)
        data[middle - 2048 : middle + 2048] = bytes(4096)
    elif how == "one bit flipped":
        data[inside_a_tensor(folder, name)] ^= 0x40  # the exponent's highest bit
    elif how == "truncated":
        data = data[: len(data) // 2]
    elif how == "emptied":
        data = bytearray()
    elif how == "copied from another run":
        data = bytearray((other / name).read_bytes())
    elif how == "deleted":
        file.unlink()
        return
    elif how == "a line garbled":
        data[10:20] = b"not a hash"
    file.write_bytes(bytes(data))


#: What is done to which file of a checkpoint of 3 ranks, and what the refusal must say.
DAMAGE = [
    (
        "__1_0.distcp",
        "a 4 KiB block zeroed",
        "damaged: __1_0.distcp has changed since it was saved",
    ),
    ("__2_0.distcp", "one bit flipped", "damaged: __2_0.distcp has changed since it was saved"),
    (".metadata", "truncated", "damaged: .metadata has changed since it was saved"),
    ("__1_0.distcp", "copied from another run", "damaged: __1_0.distcp has changed"),
    ("__0_0.distcp", "emptied", "damaged: __0_0.distcp has changed"),
    ("__0_0.distcp", "deleted", "damaged: __0_0.distcp is missing"),
    ("SHA256SUMS", "a line garbled", "damaged: SHA256SUMS has a line that is not"),
    ("SHA256SUMS", "deleted", "incomplete: it has no SHA256SUMS, which is written last"),
]


def test_a_damaged_checkpoint_is_refused_on_every_rank_and_nothing_is_changed(tmp_path):
    """DCP alone loads a shard damaged in place (on the old code, this test fails at the
    zeroed block: the load succeeds and Adam's moments come back partly zero)."""
    good, other = tmp_path / "good", tmp_path / "other"
    saved = launch(save_trained, 3, args=(str(good), 2), timeout=180)
    launch(save_trained, 3, args=(str(other), 3), timeout=180)  # same shapes, other values
    cases = []
    for i, (name, how, _) in enumerate(DAMAGE):
        shutil.copytree(good, tmp_path / f"case{i}")
        damage(tmp_path / f"case{i}", name, how, other)
        cases.append((str(tmp_path / f"case{i}"), False))
    cases += [(str(good), False), (str(good), True)]
    results = launch(try_loads, 3, args=(cases,), timeout=180)
    for rank, outcomes in enumerate(results):
        for (name, how, message), (error, before, after) in zip(DAMAGE, outcomes, strict=False):
            assert error is not None, f"rank {rank}: {name} {how}, and it loaded"
            assert message in error and "resume from the previous checkpoint" in error, error
            assert same(after, before), f"rank {rank}: {name} {how}: the state was changed"
        error, before, after = outcomes[len(DAMAGE)]  # the intact checkpoint: bit for bit
        assert error is None and same(after, saved[rank]) and not same(before, saved[rank])
        error, before, after = outcomes[len(DAMAGE) + 1]  # a key the checkpoint lacks
        assert "matches its checksums but cannot be loaded" in error
        assert "RuntimeError: Missing key in checkpoint state_dict: extra" in error
        assert "tuple" not in error and same(after, before)


def load_into(path: str) -> None:
    zero = ZeRO(model(), 1, lr=1e-2)
    ck.load({"zero": ck.zero_state(zero)}, path)


def save_one(path: str) -> None:
    zero = ZeRO(model(), 1, lr=1e-2)
    ck.save({"zero": ck.zero_state(zero)}, path)


def test_missing_and_corrupt_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(LaunchError, match="no checkpoint at"):
        launch(load_into, 2, args=(str(tmp_path / "none"),), timeout=120)
    corrupt = tmp_path / "corrupt"
    launch(save_one, 2, args=(str(corrupt),), timeout=120)
    for data in Path(corrupt).glob("*.distcp"):
        data.write_bytes(b"not a checkpoint")
    with pytest.raises(LaunchError, match="__0_0.distcp has changed since it was saved"):
        launch(load_into, 2, args=(str(corrupt),), timeout=120)
    assert os.path.exists(corrupt / ".metadata")
    with pytest.raises(ck.CheckpointError, match="__0_0.distcp has changed .*; __1_0.distcp"):
        ck.verify(str(corrupt))  # in one process, every file


def test_a_dcp_failure_is_described_by_its_exception_not_the_pair_that_carries_it():
    """DCP's ``failures`` hold ``(exception, traceback)`` pairs: the old message read
    ``tuple: (EOFError(), [...])``."""
    failed = CheckpointException(
        "read", {2: (EOFError(), None), 1: (RuntimeError("size mismatch\nat ..."), None)}
    )
    rank, cause = ck.first_failure(failed, rank=0)
    assert rank == 1 and ck.describe(cause) == "RuntimeError: size mismatch"
    _, cause = ck.first_failure(CheckpointException("read", {2: (EOFError(), None)}), rank=0)
    assert ck.describe(cause) == "EOFError"  # no message: no colon, no IndexError
    mine = ValueError("mine")
    assert ck.first_failure(mine, rank=3) == (3, mine)  # not from DCP: this rank's own

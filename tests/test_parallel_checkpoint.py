"""Distributed checkpoints: resume exactly, reshard from 4 ranks to 2, lose nothing, and
say clearly when a checkpoint is missing, partial or corrupt."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

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


def load_into(path: str) -> None:
    zero = ZeRO(model(), 1, lr=1e-2)
    ck.load({"zero": ck.zero_state(zero)}, path)


def save_one(path: str) -> None:
    zero = ZeRO(model(), 1, lr=1e-2)
    ck.save({"zero": ck.zero_state(zero)}, path)


def test_missing_partial_and_corrupt_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(LaunchError, match="no checkpoint at"):
        launch(load_into, 2, args=(str(tmp_path / "none"),), timeout=120)
    partial = tmp_path / "partial"
    launch(save_one, 2, args=(str(partial),), timeout=120)
    (partial / ".metadata").unlink()
    with pytest.raises(LaunchError, match="incomplete"):
        launch(load_into, 2, args=(str(partial),), timeout=120)
    corrupt = tmp_path / "corrupt"
    launch(save_one, 2, args=(str(corrupt),), timeout=120)
    for data in Path(corrupt).glob("*.distcp"):
        data.write_bytes(b"not a checkpoint")
    with pytest.raises(LaunchError, match="cannot be read"):
        launch(load_into, 2, args=(str(corrupt),), timeout=120)
    assert os.path.exists(corrupt / ".metadata")

"""Lab 4, section 3: activation checkpointing on MLPStack, the bytes saved and the peak
against chapter 4's formulas, the recomputation counted in FLOPs and timed."""

from __future__ import annotations

import pytest
import torch

from labsupport.estimate.memory import checkpoint_peak_bytes, checkpoint_saved_bytes
from labsupport.labs import lab04_checkpointing
from labsupport.models import MLPStack


@pytest.mark.parametrize("segment", [None, 1, 2, 3, 4])
def test_saved_bytes_match_formula(segment):
    stack, x = MLPStack(4, 16), torch.randn(8, 16)
    assert lab04_checkpointing.saved_bytes(stack, x, segment) == checkpoint_saved_bytes(
        4, 8, 16, segment
    )


def test_step_memory_near_chen_formula():
    layers, batch, d = 8, 64, 32
    stack, x = MLPStack(layers, d), torch.randn(batch, d)
    unit = batch * d * 4
    for segment in (None, 1, 2, 8):
        m = lab04_checkpointing.step_memory(stack, x, segment)
        assert m["after_forward"] == checkpoint_saved_bytes(layers, batch, d, segment)
        excess = (m["peak"] - checkpoint_peak_bytes(layers, batch, d, segment)) / unit
        assert 0 <= excess < 12, f"segment {segment}: peak exceeds the formula by {excess} units"


@pytest.mark.parametrize("segment", [1, 2, 4])
def test_recompute_flops_are_the_textbook_s_less_what_pytorch_need_not_recompute(segment):
    """Plain: 3 forwards (backward is 2). Checkpointed: one forward more, less fc2 of each
    segment's last block, whose output backward never needs: 4/3 - 1/(6s)."""
    layers, batch, d = 4, 8, 16
    stack, x = MLPStack(layers, d), torch.randn(batch, d, requires_grad=True)
    forward = layers * 2 * (2 * batch * d * 4 * d)  # two matmuls per block
    counted = lab04_checkpointing.recompute_flops(stack, x, segment)
    assert counted["plain"] == 3 * forward
    extra = forward - (layers // segment) * forward // (2 * layers)
    assert counted["checkpointed"] == 3 * forward + extra
    assert counted["checkpointed"] / counted["plain"] == pytest.approx(4 / 3 - 1 / (6 * segment))


@pytest.mark.parametrize("segment", [1, 2])
def test_without_early_stop_the_recomputation_is_the_textbook_s(segment):
    """set_checkpoint_early_stop(False) reruns each segment whole: 4/3 of the FLOPs."""
    stack, x = MLPStack(4, 16), torch.randn(8, 16, requires_grad=True)
    counted = lab04_checkpointing.recompute_flops(stack, x, segment, early_stop=False)
    assert counted["checkpointed"] * 3 == counted["plain"] * 4


def test_recompute_ratio_times_a_step_that_reruns_the_forward(monkeypatch):
    """The timing itself is side_by_side's (tests/test_measure.py); here, that the
    checkpointed step really runs each block's forward twice, for the same gradients."""
    stack, x = MLPStack(4, 16), torch.randn(8, 16)
    forwards = []
    for block in stack.blocks:
        block.register_forward_pre_hook(lambda *args: forwards.append(1))
    seen = {}

    def one_round(fns, rounds):
        for name, fn in fns.items():
            before = len(forwards)
            fn()
            seen[name] = (len(forwards) - before, [p.grad.clone() for p in stack.parameters()])
        return {"plain": 2.0, "checkpointed": 3.0, "ratio": {"plain": 1.0, "checkpointed": 1.5}}

    monkeypatch.setattr(lab04_checkpointing, "side_by_side", one_round)
    assert lab04_checkpointing.recompute_ratio(stack, x, segment=2, rounds=3) == {
        "plain": 2.0,
        "checkpointed": 3.0,
        "ratio": 1.5,
    }
    assert seen["plain"][0] == 4 and seen["checkpointed"][0] == 8
    for plain, checkpointed in zip(seen["plain"][1], seen["checkpointed"][1], strict=True):
        torch.testing.assert_close(checkpointed, plain, rtol=1e-6, atol=1e-6)

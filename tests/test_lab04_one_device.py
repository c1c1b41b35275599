"""Lab 4, one device faster: gradient accumulation (one process and several), mixed
precision, activation checkpointing and fusion, checked against PyTorch and against
values worked out by hand; and the exercises' checkers."""

from __future__ import annotations

import math

import pytest
import torch

from labsupport import launch
from labsupport.estimate.dtypes import FORMATS
from labsupport.estimate.memory import checkpoint_peak_bytes, checkpoint_saved_bytes
from labsupport.labs import lab04_one_device
from labsupport.models import MLPStack, regression_data

# --------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("k", [1, 2, 4, 8, 64])
def test_accumulated_gradient_equals_big_batch(k):
    model = lab04_one_device.make_mlp()
    x, y = regression_data(n=64)
    assert torch.allclose(
        lab04_one_device.accumulated_gradient(model, x, y, k),
        lab04_one_device.batch_gradient(model, x, y),
    )


def test_accumulation_without_dividing_by_k_is_k_times_too_big():
    model = lab04_one_device.make_mlp()
    x, y = regression_data(n=64)
    model.zero_grad()
    for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
        torch.nn.functional.mse_loss(model(xm), ym).backward()
    assert torch.allclose(
        lab04_one_device.flat_grad(model),
        4 * lab04_one_device.batch_gradient(model, x, y),
        atol=1e-6,
    )


def test_batchnorm_breaks_the_equivalence():
    model = lab04_one_device.make_mlp(batchnorm=True)
    x, y = regression_data(n=64)
    big, accumulated = (
        lab04_one_device.batch_gradient(model, x, y),
        lab04_one_device.accumulated_gradient(model, x, y, 4),
    )
    assert not torch.allclose(big, accumulated, atol=1e-4)


def test_accumulation_rejects_unequal_chunks():
    with pytest.raises(ValueError, match="equal chunks"):
        lab04_one_device.accumulated_gradient(
            lab04_one_device.make_mlp(), *regression_data(n=10), 4
        )


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_gradient_equals_big_batch_on_every_rank(world_size):
    grads = launch(lab04_one_device.data_parallel_gradient, world_size, timeout=120)
    want = lab04_one_device.batch_gradient(lab04_one_device.make_mlp(), *regression_data(n=64))
    for grad in grads:
        assert torch.allclose(grad, want, atol=1e-7)
    assert all(torch.equal(grads[0], g) for g in grads)


# --------------------------------------------------------------------------- mixed precision


def test_rounding_error_is_at_most_unit_roundoff():
    x = torch.randn(10000, dtype=torch.float64)
    for name in ("fp32", "fp16", "bf16"):
        f = FORMATS[name]
        assert 0 < lab04_one_device.rounding_error(x, getattr(torch, f.dtype)) <= f.unit_roundoff
    assert lab04_one_device.rounding_error(torch.tensor([1.0, 0.5, 2.0]), torch.bfloat16) == 0


def test_bf16_matmul_error_near_prediction_and_far_above_fp32():
    errors = lab04_one_device.matmul_errors(n=128)
    assert errors["bf16_dtype"] == torch.bfloat16
    assert errors["fp32"] < 2**-20
    assert 2**-10 < errors["bf16"] < 2**-7
    assert errors["bf16"] == pytest.approx(errors["predicted_bf16"], rel=0.25)
    assert errors["predicted_bf16"] == math.sqrt(3) * errors["one_rounding"]


def test_matmul_seconds_times_fp32_against_bf16_autocast(monkeypatch):
    """The timing itself is side_by_side's (tests/test_measure.py); here, which functions
    are timed and what is made of the times."""
    outputs = {}

    def one_round(fns, rounds):
        outputs.update((name, fn()) for name, fn in fns.items())
        return {"fp32": 2.0, "bf16": 0.5, "ratio": {"fp32": 1.0, "bf16": 0.25}}

    monkeypatch.setattr(lab04_one_device, "side_by_side", one_round)
    t = lab04_one_device.matmul_seconds(n=64, rounds=3)
    assert t == {"fp32": 2.0, "bf16": 0.5, "speedup": 4.0, "flops": 2 * 64**3}
    assert outputs["fp32"].dtype == torch.float32 and outputs["fp32"].shape == (64, 64)
    assert outputs["bf16"].dtype == torch.bfloat16
    torch.testing.assert_close(outputs["bf16"].float(), outputs["fp32"], atol=0.5, rtol=0.05)


def test_spacing_is_the_ulp():
    assert lab04_one_device.spacing(1.0, torch.bfloat16) == 2**-7
    assert lab04_one_device.spacing(1.0, torch.float16) == 2**-10
    assert lab04_one_device.spacing(1.0, torch.float32) == 2**-23
    assert lab04_one_device.spacing(1024.0, torch.float16) == 1.0


def test_small_updates_vanish_in_bf16_but_not_in_fp32():
    assert (
        lab04_one_device.repeated_update(torch.bfloat16) == 1.0
    )  # 1e-3 < 2^-8, half the spacing at 1
    assert lab04_one_device.repeated_update(torch.float32) == pytest.approx(2.0, abs=1e-3)
    # fp16: 1 + 1e-3 rounds up to 1 + 2^-10 until w reaches 2 (1000 * 2^-10 = 0.977)
    assert lab04_one_device.repeated_update(torch.float16) == pytest.approx(1 + 1000 * 2**-10)
    assert lab04_one_device.repeated_update(torch.bfloat16, update=2**-6, steps=4) == 1 + 2**-4


def test_fp16_gradients_underflow_without_scaling_and_survive_with_it():
    model, x, y = lab04_one_device.make_amp_model()
    ref = lab04_one_device.amp_gradient(model, x, y)
    unscaled = lab04_one_device.amp_gradient(model, x, y, torch.float16)
    scaled = lab04_one_device.amp_gradient(model, x, y, torch.float16, loss_scale=2.0**16)
    assert (ref == 0).float().mean() == 0
    assert (unscaled == 0).float().mean() > 0.5
    assert ((scaled - ref).norm() / ref.norm()) < 1e-2
    assert (scaled == 0).float().mean() < 1e-3
    bf16 = lab04_one_device.amp_gradient(model, x, y, torch.bfloat16)
    assert ((bf16 - ref).norm() / ref.norm()) < 2e-2  # bf16 has fp32's range: no scaling


def test_static_scaler_equals_torch_gradscaler():
    model, x, y = lab04_one_device.make_amp_model()
    ours = lab04_one_device.amp_gradient(model, x, y, torch.float16, loss_scale=2.0**16)
    assert torch.equal(ours, lab04_one_device.gradscaler_gradient(model, x, y, 2.0**16))


def test_gradscaler_skips_step_and_halves_scale_on_overflow():
    result = lab04_one_device.gradscaler_overflow_step(2.0**40)
    assert result["skipped"] and result["scale_after"] == 2.0**39
    assert not lab04_one_device.gradscaler_overflow_step(2.0**10)[
        "skipped"
    ]  # a safe scale: a real step


def test_largest_safe_scale():
    assert lab04_one_device.largest_safe_scale(1.0) == 2.0**15  # 2^15 <= 65504 < 2^16
    assert lab04_one_device.largest_safe_scale(65504.0) == 1.0
    assert lab04_one_device.largest_safe_scale(2.0**-20) == 2.0**35


# --------------------------------------------------------------------------- checkpointing


@pytest.mark.parametrize("segment", [None, 1, 2, 3, 4])
def test_saved_bytes_match_formula(segment):
    stack, x = MLPStack(4, 16), torch.randn(8, 16)
    assert lab04_one_device.saved_bytes(stack, x, segment) == checkpoint_saved_bytes(
        4, 8, 16, segment
    )


def test_step_memory_near_chen_formula():
    layers, batch, d = 8, 64, 32
    stack, x = MLPStack(layers, d), torch.randn(batch, d)
    unit = batch * d * 4
    for segment in (None, 1, 2, 8):
        m = lab04_one_device.step_memory(stack, x, segment)
        assert m["after_forward"] == checkpoint_saved_bytes(layers, batch, d, segment)
        excess = (m["peak"] - checkpoint_peak_bytes(layers, batch, d, segment)) / unit
        assert 0 <= excess < 12, f"segment {segment}: peak exceeds the formula by {excess} units"


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

    monkeypatch.setattr(lab04_one_device, "side_by_side", one_round)
    assert lab04_one_device.recompute_ratio(stack, x, segment=2, rounds=3) == {
        "plain": 2.0, "checkpointed": 3.0, "ratio": 1.5,
    }  # fmt: skip
    assert seen["plain"][0] == 4 and seen["checkpointed"][0] == 8
    for plain, checkpointed in zip(seen["plain"][1], seen["checkpointed"][1], strict=True):
        torch.testing.assert_close(checkpointed, plain, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- fusion


def test_chain_variants_agree():
    x = torch.randn(100_003)
    want = lab04_one_device.elementwise_chain(x)
    assert torch.allclose(lab04_one_device.tiled_chain(x, block=1000), want)
    out = torch.empty_like(x)
    assert torch.allclose(lab04_one_device.unfused_into(x, out), want)
    assert torch.allclose(lab04_one_device.chain_in_place(x.clone()), want)
    # by hand: x = -1 -> -2 -> -1 -> 0 -> 0 -> -1 -> 1 -> 3 -> 5
    assert lab04_one_device.elementwise_chain(torch.tensor([-1.0])).item() == 5.0


def test_fused_chain_agrees_with_eager():
    fused, how = lab04_one_device.fused_chain()
    x = torch.randn(4096)
    assert torch.allclose(fused(x), lab04_one_device.elementwise_chain(x))
    assert how.startswith(("torch.compile", "tiled"))


def test_chain_bytes():
    assert lab04_one_device.chain_bytes(2**20) == 8 * 2 * 2**20 * 4
    assert lab04_one_device.chain_bytes(2**20, fused=True) == 2 * 2**20 * 4
    assert (
        lab04_one_device.chain_bytes(10, ops=3)
        / lab04_one_device.chain_bytes(10, ops=3, fused=True)
        == 3
    )


# --------------------------------------------------------------------------- exercises


def _accumulate_by_size(model, x, y, sizes):
    model.zero_grad()
    for xm, ym in zip(x.split(sizes), y.split(sizes), strict=True):
        (torch.nn.functional.mse_loss(model(xm), ym) * len(xm) / len(x)).backward()
    return lab04_one_device.flat_grad(model)


def _accumulate_by_count(model, x, y, sizes):  # the mistake: 1/k, not size/n
    model.zero_grad()
    for xm, ym in zip(x.split(sizes), y.split(sizes), strict=True):
        (torch.nn.functional.mse_loss(model(xm), ym) / len(sizes)).backward()
    return lab04_one_device.flat_grad(model)


def test_check_accumulation():
    lab04_one_device.check_accumulation(_accumulate_by_size)
    with pytest.raises(AssertionError, match="sizes="):
        lab04_one_device.check_accumulation(_accumulate_by_count)


def test_check_saved_bytes():
    lab04_one_device.check_saved_bytes(lambda L, b, d, s: math.ceil(L / s) * b * d * 4)
    with pytest.raises(AssertionError, match="saved"):
        lab04_one_device.check_saved_bytes(lambda L, b, d, s: L // s * b * d * 4)


def test_check_loss_scale():
    lab04_one_device.check_loss_scale(lab04_one_device.largest_safe_scale)
    with pytest.raises(AssertionError):
        lab04_one_device.check_loss_scale(lambda g: 2.0 ** math.ceil(math.log2(65504 / g)))

"""Lab 4's pieces: gradient accumulation (one process and several), mixed precision,
activation checkpointing and fusion, checked against PyTorch and against values worked
out by hand."""

from __future__ import annotations

import math

import matplotlib
import pytest
import torch

from labsupport import launch
from labsupport import single_device as sd

matplotlib.use("Agg")

# --------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("k", [1, 2, 4, 8, 64])
def test_accumulated_gradient_equals_big_batch(k):
    model = sd.make_mlp()
    x, y = sd.make_data(n=64)
    assert torch.allclose(sd.accumulated_gradient(model, x, y, k), sd.batch_gradient(model, x, y))


def test_accumulation_without_dividing_by_k_is_k_times_too_big():
    model = sd.make_mlp()
    x, y = sd.make_data(n=64)
    model.zero_grad()
    for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
        torch.nn.functional.mse_loss(model(xm), ym).backward()
    assert torch.allclose(sd.flat_grad(model), 4 * sd.batch_gradient(model, x, y), atol=1e-6)


def test_batchnorm_breaks_the_equivalence():
    model = sd.make_mlp(batchnorm=True)
    x, y = sd.make_data(n=64)
    big, accumulated = sd.batch_gradient(model, x, y), sd.accumulated_gradient(model, x, y, 4)
    assert not torch.allclose(big, accumulated, atol=1e-4)


def test_accumulation_rejects_unequal_chunks():
    with pytest.raises(ValueError, match="equal chunks"):
        sd.accumulated_gradient(sd.make_mlp(), *sd.make_data(n=10), 4)


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_gradient_equals_big_batch_on_every_rank(world_size):
    grads = launch(sd.data_parallel_gradient, world_size, timeout=120)
    want = sd.batch_gradient(sd.make_mlp(), *sd.make_data(n=64))
    for grad in grads:
        assert torch.allclose(grad, want, atol=1e-7)
    assert all(torch.equal(grads[0], g) for g in grads)


# --------------------------------------------------------------------------- mixed precision


def test_unit_roundoff_matches_finfo():
    for dtype, u in sd.UNIT_ROUNDOFF.items():
        assert u == torch.finfo(dtype).eps / 2


def test_rounding_error_is_at_most_unit_roundoff():
    x = torch.randn(10000, dtype=torch.float64)
    for dtype, u in sd.UNIT_ROUNDOFF.items():
        assert 0 < sd.rounding_error(x, dtype) <= u
    assert sd.rounding_error(torch.tensor([1.0, 0.5, 2.0]), torch.bfloat16) == 0


def test_bf16_matmul_error_near_prediction_and_far_above_fp32():
    errors = sd.matmul_errors(n=128)
    assert errors["bf16_dtype"] == torch.bfloat16
    assert errors["fp32"] < 2**-20
    assert 2**-10 < errors["bf16"] < 2**-7
    assert errors["bf16"] == pytest.approx(errors["predicted_bf16"], rel=0.25)


def test_matmul_seconds_are_positive():
    t = sd.matmul_seconds(n=64, repeats=3)
    assert t["fp32"] > 0 and t["bf16"] > 0 and t["flops"] == 2 * 64**3
    assert t["speedup"] == pytest.approx(t["fp32"] / t["bf16"])


def test_cpu_bf16_flags_are_known_names():
    assert set(sd.cpu_bf16_flags()) <= {"avx512_bf16", "amx_bf16", "avx_vnni_bf16"}


def test_spacing_is_the_ulp():
    assert sd.spacing(1.0, torch.bfloat16) == 2**-7
    assert sd.spacing(1.0, torch.float16) == 2**-10
    assert sd.spacing(1.0, torch.float32) == 2**-23
    assert sd.spacing(1024.0, torch.float16) == 1.0


def test_small_updates_vanish_in_bf16_but_not_in_fp32():
    assert sd.repeated_update(torch.bfloat16) == 1.0  # 1e-3 < 2^-8, half the spacing at 1
    assert sd.repeated_update(torch.float32) == pytest.approx(2.0, abs=1e-3)
    # fp16: 1 + 1e-3 rounds up to 1 + 2^-10 until w reaches 2 (1000 * 2^-10 = 0.977)
    assert sd.repeated_update(torch.float16) == pytest.approx(1 + 1000 * 2**-10)
    assert sd.repeated_update(torch.bfloat16, update=2**-6, steps=4) == 1 + 2**-4


def test_fp16_gradients_underflow_without_scaling_and_survive_with_it():
    model, x, y = sd.make_amp_model()
    ref = sd.amp_gradient(model, x, y)
    unscaled = sd.amp_gradient(model, x, y, torch.float16)
    scaled = sd.amp_gradient(model, x, y, torch.float16, loss_scale=2.0**16)
    assert (ref == 0).float().mean() == 0
    assert (unscaled == 0).float().mean() > 0.5
    assert ((scaled - ref).norm() / ref.norm()) < 1e-2
    assert (scaled == 0).float().mean() < 1e-3
    bf16 = sd.amp_gradient(model, x, y, torch.bfloat16)
    assert ((bf16 - ref).norm() / ref.norm()) < 2e-2  # bf16 has fp32's range: no scaling


def test_static_scaler_equals_torch_gradscaler():
    model, x, y = sd.make_amp_model()
    ours = sd.amp_gradient(model, x, y, torch.float16, loss_scale=2.0**16)
    assert torch.equal(ours, sd.gradscaler_gradient(model, x, y, 2.0**16))


def test_gradscaler_skips_step_and_halves_scale_on_overflow():
    result = sd.gradscaler_overflow_step(2.0**40)
    assert result["skipped"] and result["scale_after"] == 2.0**39


def test_largest_safe_scale():
    assert sd.largest_safe_scale(1.0) == 2.0**15  # 2^15 <= 65504 < 2^16
    assert sd.largest_safe_scale(65504.0) == 1.0
    assert sd.largest_safe_scale(2.0**-20) == 2.0**35


# --------------------------------------------------------------------------- checkpointing


@pytest.mark.parametrize("segment", [None, 1, 2, 3, 4])
def test_saved_bytes_match_formula(segment):
    blocks, x = sd.make_stack(4, 16), torch.randn(8, 16)
    assert sd.saved_bytes(blocks, x, segment) == sd.saved_bytes_formula(4, 8, 16, segment)


def test_saved_bytes_formula_known_values():
    # 9 units of b*d fp32 per block: 12 layers, b=2, d=8 -> 9*12*16*4 bytes
    assert sd.saved_bytes_formula(12, 2, 8) == 6912
    assert sd.saved_bytes_formula(12, 2, 8, segment=4) == 3 * 16 * 4
    assert sd.saved_bytes_formula(10, 1, 1, segment=3) == 4 * 4  # ceil(10/3) inputs


@pytest.mark.parametrize("segment", [None, 1, 4])
def test_checkpointing_gives_the_same_gradients(segment):
    blocks, x = sd.make_stack(8, 16), torch.randn(8, 16)
    blocks.zero_grad()
    sd.forward_stack(blocks, x).sum().backward()
    want = sd.flat_grad(blocks)
    blocks.zero_grad()
    sd.forward_stack(blocks, x, segment).sum().backward()
    assert torch.allclose(sd.flat_grad(blocks), want, atol=1e-6)


def test_live_memory_counts_new_tensors_and_frees_them():
    tracker = sd.LiveMemory()
    a = torch.ones(1000)
    with tracker:
        b = a * 2  # 4000 bytes
        c = b.view(10, 100)  # a view: nothing new
        b.add_(1)  # in place: nothing new
        d = torch.zeros(500)  # 2000 bytes
        del d
    assert tracker.peak == 6000
    assert tracker.live == 4000
    assert c.sum().item() == 3000


def test_step_memory_near_chen_formula():
    layers, batch, d = 8, 64, 32
    blocks, x = sd.make_stack(layers, d), torch.randn(batch, d)
    unit = batch * d * 4
    for segment in (None, 1, 2, 8):
        m = sd.step_memory(blocks, x, segment)
        assert m["after_forward"] == sd.saved_bytes_formula(layers, batch, d, segment)
        excess = (m["peak"] - sd.peak_formula(layers, batch, d, segment)) / unit
        assert 0 <= excess < 12, f"segment {segment}: peak exceeds the formula by {excess} units"


def test_recompute_ratio_is_positive():
    blocks, x = sd.make_stack(2, 16), torch.randn(8, 16)
    r = sd.recompute_ratio(blocks, x, 1, repeats=3)
    assert r["plain"] > 0 and r["checkpointed"] > 0 and r["ratio"] > 0


# --------------------------------------------------------------------------- fusion


def test_chain_variants_agree():
    x = torch.randn(100_003)
    want = sd.elementwise_chain(x)
    assert torch.allclose(sd.tiled_chain(x, block=1000), want)
    out = torch.empty_like(x)
    assert torch.allclose(sd.unfused_into(x, out), want)
    assert torch.allclose(sd.chain_in_place(x.clone()), want)
    # by hand: x = -1 -> -2 -> -1 -> 0 -> 0 -> -1 -> 1 -> 3 -> 5
    assert sd.elementwise_chain(torch.tensor([-1.0])).item() == 5.0


def test_fused_chain_agrees_with_eager():
    fused, how = sd.fused_chain()
    x = torch.randn(4096)
    assert torch.allclose(fused(x), sd.elementwise_chain(x))
    assert how.startswith(("torch.compile", "tiled"))


def test_chain_bytes():
    assert sd.chain_bytes(2**20) == 8 * 2 * 2**20 * 4
    assert sd.chain_bytes(2**20, fused=True) == 2 * 2**20 * 4
    assert sd.chain_bytes(10, ops=3) / sd.chain_bytes(10, ops=3, fused=True) == 3


# --------------------------------------------------------------------------- exercises


def _accumulate_by_size(model, x, y, sizes):
    model.zero_grad()
    for xm, ym in zip(x.split(sizes), y.split(sizes), strict=True):
        (torch.nn.functional.mse_loss(model(xm), ym) * len(xm) / len(x)).backward()
    return sd.flat_grad(model)


def _accumulate_by_count(model, x, y, sizes):  # the mistake: 1/k, not size/n
    model.zero_grad()
    for xm, ym in zip(x.split(sizes), y.split(sizes), strict=True):
        (torch.nn.functional.mse_loss(model(xm), ym) / len(sizes)).backward()
    return sd.flat_grad(model)


def test_check_accumulation():
    sd.check_accumulation(_accumulate_by_size)
    with pytest.raises(AssertionError, match="sizes="):
        sd.check_accumulation(_accumulate_by_count)


def test_check_saved_bytes():
    sd.check_saved_bytes(lambda L, b, d, s: math.ceil(L / s) * b * d * 4)
    with pytest.raises(AssertionError, match="saved"):
        sd.check_saved_bytes(lambda L, b, d, s: L // s * b * d * 4)


def test_check_loss_scale():
    sd.check_loss_scale(sd.largest_safe_scale)
    with pytest.raises(AssertionError):
        sd.check_loss_scale(lambda g: 2.0 ** math.ceil(math.log2(65504 / g)))


# --------------------------------------------------------------------------- figures


def test_figures_draw():
    import matplotlib.pyplot as plt

    for make in (sd.mixed_precision_loop_figure, lambda: sd.checkpoint_memory_figure(8, 32, 16)):
        fig = make()
        assert fig.axes
        plt.close(fig)

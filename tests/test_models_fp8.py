"""The FP8 quantizer and scaled matmul of labsupport.models.fp8, against float64 arithmetic on
the dequantized values; per-tensor against block scaling; delayed scaling."""

from __future__ import annotations

import pytest
import torch

from labsupport.models import fp8

E4M3, E5M2 = fp8.FORMATS["e4m3"], fp8.FORMATS["e5m2"]
#: Unit roundoff: a rounding to the format changes a normal value by at most this share.
UNIT = {E4M3: 2.0**-4, E5M2: 2.0**-3}


def operands(m=64, k=384, n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)  # channels of many sizes
    return a, torch.randn(k, n, generator=g) * 0.02


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("block", [None, fp8.ACTIVATION_TILE, fp8.WEIGHT_BLOCK])
def test_quantize_puts_each_amax_on_the_format_s_largest_and_rounds_within_u(dtype, block):
    a, _ = operands(m=128, k=256)
    q, scale = fp8.quantize(a, dtype, block)
    assert q.dtype == dtype
    top = fp8.amax(q.float(), block)
    assert torch.equal(top, torch.full_like(top, fp8.fp8_max(dtype)))  # every block's max
    back = fp8.dequantize(q, scale, block)
    normal = (a.abs() / fp8.expand(scale, block)) >= torch.finfo(dtype).smallest_normal
    relative = ((back - a).abs() / a.abs())[normal]
    assert relative.max() <= UNIT[dtype] * (1 + 1e-6)
    if block is None:
        assert scale.dim() == 0 and scale == a.abs().max() / fp8.fp8_max(dtype)
    else:
        assert scale.shape == (a.shape[0] // block[0], a.shape[1] // block[1])


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("blocks", [False, True])
def test_scaled_mm_is_the_product_of_the_dequantized_operands(dtype, blocks):
    a, b = operands()
    tiles = (fp8.ACTIVATION_TILE, fp8.WEIGHT_BLOCK) if blocks else (None, None)
    a_q, a_s = fp8.quantize(a, dtype, tiles[0])
    b_q, b_s = fp8.quantize(b, dtype, tiles[1])
    exact = (
        fp8.dequantize(a_q, a_s, tiles[0]).double() @ fp8.dequantize(b_q, b_s, tiles[1]).double()
    )
    got = fp8.scaled_mm(a_q, a_s, b_q, b_s)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    # FP8 products are exact in fp32; only the fp32 sums of K = 384 terms round
    bound = 384 * 2.0**-24 * (a.abs().amax(1, keepdim=True) @ b.abs().amax(0, keepdim=True)) * 384
    assert ((got.double() - exact).abs() <= bound.double()).all()


def test_block_scaling_is_not_per_tensor_scaling():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 256, generator=g), torch.randn(256, 128, generator=g)
    a[0, 0] = 1e6  # one outlier: a per-tensor scale flushes every other row to zero
    per_tensor = fp8.scaled_mm(*fp8.quantize(a), *fp8.quantize(b))
    blocks = fp8.scaled_mm(
        *fp8.quantize(a, block=fp8.ACTIVATION_TILE), *fp8.quantize(b, block=fp8.WEIGHT_BLOCK)
    )
    exact = a.double() @ b.double()
    rest = slice(1, None)  # the rows without the outlier
    error = {k: (v[rest].double() - exact[rest]).norm() / exact[rest].norm()
             for k, v in (("tensor", per_tensor), ("blocks", blocks))}  # fmt: skip
    assert error["blocks"] < 0.05 < 0.5 < error["tensor"]


def test_bad_shapes_and_formats_get_clear_errors():
    a, b = operands(k=200)
    with pytest.raises(ValueError, match="does not split into blocks of 1 x 128"):
        fp8.quantize(a, block=fp8.ACTIVATION_TILE)
    with pytest.raises(ValueError, match="not an FP8 format"):
        fp8.quantize(a, torch.bfloat16)
    a, b = operands()
    with pytest.raises(ValueError, match="both operands' block scales"):
        fp8.scaled_mm(*fp8.quantize(a, block=fp8.ACTIVATION_TILE), *fp8.quantize(b))
    with pytest.raises(ValueError, match="cannot be multiplied"):
        fp8.scaled_mm(*fp8.quantize(a), *fp8.quantize(a))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_values_beyond_a_delayed_amax_are_clipped_not_infinite(dtype):
    x = torch.tensor([-10.0, -1.0, 0.5, 1.0, 10.0])
    q, scale = fp8.quantize(x, dtype, amax_value=1.0)
    back = fp8.dequantize(q, scale)
    assert torch.isfinite(back).all()
    assert back[0] == -1.0 and back[-1] == 1.0  # clipped to the amax it was scaled for


def test_delayed_scaling_uses_the_history_and_counts_what_it_clips():
    scaler = fp8.DelayedScaling(history=2)
    x = torch.linspace(-1, 1, 101)
    assert scaler.quantize(x)[2] == 0  # the first step scales by its own amax
    big = x * 4
    _, scale, clipped = scaler.quantize(big)
    assert scale == 1.0 / fp8.fp8_max(E4M3)  # the history's amax, 1, not this tensor's 4
    assert clipped == int((big.abs() > 1).sum()) > 70
    scaler.quantize(x)  # scaled by 4, the largest of the last two amaxes (1 and 4)
    _, scale, _ = scaler.quantize(x)  # the history holds 4 and 1: still 4
    assert scale == 4.0 / fp8.fp8_max(E4M3)
    assert scaler.history == [1.0, 1.0]  # the 4 has left it


def test_zero_tensors_get_scale_one():
    q, scale = fp8.quantize(torch.zeros(4, 128), block=fp8.ACTIVATION_TILE)
    assert torch.equal(scale, torch.ones(4, 1)) and not q.float().any()

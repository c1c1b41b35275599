"""FP8 matrix multiplication with scaling factors, as FP8 training computes a linear layer.

FP8 has two formats (Micikevicius et al. 2022, "FP8 Formats for Deep Learning",
arXiv:2209.05433): **E4M3** (``torch.float8_e4m3fn``: 3 significand bits, largest 448,
smallest normal 2⁻⁶, subnormals down to 2⁻⁹) and **E5M2** (``torch.float8_e5m2``: 2 bits,
57,344, 2⁻¹⁴ and 2⁻¹⁶). Their range is too narrow for a tensor as it comes, so each tensor
is divided by a *scale* ``s = amax / fp8_max`` before the cast, and the matmul multiplies
the scales back into its result (dequantization):

* :func:`quantize`: one scale per tensor (``block=None``), or one per block: DeepSeek-V3's
  ``(1, 128)`` tiles for activations (a token's 128 channels) and ``(128, 128)`` blocks for
  weights (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv:2412.19437, §3.3.2);
* :func:`scaled_mm`: ``a @ b`` from quantized operands with ``torch._scaled_mm``, one call
  for per-tensor scales; for blocks, one call per 128 columns of ``a`` (rows of ``b``) with
  row-wise scales, and the partial products added in fp32, as DeepSeek-V3 promotes its
  partial sums to fp32 every 128 elements of the inner dimension (its ``N_C = 128``);
* :class:`DelayedScaling`: the scale from the largest amax of the last steps (Transformer
  Engine's ``DelayedScaling`` recipe, ``amax_compute_algo="max"``), values beyond it clipped.

``torch._scaled_mm`` runs on CPUs with tensor-wise and row-wise scales (torch 2.13); it
asks for ``a`` row-major and ``b`` column-major, and :func:`scaled_mm` lays them out so.
"""

from __future__ import annotations

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
#: DeepSeek-V3's block sizes: 1 x 128 tiles of activations, 128 x 128 blocks of weights.
ACTIVATION_TILE, WEIGHT_BLOCK = (1, 128), (128, 128)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 format: 448 (E4M3), 57,344 (E5M2)."""
    return torch.finfo(dtype).max


def _blocked(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x`` (rows, cols) as (rows/bh, bh, cols/bw, bw): one entry of dims 0 and 2 a block."""
    (rows, cols), (bh, bw) = x.shape, block
    if x.dim() != 2 or rows % bh or cols % bw:
        raise ValueError(
            f"a tensor of shape {tuple(x.shape)} does not split into blocks of {bh} x {bw}: "
            "pad it to a multiple of the block, or choose a block that divides it"
        )
    return x.reshape(rows // bh, bh, cols // bw, bw)


def amax(x: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """The largest ``|x|``: of the whole tensor (a scalar), or of each block
    (shape ``(rows/bh, cols/bw)``)."""
    if block is None:
        return x.abs().amax().float()
    return _blocked(x, block).abs().amax(dim=(1, 3)).float()


def expand(scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """A per-block ``scale`` repeated over its blocks' elements (a scalar as it is)."""
    if block is None:
        return scale
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)


def quantize(x, dtype=torch.float8_e4m3fn, block=None, amax_value=None):
    """``(q, scale)``: ``x / scale`` cast to FP8 ``dtype``, with ``scale = amax / fp8_max``
    so that the largest value lands on the format's largest (an amax of 0 gets scale 1).

    ``block``: ``None`` for one scale, or ``(bh, bw)`` for one per block. ``amax_value``:
    the amax to scale by (a delayed scale), this tensor's own (a current scale) if ``None``;
    values beyond it are clipped to ``± fp8_max``, as Transformer Engine clips them."""
    if dtype not in FORMATS.values():
        raise ValueError(f"{dtype} is not an FP8 format: use one of {list(FORMATS.values())}")
    top = amax(x, block) if amax_value is None else torch.as_tensor(amax_value).float()
    scale = torch.where(top > 0, top / fp8_max(dtype), torch.ones_like(top))
    limit = fp8_max(dtype)
    q = (x.float() / expand(scale, block).to(x.device)).clamp(-limit, limit).to(dtype)
    return q, scale.to(x.device)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block=None) -> torch.Tensor:
    """What ``q`` stands for, in fp32: ``q * scale`` (per block, if ``block``)."""
    return q.float() * expand(scale, block)


def _column_major(b: torch.Tensor) -> torch.Tensor:
    return b.t().contiguous().t()


def scaled_mm(a_q, a_scale, b_q, b_scale, k_block: int = 128) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b)`` in fp32, from FP8 operands and their scales.

    Per-tensor scales (two scalars): one ``torch._scaled_mm``. Block scales, ``a_scale``
    of shape ``(M, K/k_block)`` (1 x k_block tiles) and ``b_scale`` of shape
    ``(K/k_block, N/bn)`` (k_block x bn blocks): for each ``k_block`` slice of the inner
    dimension, a ``_scaled_mm`` with row-wise scales (a row's tile scale for ``a``, a
    column's block scale for ``b``), and the slices' products summed in fp32."""
    (m, k), n = a_q.shape, b_q.shape[1]
    if b_q.shape[0] != k:
        raise ValueError(f"shapes {tuple(a_q.shape)} and {tuple(b_q.shape)} cannot be multiplied")
    if a_scale.dim() == 0 and b_scale.dim() == 0:
        return torch._scaled_mm(
            a_q.contiguous(), _column_major(b_q), a_scale, b_scale, out_dtype=torch.float32
        )
    if a_scale.dim() == 0 or b_scale.dim() == 0 or k % k_block:
        raise ValueError(
            "block scaling needs both operands' block scales (quantize a with block (1, "
            f"{k_block}) and b with ({k_block}, bn)) and K = {k} a multiple of {k_block}"
        )
    bn = n // b_scale.shape[1]
    out = torch.zeros(m, n, dtype=torch.float32, device=a_q.device)
    for j in range(k // k_block):
        cols = slice(j * k_block, (j + 1) * k_block)
        out += torch._scaled_mm(
            a_q[:, cols].contiguous(),
            _column_major(b_q[cols]),
            a_scale[:, j : j + 1].contiguous(),
            b_scale[j].repeat_interleave(bn).reshape(1, n).contiguous(),
            out_dtype=torch.float32,
        )
    return out


class DelayedScaling:
    """A per-tensor scale from history: the largest amax of the last ``history`` steps
    (Transformer Engine's default recipe keeps 1,024). The scale is known before the
    tensor is read, so quantizing reads it once; a tensor whose amax grew beyond the
    history's is clipped. Call :meth:`quantize` once per step on the step's tensor."""

    def __init__(self, dtype=torch.float8_e4m3fn, history: int = 1024):
        self.dtype, self.length, self.history = dtype, history, []

    def quantize(self, x: torch.Tensor):
        """``(q, scale, clipped)``: ``x`` quantized with the history's scale (its own on the
        first step), and how many of its values were clipped; then its amax joins the
        history."""
        current = amax(x).item()
        top = max(self.history, default=current)
        q, scale = quantize(x, self.dtype, amax_value=top)
        clipped = int((x.abs() > top).sum())
        self.history = (self.history + [current])[-self.length :]
        return q, scale, clipped

"""Lab 4, FP8: the error of a linear layer's matmul in FP8 with one scale per tensor and with
DeepSeek-V3's block scales, on activations with outliers, against bf16; and delayed scaling
clipping a tensor that grew. The quantizer and the scaled matmul are
:mod:`labsupport.models.fp8`.

Outliers: a few tokens carry a few channels far larger than the rest, as the "massive
activations" of LLMs do (Sun et al. 2024, "Massive Activations in Large Language Models",
arXiv:2402.17762). The error is measured on the other tokens' outputs, which a per-tensor
scale sized for the outliers pushes out of FP8's range.
"""

from __future__ import annotations

import torch

from labsupport.models import fp8

#: Tokens, channels in and out of the lab's linear layer, and the tokens with outliers.
TOKENS, D_IN, D_OUT, OUTLIER_TOKENS, OUTLIER_CHANNELS = 256, 1024, 256, (0, 100), (7, 300)
RECIPES = ("bf16", "E4M3 per tensor", "E5M2 per tensor", "E4M3 blocks")
#: Outlier sizes of the figure: 1 (none) to 10^6, half a decade apart.
SWEEP = tuple(10 ** (k / 2) for k in range(13))


def layer_inputs(magnitude: float, seed: int = 0):
    """``(x, w)``: activations (``TOKENS`` x ``D_IN``, standard normal, with ``magnitude``
    in ``OUTLIER_CHANNELS`` of ``OUTLIER_TOKENS``) and a weight (``D_IN`` x ``D_OUT``,
    standard deviation 0.02, as GPT-2 initializes them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, D_IN, generator=g)
    w = torch.randn(D_IN, D_OUT, generator=g) * 0.02
    rows, cols = torch.tensor(OUTLIER_TOKENS), torch.tensor(OUTLIER_CHANNELS)
    if magnitude:
        x[rows[:, None], cols] = magnitude
    return x, w


def recipe_output(x: torch.Tensor, w: torch.Tensor, recipe: str) -> torch.Tensor:
    """``x @ w`` as ``recipe`` computes it, in fp32: bf16 inputs (rounded, then multiplied
    with fp32 sums), or FP8 inputs scaled per tensor or per block through ``_scaled_mm``."""
    if recipe == "bf16":
        return x.bfloat16().float() @ w.bfloat16().float()
    dtype = fp8.FORMATS["e5m2" if recipe.startswith("E5M2") else "e4m3"]
    blocks = recipe.endswith("blocks")
    x_q, x_scale = fp8.quantize(x, dtype, fp8.ACTIVATION_TILE if blocks else None)
    w_q, w_scale = fp8.quantize(w, dtype, fp8.WEIGHT_BLOCK if blocks else None)
    return fp8.scaled_mm(x_q, x_scale, w_q, w_scale)


def ordinary_token_error(x: torch.Tensor, w: torch.Tensor, recipe: str) -> float:
    """The median, over the tokens without outliers, of the relative error of a token's
    output row, against float64."""
    exact = x.double() @ w.double()
    keep = torch.ones(len(x), dtype=torch.bool)
    keep[list(OUTLIER_TOKENS)] = False
    error = (recipe_output(x, w, recipe).double() - exact)[keep].norm(dim=1)
    return (error / exact[keep].norm(dim=1)).median().item()


def error_table(magnitudes=(0, 1e3, 1e4, 1e5, 1e6)) -> dict:
    """``{magnitude: {recipe: error}}`` for each outlier magnitude (0: none)."""
    table = {}
    for magnitude in magnitudes:
        x, w = layer_inputs(magnitude)
        table[magnitude] = {r: ordinary_token_error(x, w, r) for r in RECIPES}
    return table


def delayed_scaling_run(amaxes=(1, 1, 1, 4, 4, 1), history: int = 2, n: int = 4096) -> list:
    """Per-tensor delayed scaling over a run of tensors, ``n`` normal values each, whose
    spread is ``amaxes[step]``: per step the scale used and how many values it clipped."""
    scaler, rows = fp8.DelayedScaling(history=history), []
    for step, spread in enumerate(amaxes):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(n, generator=g) * spread
        _, scale, clipped = scaler.quantize(x)
        rows.append({"step": step, "spread": spread, "scale": scale.item(), "clipped": clipped})
    return rows

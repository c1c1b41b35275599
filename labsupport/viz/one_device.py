"""Chapter 4, drawn: checkpointing's memory against its formulas, the loop of
mixed-precision training, and FP8's error with per-tensor and block scales."""

from __future__ import annotations

from matplotlib.patches import FancyBboxPatch

from labsupport.estimate.memory import checkpoint_peak_bytes, checkpoint_saved_bytes
from labsupport.viz.style import figure, rank_color


def draw_checkpoint_memory(measured: dict, layers: int, batch: int, d: int):
    """Chapter 4: activation memory of an :class:`~labsupport.models.MLPStack` without and
    with checkpointing, measured next to the formulas, for several segment lengths.

    ``measured`` maps a segment length (``None``: no checkpointing) to what
    :func:`labsupport.labs.lab04_checkpointing.step_memory` returns: ``after_forward`` and
    ``peak`` bytes.
    """
    unit = batch * d * 4
    cases = list(measured)
    fig, ax = figure(7.5, 3.4)
    labels = ["none" if c is None else str(c) for c in cases]
    pos = range(len(cases))
    ax.bar(
        [p - 0.2 for p in pos],
        [measured[c]["after_forward"] / unit for c in cases],
        0.4,
        color=rank_color(0),
        label="kept after forward (measured)",
    )
    ax.bar(
        [p + 0.2 for p in pos],
        [measured[c]["peak"] / unit for c in cases],
        0.4,
        color=rank_color(1),
        label="peak in forward + backward (measured)",
    )
    kept = [checkpoint_saved_bytes(layers, batch, d, c) / unit for c in cases]
    peak = [checkpoint_peak_bytes(layers, batch, d, c) / unit for c in cases]
    ax.plot([p - 0.2 for p in pos], kept, "k_", ms=22, mew=2, label="formula: kept (L/c)")
    ax.plot([p + 0.2 for p in pos], peak, "k.", ms=9, label="formula: peak (L/c + 9c)")
    ax.set_xticks(list(pos), labels)
    ax.set_xlabel("checkpointed segment length c (blocks); 'none' = no checkpointing")
    ax.set_ylabel("memory (units of b·d·4 bytes)")
    ax.set_title(f"Activation memory of {layers} MLP blocks (b={batch}, d={d})")
    ax.legend(fontsize=8, frameon=False, loc="upper center")
    return fig


def mixed_precision_loop_figure():
    """Chapter 4: one step of mixed-precision training (Micikevicius et al. 2018, fig. 1)."""
    fig, ax = figure(10.0, 3.4)
    low, high = "#cfe3f3", "#f6dfb5"  # 16-bit, 32-bit

    def box(x, y, text, color, w, h=0.8):
        ax.add_patch(
            FancyBboxPatch(
                (x, y), w, h, boxstyle="round,pad=0.04", facecolor=color, edgecolor="#555555"
            )
        )
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8.5)
        return x, y, w, h

    def arrow(a, b, text=None, dx=0.0, dy=0.0):
        ax.annotate("", xy=b, xytext=a, arrowprops={"arrowstyle": "->", "lw": 1.3})
        if text:
            mx, my = (a[0] + b[0]) / 2 + dx, (a[1] + b[1]) / 2 + dy
            ax.text(mx, my, text, fontsize=8, ha="center", color="#333333")

    w, gap = 2.6, 0.9
    xs = [i * (w + gap) for i in range(4)]
    top, bottom = 2.6, 0.4
    box(xs[0], top, "master weights\nfp32", high, w)
    box(xs[1], top, "weights\nbf16 / fp16", low, w)
    box(xs[2], top, "forward: matmuls\nin bf16 / fp16", low, w)
    box(xs[3], top, "loss in fp32,\ntimes scale S", high, w)
    box(xs[3], bottom, "backward: activation\ngradients in 16 bits", low, w)
    box(xs[2], bottom, "weight gradients\nto fp32, divided by S", high, w)
    box(xs[1], bottom, "inf or NaN found?\nskip step, halve S", "#eeeeee", w)
    box(xs[0], bottom, "optimizer update\nin fp32: w -= lr·g", high, w)
    for i in range(3):
        arrow((xs[i] + w, top + 0.4), (xs[i + 1], top + 0.4), "cast" if i == 0 else None, dy=0.1)
        arrow(
            (xs[i + 1], bottom + 0.4),
            (xs[i] + w, bottom + 0.4),
            "finite" if i == 0 else None,
            dy=0.1,
        )
    arrow((xs[3] + w / 2, top), (xs[3] + w / 2, bottom + 0.8))
    arrow((xs[0] + w / 2, bottom + 0.8), (xs[0] + w / 2, top))
    legend_x = xs[3] + w + 0.5
    ax.text(
        legend_x,
        2.9,
        "16-bit",
        fontsize=8,
        va="center",
        bbox={"facecolor": low, "edgecolor": "#555555"},
    )
    ax.text(
        legend_x,
        2.3,
        "32-bit",
        fontsize=8,
        va="center",
        bbox={"facecolor": high, "edgecolor": "#555555"},
    )
    ax.text(
        legend_x,
        1.1,
        "S: loss scale\n(fp16; bf16 has\nfp32's range and\nneeds none)",
        fontsize=8,
        va="center",
    )
    ax.set_xlim(-0.2, legend_x + 1.9)
    ax.set_ylim(0.2, 3.6)
    ax.axis("off")
    ax.set_title("One step of mixed-precision training")
    return fig


def draw_fp8_errors(table: dict, normal_range: float | None = 448 / 2**-6):
    """Chapter 4 and lab 4: the relative error of a linear layer's output for ordinary
    tokens against the size of a few tokens' outliers, per recipe.

    ``table`` maps an outlier magnitude (taken as 1 where it is 0: no outliers) to
    ``{recipe: error}`` (:func:`labsupport.labs.lab04_fp8.error_table`); ``normal_range``
    marks E4M3's largest over its smallest normal value, beyond which a per-tensor scale
    pushes ordinary values below the normal range."""
    fig, ax = figure(6.8, 3.4)
    magnitudes = [max(m, 1) for m in table]
    recipes = list(next(iter(table.values())))
    for i, recipe in enumerate(recipes):
        errors = [100 * table[m][recipe] for m in table]
        ax.loglog(magnitudes, errors, "o-", ms=3.5, color=rank_color(i), label=recipe)
    if normal_range:
        ax.axvline(normal_range, color="#999999", ls=":", lw=1)
        ax.text(normal_range * 0.85, 20, "E4M3: 448 / 2⁻⁶", fontsize=8, color="#666666", ha="right")
    ax.set_xlabel("size of the outliers in a few tokens (the other values: about 1)")
    ax.set_ylabel("error of ordinary tokens' outputs (%)")
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    fig.tight_layout()
    return fig

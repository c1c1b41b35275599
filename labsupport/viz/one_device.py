"""Chapter 4, drawn: checkpointing's memory against its formulas, the loop of
mixed-precision training, and FP8's error with per-tensor and block scales."""

from __future__ import annotations

from matplotlib.patches import FancyBboxPatch

from labsupport.estimate.memory import checkpoint_peak_bytes, checkpoint_saved_bytes
from labsupport.viz.style import PAGE_WIDTH, SMALL, figure, rank_color


def draw_checkpoint_memory(measured: dict, layers: int, batch: int, d: int):
    """Chapter 4: activation memory of an :class:`~labsupport.models.MLPStack` without and
    with checkpointing, measured next to the formulas, for several segment lengths.

    ``measured`` maps a segment length (``None``: no checkpointing) to what
    :func:`labsupport.labs.lab04_checkpointing.step_memory` returns: ``after_forward`` and
    ``peak`` bytes.
    """
    unit = batch * d * 4
    cases = list(measured)
    fig, ax = figure(0.9 * PAGE_WIDTH, 3.6)
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
    ax.set_xlabel("checkpointed segment length c (blocks);\n'none' = no checkpointing")
    ax.set_ylabel("memory (units of b·d·4 bytes)")
    ax.set_title(f"Activation memory of {layers} MLP blocks (b={batch}, d={d})")
    ax.legend(fontsize=SMALL, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=1)
    return fig


def mixed_precision_loop_figure():
    """Chapter 4: one step of mixed-precision training (Micikevicius et al. 2018, fig. 1)."""
    fig, ax = figure(0.8 * PAGE_WIDTH, 5.4)
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.94)
    low, high = "#cfe3f3", "#f6dfb5"  # 16-bit, 32-bit
    w, h = 3.4, 0.9

    def box(x, y, text, color):
        ax.add_patch(
            FancyBboxPatch(
                (x, y), w, h, boxstyle="round,pad=0.04", facecolor=color, edgecolor="#555555"
            )
        )
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=SMALL)

    def arrow(a, b, text=None):
        ax.annotate("", xy=b, xytext=a, arrowprops={"arrowstyle": "->", "lw": 1.3})
        if text:
            mx, my = (a[0] + b[0]) / 2, (a[1] + b[1]) / 2
            ax.text(mx + 0.12, my, text, fontsize=SMALL, va="center", color="#333333")

    # the step as a loop: down the left column (forward), up the right one (backward)
    left, right, rows = 0.0, w + 1.2, [4.2, 2.9, 1.6, 0.3]
    box(left, rows[0], "master weights\nfp32", high)
    box(left, rows[1], "weights\nbf16 / fp16", low)
    box(left, rows[2], "forward: matmuls\nin bf16 / fp16", low)
    box(left, rows[3], "loss in fp32,\ntimes scale S", high)
    box(right, rows[3], "backward: activation\ngradients in 16 bits", low)
    box(right, rows[2], "weight gradients\nto fp32, divided by S", high)
    box(right, rows[1], "inf or NaN found?\nskip step, halve S", "#eeeeee")
    box(right, rows[0], "optimizer update\nin fp32: w -= lr·g", high)
    for i in range(3):
        arrow((left + w / 2, rows[i]), (left + w / 2, rows[i + 1] + h), "cast" if i == 0 else None)
        arrow(
            (right + w / 2, rows[i + 1] + h),
            (right + w / 2, rows[i]),
            "finite" if i == 0 else None,
        )
    arrow((left + w, rows[3] + h / 2), (right, rows[3] + h / 2))
    arrow((right, rows[0] + h / 2), (left + w, rows[0] + h / 2))
    for x, text, color in ((left, "16-bit", low), (left + 1.4, "32-bit", high)):
        ax.text(
            x,
            -0.35,
            text,
            fontsize=SMALL,
            va="center",
            bbox={"facecolor": color, "edgecolor": "#555555"},
        )
    ax.text(
        right,
        -0.35,
        "S: loss scale\n(fp16; bf16 has\nfp32's range and\nneeds none)",
        fontsize=SMALL,
        va="top",
    )
    ax.set_xlim(-0.1, right + w + 0.1)
    ax.set_ylim(-1.6, rows[0] + h + 0.1)
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
    fig, ax = figure(PAGE_WIDTH, 3.8)
    magnitudes = [max(m, 1) for m in table]
    recipes = list(next(iter(table.values())))
    for i, recipe in enumerate(recipes):
        errors = [100 * table[m][recipe] for m in table]
        ax.loglog(magnitudes, errors, "o-", ms=3.5, color=rank_color(i), label=recipe)
    if normal_range:
        ax.axvline(normal_range, color="#999999", ls=":", lw=1)
        ax.text(normal_range * 0.85, 20, "E4M3: 448 / 2⁻⁶", fontsize=SMALL, color="#666666",
                ha="right")  # fmt: skip
    ax.set_xlabel("size of a few tokens' outliers (other values: about 1)")
    ax.set_ylabel("error, ordinary tokens (%)")
    ax.legend(fontsize=SMALL, frameon=False, loc="upper left")
    fig.tight_layout()
    return fig

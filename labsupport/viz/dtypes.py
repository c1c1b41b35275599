"""Floating-point formats, drawn: their bit fields, their ranges, and loss scaling."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt

from labsupport.estimate.dtypes import FORMATS
from labsupport.viz.style import PAGE_WIDTH, SMALL, figure, rank_color, subplots

FIELD_COLORS = {"sign": "#D55E00", "exponent": "#0072B2", "mantissa": "#E69F00"}


def dtype_layouts(names=("fp32", "tf32", "bf16", "fp16", "fp8 e5m2", "fp8 e4m3")):
    """Chapter 2: the sign, exponent and mantissa fields of each format, one bit per box."""
    fig, ax = figure(PAGE_WIDTH, 0.55 * len(names) + 0.6)
    fig.subplots_adjust(left=0.4, right=0.99, bottom=0.02, top=0.86)
    for row, name in enumerate(names):
        f = FORMATS[name]
        y = len(names) - 1 - row
        fields = [("sign", 1), ("exponent", f.exponent), ("mantissa", f.mantissa)]
        x = 0
        for field, width in fields:
            for _ in range(width):
                ax.add_patch(
                    plt.Rectangle(
                        (x, y),
                        0.92,
                        0.7,
                        facecolor=FIELD_COLORS[field],
                        edgecolor="black",
                        linewidth=0.4,
                    )
                )
                x += 1
            if field != "sign":
                ax.text(
                    x - width / 2 - 0.04,
                    y + 0.35,
                    str(width),
                    ha="center",
                    va="center",
                    fontsize=SMALL,
                    color="white" if field == "exponent" else "black",
                )
        label = f"{name}  ({f.bits} bits)" if name != "tf32" else "tf32  (19 bits, in 32)"
        ax.text(-0.8, y + 0.55, label, ha="right", va="center", fontsize=SMALL)
        note = f"max {f.max:.6g}, eps 2^-{f.mantissa}"
        ax.text(-0.8, y + 0.1, note, ha="right", va="center", fontsize=SMALL, color="#444444")
    handles = [
        plt.Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="black") for c in FIELD_COLORS.values()
    ]
    ax.legend(
        handles,
        list(FIELD_COLORS),
        ncol=3,
        loc="lower center",
        frameon=False,
        bbox_to_anchor=(0.5, 1.0),
        fontsize=SMALL,
    )
    ax.set_xlim(-0.2, 32.2)
    ax.set_ylim(-0.2, len(names))
    ax.axis("off")
    return fig


def range_and_precision(names=("fp32", "bf16", "fp16", "fp8 e5m2", "fp8 e4m3")):
    """Chapter 2: the magnitudes each format holds (log2 scale), subnormals lighter, with
    a gradient of 1e-8 and a value of 70,000 marked."""
    fig, ax = figure(0.85 * PAGE_WIDTH, 0.55 * len(names) + 1.4)
    for row, name in enumerate(names):
        f = FORMATS[name]
        y = len(names) - 1 - row
        lo, mid, hi = (math.log2(v) for v in (f.smallest_subnormal, f.smallest_normal, f.max))
        color = rank_color(row)
        ax.barh(y, mid - lo, left=lo, height=0.5, color=color, alpha=0.35)
        ax.barh(y, hi - mid, left=mid, height=0.5, color=color)
        ax.text(
            min(hi, 150) + 2,
            y,
            f"{f.smallest_subnormal:.1e} … {f.max:.3g}",
            va="center",
            fontsize=SMALL,
        )
    for value, label, side in ((1e-8, "gradient 1e-8 ", "right"), (7e4, " 70,000", "left")):
        ax.axvline(math.log2(value), color="black", lw=1, ls="--")
        ax.text(math.log2(value), -0.75, label, ha=side, fontsize=SMALL)
    ax.set_ylim(-0.9, len(names) - 0.5)
    ax.set_yticks(range(len(names)), list(reversed(names)))
    ax.set_xlim(-155, 185)
    ax.set_xticks(range(-150, 151, 50), [f"$2^{{{k}}}$" for k in range(-150, 151, 50)])
    ax.set_xlabel("magnitude (log scale); light: subnormal numbers,\nfewer significant bits")
    ax.set_title("Range of each format: fp16 loses both marked values,\nbf16 keeps them")
    return fig


def plot_loss_scaling(rows: list[dict], title: str = "fp16, gradients scaled by 2^k"):
    """Lab 2: what a cast to fp16 does to gradients, against the loss scale ``2^k``.

    Left: median relative error after the round trip (scale, cast, cast back, unscale).
    Right: the share of values that became subnormal, zero, or infinite.
    """
    fig, (left, right) = subplots(1, 2, 10, 3.3)
    k = [r["log2 scale"] for r in rows]
    left.plot(k, [r["median rel. error"] for r in rows], "o-", color=rank_color(0))
    left.axhline(2.0**-11, color="#999999", ls=":", lw=1)
    left.text(
        k[-1], 2.0**-11 * 1.3, "2^-11: fp16's largest rounding error", ha="right", fontsize=SMALL
    )
    left.set_yscale("log")
    left.set_xlabel("log2 of the loss scale")
    left.set_ylabel("median relative error")
    series = [("subnormal", "s--", 2), ("zero", "o-", 0), ("inf", "^-", 5)]
    for key, style, color in series:
        right.plot(k, [100 * r[key] for r in rows], style, color=rank_color(color), label=key)
    right.set_yscale("symlog", linthresh=0.01)
    right.set_xlabel("log2 of the loss scale")
    right.set_ylabel("% of nonzero gradients")
    right.legend(frameon=False, fontsize=SMALL)
    fig.suptitle(title)
    return fig

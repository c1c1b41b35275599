"""Rooflines and the memory hierarchy, drawn (chapter 1 and lab 1)."""

from __future__ import annotations

import numpy as np

from labsupport.estimate.datasheets import DEVICES, HIERARCHY
from labsupport.estimate.roofline import arithmetic_intensity, ridge_point, roofline
from labsupport.viz.style import PAGE_WIDTH, SMALL, figure, rank_color, subplots


def draw_roofline(
    ceilings: list[dict], kernels: list[dict] = (), ax=None, title=None, intensities=(1 / 64, 4096)
):
    """Rooflines on log-log axes, with measured kernels placed under them.

    ``ceilings``: dicts with ``label``, ``peak_flops`` and ``bandwidth`` (and optionally
    ``color``, ``ls``); each is drawn as the slanted memory roof meeting the flat compute
    roof at its ridge point (a dot). ``kernels``: dicts with ``label``, ``intensity`` and
    ``flop_per_s``, as :func:`labsupport.measure.probe.measure_kernel` returns them;
    kernels with 0 FLOPs (a copy) have no place on a log axis and are skipped.
    """
    if ax is None:
        _, ax = figure(7.0, 4.2)
    x = np.geomspace(*intensities, 400)
    for i, c in enumerate(ceilings):
        color = c.get("color", rank_color(i))
        ax.plot(
            x,
            roofline(c["peak_flops"], c["bandwidth"], x) / 1e9,
            color=color,
            ls=c.get("ls", "-"),
            lw=1.8,
            label=c["label"],
        )
        ridge = ridge_point(c["peak_flops"], c["bandwidth"])
        if intensities[0] <= ridge <= intensities[1]:
            ax.plot(ridge, c["peak_flops"] / 1e9, "o", color=color, ms=5)
    markers = "sD^v<>p*"
    for j, k in enumerate(kn for kn in kernels if kn["flop_per_s"] > 0):
        ax.plot(
            k["intensity"],
            k["flop_per_s"] / 1e9,
            markers[j % len(markers)],
            color="black",
            mfc="white",
            ms=7,
            mew=1.4,
            label=k["label"],
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = [2.0**e for e in range(-8, 16, 2) if intensities[0] <= 2.0**e <= intensities[1]]
    ax.set_xticks(ticks, [f"{t:g}" if t >= 1 else f"1/{1 / t:g}" for t in ticks])
    ax.set_xlabel("arithmetic intensity (FLOP per byte of memory traffic)")
    ax.set_ylabel("attainable GFLOP/s")
    ax.legend(fontsize=SMALL, loc="lower right", frameon=False)
    if title:
        ax.set_title(title)
    return ax


def datasheet_rooflines():
    """Chapter 1: rooflines of :data:`~labsupport.estimate.datasheets.DEVICES`, FP32 (left)
    and 16-bit tensor (right).

    Vertical lines mark the computed intensities of an elementwise add and of a square
    matmul of side 1024, for 4-byte (left) and 2-byte (right) elements.
    """
    fig, (left, right) = subplots(2, 1, PAGE_WIDTH, 8.6, sharex=True)
    panels = (
        (left, "fp32", 4, "FP32 (CUDA cores; CPU vector units)"),
        (right, "tensor", 2, "16-bit tensor cores, dense\n(BF16; V100: FP16)"),
    )
    for ax, key, itemsize, title in panels:
        ceilings = [
            {
                "label": e["name"],
                "peak_flops": e[key],
                "bandwidth": e["bandwidth"],
                "color": rank_color(i),
                "ls": "--" if e["kind"] == "CPU" else "-",
            }
            for i, e in enumerate(DEVICES.values())
            if e[key] is not None
        ]
        draw_roofline(ceilings, ax=ax, title=title, intensities=(1 / 32, 8192))
        marks = [
            ("add", arithmetic_intensity("add", numel=1, itemsize=itemsize)),
            (
                "matmul 1024³",
                arithmetic_intensity("matmul", m=1024, k=1024, n=1024, itemsize=itemsize),
            ),
        ]
        for name, intensity in marks:
            ax.axvline(intensity, color="#999999", lw=1, ls=":")
            ax.text(
                intensity * 1.12,
                3,
                f"{name}\n{intensity:.3g} FLOP/B",
                fontsize=SMALL,
                color="#555555",
            )
        ax.set_ylim(1, 3e6)
        ax.legend(fontsize=SMALL, loc="upper left", frameon=False)
    left.set_xlabel("")
    fig.suptitle(
        "Rooflines from datasheets: min(peak FLOP/s, bandwidth × intensity);\n"
        "dots are ridge points",
        fontsize=11,
    )
    fig.tight_layout()
    return fig


def memory_hierarchy():
    """Chapter 1: capacity of each memory level of an H100 and of a laptop CPU (log scale)."""
    fig, axes = subplots(2, 1, PAGE_WIDTH - 0.8, 6.4, sharex=True)  # the notes run past
    for ax, (device, levels) in zip(axes, HIERARCHY.items(), strict=True):
        names = [name for name, _, _ in levels]
        sizes = [size for _, size, _ in levels]
        y = np.arange(len(levels))[::-1]
        ax.barh(y, sizes, color=rank_color(0), alpha=0.85, height=0.6)
        for yi, size, (_, _, note) in zip(y, sizes, levels, strict=True):
            ax.text(size * 1.3, yi, note, va="center", fontsize=SMALL)
        ax.set_yticks(y, names)
        ax.set_xscale("log")
        ax.set_xlim(1e5, 1e16)
        ax.set_xticks([1e6, 1e9, 1e12], ["1 MB", "1 GB", "1 TB"])
        ax.set_title(device)
        ax.set_xlabel("capacity (bytes, log scale)")
    fig.suptitle(
        "The memory hierarchy: each level down is larger and slower\n(fastest at the top)",
        fontsize=11,
    )
    fig.tight_layout()
    return fig

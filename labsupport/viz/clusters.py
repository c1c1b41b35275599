"""Chapter 5 and lab 5, drawn: the alpha-beta model against measurements, its two
regimes on datasheet links, and a rail-optimized cluster."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.patches import FancyBboxPatch

from labsupport.comm.cost import half_bandwidth_size, p2p_time
from labsupport.estimate import datasheets
from labsupport.estimate.units import format_bytes
from labsupport.viz.style import PAGE_WIDTH, SMALL, figure, rank_color


def plot_fit(results: list[dict], alpha: float, beta: float, ax=None, title: str | None = None):
    """Measured one-way times against ``alpha + beta * n`` on log-log axes.

    Marks the two asymptotes (``alpha`` alone, ``beta * n`` alone) and where they cross,
    at :func:`half_bandwidth_size`.
    """
    if ax is None:
        _, ax = figure(7.0, 3.6)
    sizes = np.array([r["bytes"] for r in results], dtype=float)
    times = np.array([r["seconds"] for r in results])
    grid = np.geomspace(sizes.min(), sizes.max(), 200)
    ax.plot(
        grid,
        p2p_time(grid, alpha, beta) * 1e6,
        color="black",
        lw=1.5,
        label=f"model: α + βn  (α = {alpha * 1e6:.1f} µs, 1/β = {1 / beta / 1e9:.2f} GB/s)",
    )
    ax.plot(
        grid,
        np.full_like(grid, alpha * 1e6),
        color="#777777",
        ls=":",
        lw=1,
        label="α alone (latency)",
    )
    ax.plot(grid, beta * grid * 1e6, color="#777777", ls="--", lw=1, label="βn alone (bandwidth)")
    ax.plot(
        sizes,
        times * 1e6,
        "o",
        color=rank_color(0),
        ms=6,
        label="measured, rank 0 ↔ rank 1",
    )
    n_half = half_bandwidth_size(alpha, beta)
    if sizes.min() < n_half < sizes.max():
        ax.axvline(n_half, color="#bbbbbb", lw=1)
        ax.annotate(
            f"n½ = α/β ≈ {n_half / 1024:.0f} KiB",
            (n_half, alpha * 1e6 * 0.55),
            xytext=(6, 0),
            textcoords="offset points",
            fontsize=SMALL,
            color="#555555",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = [s for s in sizes if math.log2(s) % 4 == 0]
    ax.set_xticks(ticks, [format_bytes(s, "auto") for s in ticks])
    ax.set_ylim(
        alpha * 1e6 * 0.3, max(times.max(), float(p2p_time(sizes.max(), alpha, beta))) * 3e6
    )
    ax.set_xlabel("message size n")
    ax.set_ylabel("one-way time (µs)")
    ax.legend(fontsize=SMALL, loc="upper left", frameon=False)
    ax.set_title(title or "Ping-pong: measured against the α-β model")
    return ax


def alpha_beta_regimes():
    """Chapter 5: t = alpha + beta*n and the effective bandwidth, for two datasheet links.

    beta comes from the datasheets (labsupport.estimate.datasheets); alpha is the
    course's assumed 5 microseconds (ASSUMED_ALPHA), the same for both links.
    """
    alpha = datasheets.ASSUMED_ALPHA
    links = [
        ("InfiniBand NDR: 400 Gb/s = 50 GB/s", datasheets.beta("InfiniBand NDR"), "black", "-"),
        ("NVLink 4: 450 GB/s each way", datasheets.beta("NVLink 4 (H100)"), "#777777", "--"),
    ]
    n = np.geomspace(1, 1e11, 400)
    fig, left = figure(PAGE_WIDTH, 7.4)
    grid = fig.add_gridspec(2, 1, hspace=0.35)
    left.set_subplotspec(grid[0])
    right = fig.add_subplot(grid[1])
    for label, link_beta, color, style in links:
        t = alpha + link_beta * n
        half = half_bandwidth_size(alpha, link_beta)
        left.plot(n, t, color=color, ls=style, lw=1.6, label=label)
        left.plot(half, 2 * alpha, "o", color=color, ms=5)
        right.plot(n, n / t / 1e9, color=color, ls=style, lw=1.6, label=label)
        right.plot(half, 0.5 / link_beta / 1e9, "o", color=color, ms=5)
        size = f"{half / 1e6:g} MB" if half >= 1e6 else f"{half / 1e3:g} kB"
        right.annotate(
            f"n½ = {size}",
            (half, 0.5 / link_beta / 1e9),
            xytext=(8, -4),
            textcoords="offset points",
            fontsize=SMALL,
            color=color,
        )
    beta_ndr = links[0][1]
    half_ndr = half_bandwidth_size(alpha, beta_ndr)
    left.axvspan(1, half_ndr, color="#f0f0f0", zorder=0)
    left.text(30, 2e-4, "latency-bound\nt ≈ α", fontsize=SMALL, color="#555555")
    left.text(1.2e8, 1.5e-5, "bandwidth-bound\nt ≈ βn", fontsize=SMALL, color="#555555")
    left.axhline(alpha, color="#bbbbbb", lw=0.8, ls=":")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_ylim(1e-6, 10)
    left.set_xlabel("message size n (bytes)")
    left.set_ylabel("time t = α + βn (s)")
    left.set_title("Time per message (α = 5 µs assumed)")
    left.legend(fontsize=SMALL, loc="upper left", frameon=False)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_ylim(1e-5, 2000)
    right.set_xlabel("message size n (bytes)")
    right.set_ylabel("n / t (GB/s)")
    right.set_title("Effective bandwidth: half the peak at n½ = α/β")
    for ax in (left, right):
        ticks = [1, 1e3, 1e6, 1e9, 1e11]
        ax.set_xticks(ticks, ["1 B", "1 kB", "1 MB", "1 GB", "100 GB"])
    return fig


def rail_topology():
    """Chapter 5: four nodes of four GPUs on a rail-optimized two-level fat tree."""
    nodes, gpus, spines = 4, 4, 2
    fig, ax = figure(0.94 * PAGE_WIDTH, 3.3)
    ax.set_position((0, 0, 1, 0.9))
    node_w, gap = 1.42, 0.12  # about an inch to a unit
    slot = (node_w - 0.16) / gpus
    total = nodes * node_w + (nodes - 1) * gap

    def box(x, y, w, h, face, text=None, weight=None):
        ax.add_patch(
            FancyBboxPatch(
                (x, y), w, h, boxstyle="round,pad=0.02", facecolor=face, edgecolor="#555555"
            )
        )
        if text:
            ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", weight=weight)

    gpu_top = {}
    for j in range(nodes):
        x0 = j * (node_w + gap)
        box(x0, 0, node_w, 1.1, "#f4f4f4")
        ax.text(x0 + node_w / 2, 0.08, f"node {j}", ha="center", va="bottom", weight="bold")
        box(x0 + 0.08, 0.36, node_w - 0.16, 0.24, "#dddddd", text="NVSwitch")
        for k in range(gpus):
            x = x0 + 0.08 + k * slot + 0.025
            box(x, 0.72, slot - 0.05, 0.28, "white", text=str(k))
            ax.plot([x + slot / 2 - 0.025] * 2, [0.6, 0.72], color="#999999", lw=1)
            gpu_top[j, k] = (x + slot / 2 - 0.025, 1.0)
    leaf_y, leaf_w, leaf_h = 1.75, 1.32, 0.28
    leaf_x = [total * (k + 0.5) / gpus - leaf_w / 2 for k in range(gpus)]
    spine_y, spine_w = 2.75, 1.32
    spine_x = [total * (s + 0.5) / spines - spine_w / 2 for s in range(spines)]
    for (_node, k), (x, y) in gpu_top.items():
        rail0 = k == 0
        ax.plot(
            [x, leaf_x[k] + leaf_w / 2],
            [y, leaf_y],
            color="black" if rail0 else "#b0b0b0",
            lw=1.8 if rail0 else 0.9,
            zorder=0.5 if rail0 else 0.4,
        )
    for k in range(gpus):
        for s in range(spines):
            ax.plot(
                [leaf_x[k] + leaf_w / 2, spine_x[s] + spine_w / 2],
                [leaf_y + leaf_h, spine_y],
                color="#777777",
                lw=1,
                zorder=0.3,
            )
        box(leaf_x[k], leaf_y, leaf_w, leaf_h, "#e8e8e8", text=f"leaf switch, rail {k}")
    for s in range(spines):
        box(spine_x[s], spine_y, spine_w, leaf_h, "#d0d0d0", text=f"spine switch {s}")
    ax.set_xlim(-0.04, total + 0.04)
    ax.set_ylim(-0.04, spine_y + leaf_h + 0.04)
    ax.axis("off")
    ax.set_title(
        "Rail-optimized fat tree: GPU k of every node on leaf k,\n"
        "so rail 0 (black) is one switch hop between nodes"
    )
    return fig

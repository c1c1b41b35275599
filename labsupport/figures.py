"""The chapters' figures, drawn from code: ``python -m labsupport.figures chapters/figures``.

Each function returns a matplotlib figure; :func:`main` saves them all as PNG with no
timestamp in the file, so that regenerating a figure changes nothing unless its code
did (a test checks that the committed files match).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib.pyplot as plt

from labsupport import estimate, plotting, probe, single_device, units
from labsupport.launching import global_rank


def ranks_on_two_nodes():
    """Chapter 6: 2 nodes x 4 GPUs; global rank = node_rank x 4 + local_rank."""
    infos = [
        {"rank": global_rank(node, local, 4), "local_rank": local, "node_rank": node}
        for node in range(2)
        for local in range(4)
    ]
    ax = plotting.draw_ranks(infos, title="world_size = 8: two nodes, four processes each")
    return ax.figure


# --------------------------------------------------------------------------- chapter 5


def alpha_beta_regimes():
    """Chapter 5: t = alpha + beta*n and the effective bandwidth, for two datasheet links.

    beta comes from the datasheets (labsupport.hardware); alpha is the course's assumed
    5 microseconds (labsupport.clusters.ASSUMED_ALPHA), the same for both links.
    """
    import numpy as np

    from labsupport import clusters, hardware

    alpha = clusters.ASSUMED_ALPHA
    links = [
        ("InfiniBand NDR: 400 Gb/s = 50 GB/s", hardware.beta("InfiniBand NDR"), "black", "-"),
        ("NVLink 4: 450 GB/s each way", hardware.beta("NVLink 4 (H100)"), "#777777", "--"),
    ]
    n = np.geomspace(1, 1e11, 400)
    fig, left = plotting.figure(9.5, 3.6)
    grid = fig.add_gridspec(1, 2, wspace=0.3)
    left.set_subplotspec(grid[0])
    right = fig.add_subplot(grid[1])
    for label, beta, color, style in links:
        t = alpha + beta * n
        half = clusters.half_bandwidth_size(alpha, beta)
        left.plot(n, t, color=color, ls=style, lw=1.6, label=label)
        left.plot(half, 2 * alpha, "o", color=color, ms=5)
        right.plot(n, n / t / 1e9, color=color, ls=style, lw=1.6, label=label)
        right.plot(half, 0.5 / beta / 1e9, "o", color=color, ms=5)
        size = f"{half / 1e6:g} MB" if half >= 1e6 else f"{half / 1e3:g} kB"
        right.annotate(
            f"n½ = {size}", (half, 0.5 / beta / 1e9),
            xytext=(8, -4), textcoords="offset points", fontsize=8, color=color,
        )  # fmt: skip
    beta_ndr = links[0][1]
    half_ndr = clusters.half_bandwidth_size(alpha, beta_ndr)
    left.axvspan(1, half_ndr, color="#f0f0f0", zorder=0)
    left.text(30, 2e-4, "latency-bound\nt ≈ α", fontsize=9, color="#555555")
    left.text(1.2e8, 1.5e-5, "bandwidth-bound\nt ≈ βn", fontsize=9, color="#555555")
    left.axhline(alpha, color="#bbbbbb", lw=0.8, ls=":")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_ylim(1e-6, 10)
    left.set_xlabel("message size n (bytes)")
    left.set_ylabel("time t = α + βn (s)")
    left.set_title("Time per message (α = 5 µs assumed)")
    left.legend(fontsize=8, loc="upper left", frameon=False)
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
    from matplotlib.patches import FancyBboxPatch

    nodes, gpus, spines = 4, 4, 2
    fig, ax = plotting.figure(9.0, 4.2)
    node_w, gap, gpu_w = 4.4, 0.5, 0.8
    total = nodes * node_w + (nodes - 1) * gap

    def box(x, y, w, h, face, edge="#555555", text=None, size=8, weight=None):
        ax.add_patch(
            FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.03", facecolor=face, edgecolor=edge)
        )
        if text:
            ax.text(
                x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight
            )

    gpu_top = {}
    for j in range(nodes):
        x0 = j * (node_w + gap)
        box(x0, 0, node_w, 1.9, "#f4f4f4")
        ax.text(x0 + node_w / 2, 0.12, f"node {j}", ha="center", fontsize=9, weight="bold")
        box(x0 + 0.25, 0.42, node_w - 0.5, 0.35, "#dddddd", text="NVSwitch (NVLink)", size=7)
        for k in range(gpus):
            x = x0 + 0.25 + k * (node_w - 0.5) / gpus + 0.07
            box(x, 1.0, gpu_w, 0.6, "white", text=f"GPU\n{k}", size=7)
            ax.plot([x + gpu_w / 2] * 2, [0.77, 1.0], color="#999999", lw=1)
            gpu_top[j, k] = (x + gpu_w / 2, 1.6)
    leaf_y, leaf_w = 3.3, 2.6
    leaf_x = [total * (k + 0.5) / gpus - leaf_w / 2 for k in range(gpus)]
    spine_y, spine_w = 5.1, 3.0
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
                [leaf_y + 0.5, spine_y],
                color="#777777",
                lw=1,
                zorder=0.3,
            )
        box(leaf_x[k], leaf_y, leaf_w, 0.5, "#e8e8e8", text=f"leaf switch, rail {k}")
    for s in range(spines):
        box(spine_x[s], spine_y, spine_w, 0.5, "#d0d0d0", text=f"spine switch {s}")
    ax.text(
        total + 0.3,
        leaf_y + 0.25,
        "leaf: one per rail\n(GPU k of every node)",
        fontsize=8,
        va="center",
        color="#555555",
    )
    ax.text(
        total + 0.3,
        spine_y + 0.25,
        "spine: joins the rails",
        fontsize=8,
        va="center",
        color="#555555",
    )
    ax.text(
        total + 0.3,
        1.0,
        "inside a node:\nNVLink through\nNVSwitch",
        fontsize=8,
        va="center",
        color="#555555",
    )
    ax.set_xlim(-0.2, total + 3.2)
    ax.set_ylim(-0.1, spine_y + 0.7)
    ax.axis("off")
    ax.set_title("Rail-optimized fat tree: rail 0 in black, one switch hop between nodes")
    return fig


# --------------------------------------------------------------------------- chapters 7, 8


def collectives_before_after():
    """Chapter 7: the eight primitives on 4 ranks, run for real by labsupport.collectives
    (and checked against torch.distributed) through labsupport.launch."""
    from labsupport import primitives
    from labsupport.launcher import launch

    plt.rcParams.update(plotting.STYLE)
    fig, axes = plt.subplots(4, 2, figsize=(15, 11))
    for ax, name in zip(axes.T.flat, primitives.PRIMITIVES, strict=True):
        results = launch(primitives.run_primitive, 4, args=(name,), timeout=120)
        primitives.agreement(results, name)
        plotting.draw_collective(results, name, ax=ax, width=8)
    return fig


def ring_all_reduce_steps():
    """Chapter 8: the ring all-reduce on 4 ranks, from the schedule the code runs."""
    return plotting.draw_ring_allreduce(4)


FIGURES = {
    "06-ranks.png": ranks_on_two_nodes,
    "05-alpha-beta.png": alpha_beta_regimes,
    "05-rails.png": rail_topology,
    "07-collectives.png": collectives_before_after,
    "08-ring.png": ring_all_reduce_steps,
    "03-memory.png": estimate.memory_breakdown_figure,
    "03-time-to-train.png": estimate.time_to_train_figure,
    "02-dtypes.png": units.dtype_layouts,
    "02-range.png": units.range_and_precision,
    "04-mixed-precision.png": single_device.mixed_precision_loop_figure,
    "04-checkpointing.png": single_device.checkpoint_memory_figure,
    "01-roofline.png": probe.datasheet_rooflines,
    "01-hierarchy.png": probe.memory_hierarchy,
}


def save(fig, path: Path) -> None:
    fig.savefig(path, metadata={"Software": None}, bbox_inches="tight")
    plt.close(fig)


def main(outdir: str) -> None:
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    for name, make in FIGURES.items():
        save(make(), out / name)
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "chapters/figures")

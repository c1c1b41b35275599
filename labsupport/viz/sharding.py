"""Part V, sharding and 3D, drawn: the groups of a process-group mesh on its nodes, the
model states per GPU under each ZeRO stage, and where a planned step's time goes."""

from __future__ import annotations

import numpy as np
from matplotlib.patches import FancyBboxPatch

from labsupport.estimate.memory import training_memory
from labsupport.estimate.published import PUBLISHED, as_published
from labsupport.estimate.units import GB
from labsupport.parallel.parallel_state import Mesh
from labsupport.viz.style import PAGE_WIDTH, SMALL, rank_color, subplots
from labsupport.viz.walls import PART_COLORS

AXIS_NAMES = {"tp": "tensor-parallel", "dp": "data-parallel", "pp": "pipeline-parallel"}


def draw_mesh(mesh: Mesh, gpus_per_node: int, axes=None, title: str | None = None, label=""):
    """One panel per axis (TP, DP, PP), one above the other: the ranks on their nodes (a
    row per node), each rank coloured by the group it belongs to along that axis, so that
    a group is the ranks of one colour."""
    nodes = mesh.world_size // gpus_per_node
    if axes is None:
        fig, axes = subplots(
            3, 1, PAGE_WIDTH * min(1.0, gpus_per_node / 8), 3 * (0.5 * nodes + 0.6)
        )
    for ax, axis in zip(np.atleast_1d(axes), ("tp", "dp", "pp"), strict=True):
        groups = mesh.groups(axis)
        for rank in range(mesh.world_size):
            node, slot = divmod(rank, gpus_per_node)
            which = next(i for i, g in enumerate(groups) if rank in g)
            ax.add_patch(
                FancyBboxPatch(
                    (slot + 0.08, -node + 0.08),
                    0.84,
                    0.84,
                    boxstyle="round,pad=0.02",
                    facecolor=rank_color(which),
                    edgecolor="black",
                    linewidth=0.6,
                )
            )
            ax.text(slot + 0.5, -node + 0.5, str(rank), ha="center", va="center", fontsize=SMALL)
        for node in range(nodes):
            ax.add_patch(
                FancyBboxPatch(
                    (0, -node),
                    gpus_per_node,
                    1,
                    boxstyle="round,pad=0.04",
                    fill=False,
                    edgecolor="#777777",
                    linestyle="--",
                    linewidth=0.8,
                )
            )
        ax.set_xlim(-0.3, gpus_per_node + 0.3)
        ax.set_ylim(-nodes + 0.7, 1.3)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(
            f"{label}{AXIS_NAMES[axis]}: {len(groups)} groups of {mesh.size(axis)}",
            fontsize=SMALL,
            loc="left",
        )
    if title:
        np.atleast_1d(axes)[0].figure.suptitle(title, fontsize=SMALL)
    return axes


def mesh_orders_figure(dp=2, tp=2, pp=4, gpus_per_node=8, orders=None):
    """Chapter 13: Megatron's example mesh (16 GPUs, TP 2, PP 4) on two nodes, numbered
    in two conventions, one row each."""
    orders = orders or {"Megatron-LM's default": "tp-dp-pp", "Llama 3's": "tp-pp-dp"}
    nodes = dp * tp * pp // gpus_per_node
    fig, axes = subplots(3, len(orders), PAGE_WIDTH, 3 * (0.45 * nodes + 0.75))
    for column, (name, order) in zip(np.atleast_2d(axes).T, orders.items(), strict=True):
        draw_mesh(Mesh(dp, tp, pp, order), gpus_per_node, axes=column, label=f"{order},\n")
        column[0].text(-0.3, 2.6, f"{name} order", fontsize=SMALL, weight="bold")
    fig.tight_layout()
    return fig


def zero_memory_figure(num_params=7.5e9, dp=64, gpu_bytes=80 * GB):
    """Chapter 14: model states per GPU for stages 0 to 3 (the ZeRO paper's figure 1:
    7.5 B parameters, 64 GPUs), part by part."""
    fig, ax = subplots(1, 1, 0.75 * PAGE_WIDTH, 3.4)
    for stage in range(4):
        bottom = 0.0
        for part, nbytes in training_memory(num_params, "mixed", stage, dp).items():
            ax.bar(
                stage,
                nbytes / GB,
                bottom=bottom,
                width=0.6,
                color=PART_COLORS[part],
                edgecolor="black",
                linewidth=0.5,
                label=part if stage == 0 else None,
            )
            bottom += nbytes / GB
        ax.text(stage, bottom, f"{bottom:.1f} GB", ha="center", va="bottom", fontsize=SMALL)
    ax.axhline(gpu_bytes / GB, color="black", ls="--", lw=1)
    ax.text(
        2.4,
        gpu_bytes / GB,
        f"one GPU: {gpu_bytes / GB:.0f} GB",
        va="bottom",
        ha="center",
        fontsize=SMALL,
    )
    ax.set_xticks(
        range(4),
        ["no ZeRO\n(DDP)", "stage 1\noptimizer", "stage 2\n+ gradients", "stage 3\n+ parameters"],
    )
    for i, label in enumerate(ax.get_xticklabels()):  # alternate heights: room for each
        label.set_y(-0.16 * (i % 2))
    ax.set_ylabel("GB per GPU")
    ax.set_title(f"{num_params / 1e9:g} B parameters,\nmixed-precision Adam, {dp} GPUs")
    ax.legend(
        fontsize=SMALL, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.42), ncol=2
    )
    return fig


def zero_measured_figure(rows: list[dict]):
    """Lab 14: bytes each rank holds, measured (left bar) and formula (right bar), per
    stage and number of ranks; rows from :func:`labsupport.labs.lab14_zero.memory_rows`."""
    parts = (
        ("parameters", "formula p", "weights"),
        ("gradients", "formula g", "gradients"),
        ("optimizer", "formula o", "momentum"),
    )
    fig, ax = subplots(1, 1, 8.0, 3.4)
    labels = []
    for i, row in enumerate(rows):
        for offset, which in ((-0.2, 0), (0.2, 1)):
            bottom = 0
            for part in parts:
                value = row[part[which]] / 1e3
                ax.bar(
                    i + offset,
                    value,
                    bottom=bottom,
                    width=0.36,
                    color=PART_COLORS[part[2]],
                    edgecolor="black",
                    linewidth=0.5,
                    hatch="//" if which else None,
                    label=(part[0] if which == 0 else None) if i == 0 else None,
                )
                bottom += value
        labels.append(f"{row['ranks']} rank{'s' if row['ranks'] > 1 else ''}\nstage {row['stage']}")
    ax.set_xticks(range(len(rows)), labels, fontsize=SMALL)
    ax.set_ylabel("kB per rank")
    ax.set_title("Bytes each rank holds: measured (plain) and formula (hatched)")
    ax.legend(fontsize=SMALL, frameon=False, ncol=3)
    fig.tight_layout()
    return fig


STEP_PARTS = {
    "compute": rank_color(0),
    "tensor": rank_color(1),
    "context": rank_color(4),
    "expert": rank_color(5),
    "pipeline": rank_color(2),
    "bubble": rank_color(7),
    "data": rank_color(3),
}


def step_breakdown_figure(results: dict):
    """Chapter 13: where a planned step's time goes, one bar per run: ``results`` maps a
    label to :func:`labsupport.estimate.planner.evaluate`'s result."""
    fig, ax = subplots(1, 1, 0.95 * PAGE_WIDTH, 0.5 * len(results) + 1.6)
    for i, r in enumerate(results.values()):
        left = 0.0
        for part, color in STEP_PARTS.items():
            share = r["parts"][part] / r["step_s"]
            ax.barh(
                i,
                share,
                left=left,
                color=color,
                edgecolor="black",
                linewidth=0.5,
                label=part if i == 0 else None,
            )
            left += share
        ax.text(1.01, i, f"{r['step_s']:.1f} s", va="center", fontsize=SMALL)
    ax.set_yticks(range(len(results)), list(results), fontsize=SMALL)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.12)
    ax.set_xlabel("share of the predicted step time")
    ax.legend(fontsize=SMALL, frameon=False, ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    return fig


def published_breakdown_figure():
    """Chapter 13: :func:`step_breakdown_figure` for the published runs of
    :mod:`labsupport.estimate.published`, as published."""
    results = {}
    for entry in PUBLISHED:
        dp, tp, cp, pp, ep = entry["layout"].axes
        mesh = (
            f"{dp} x {tp} x {pp}"
            + (f", CP {cp}" if cp > 1 else "")
            + (f", EP {ep}" if ep > 1 else "")
        )
        results[f"{entry['name']}\n{mesh}"] = as_published(entry)
    return step_breakdown_figure(results)

"""Ranks on nodes, drawn: which process has which global rank, local rank and node rank."""

from __future__ import annotations

from matplotlib.patches import FancyBboxPatch

from labsupport.viz.style import PAGE_WIDTH, SMALL, figure, rank_color


def draw_ranks(infos: list[dict], ax=None, title: str | None = None):
    """Draw nodes as boxes holding one box per process, labelled with its ranks.

    ``infos`` are dicts with ``rank``, ``local_rank`` and ``node_rank`` (what
    :func:`labsupport.labs.lab06_launching.world_info` returns on each rank).
    """
    nodes = sorted({i["node_rank"] for i in infos})
    per_node = max(i["local_rank"] for i in infos) + 1
    if ax is None:
        # 8 ranks on 2 nodes are shown at 90 % of the page
        fig, ax = figure(min(0.9 * PAGE_WIDTH, 0.75 * per_node * len(nodes)), 2.0)
        fig.subplots_adjust(left=0.01, right=0.99, bottom=0.02, top=0.85)
    gap, box = 0.25, 1.2
    for n, node in enumerate(nodes):
        x0 = n * (per_node * box + gap)
        ax.add_patch(
            FancyBboxPatch(
                (x0, 0),
                per_node * box - 0.1,
                1.9,
                boxstyle="round,pad=0.05",
                facecolor="#f4f4f4",
                edgecolor="#555555",
            )
        )
        ax.text(x0 + (per_node * box - 0.1) / 2, 1.7, f"node {node}", ha="center", weight="bold")
    for info in infos:
        x = nodes.index(info["node_rank"]) * (per_node * box + gap) + info["local_rank"] * box
        color = rank_color(info["rank"])
        ax.add_patch(
            FancyBboxPatch(
                (x + 0.05, 0.15),
                box - 0.2,
                1.25,
                boxstyle="round,pad=0.02",
                facecolor=color,
                edgecolor="black",
                alpha=0.9,
            )
        )
        label = f"rank {info['rank']}\nlocal {info['local_rank']}\nnode {info['node_rank']}"
        ax.text(x + box / 2 - 0.1, 0.77, label, ha="center", va="center", fontsize=SMALL)
    ax.set_xlim(-0.2, len(nodes) * (per_node * box + gap) - gap + 0.1)
    ax.set_ylim(-0.1, 2.05)
    ax.axis("off")
    if title:
        ax.set_title(title)
    return ax

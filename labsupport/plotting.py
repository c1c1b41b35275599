"""One figure style for the whole course, and one colour per rank.

Every figure in the book and the labs is drawn here with matplotlib, so rank 2 is the
same green in the chapter on collectives as in the chapter on ZeRO. The palette is
Okabe and Ito's, chosen to stay distinguishable for colour-blind readers
(https://jfly.uni-koeln.de/color/).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

RANK_COLORS = (
    "#0072B2",  # blue
    "#E69F00",  # orange
    "#009E73",  # green
    "#CC79A7",  # purple
    "#56B4E9",  # sky blue
    "#D55E00",  # vermilion
    "#F0E442",  # yellow
    "#999999",  # grey
)

STYLE = {
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "svg.hashsalt": "labsupport",
}


def rank_color(rank: int) -> str:
    """The colour of ``rank`` in every figure of the course."""
    return RANK_COLORS[rank % len(RANK_COLORS)]


def figure(width: float = 7.0, height: float = 3.0):
    """A new figure and axes in the course style.

    The style is set in ``rcParams`` for the session rather than inside
    ``plt.rc_context``: leaving that context also resets the backend Jupyter chose,
    and the inline backend then stops showing figures.
    """
    plt.rcParams.update(STYLE)
    return plt.subplots(figsize=(width, height))


def draw_ranks(infos: list[dict], ax=None, title: str | None = None):
    """Draw nodes as boxes holding one box per process, labelled with its ranks.

    ``infos`` are dicts with ``rank``, ``local_rank`` and ``node_rank`` (what
    :func:`labsupport.launching.world_info` returns on each rank).
    """
    nodes = sorted({i["node_rank"] for i in infos})
    per_node = max(i["local_rank"] for i in infos) + 1
    if ax is None:
        _, ax = figure(1.3 * per_node * len(nodes) + 0.6, 2.4)
    gap, box = 0.4, 1.2
    for n, node in enumerate(nodes):
        x0 = n * (per_node * box + gap)
        ax.add_patch(
            FancyBboxPatch(
                (x0, 0), per_node * box - 0.1, 1.9, boxstyle="round,pad=0.05",
                facecolor="#f4f4f4", edgecolor="#555555",
            )
        )  # fmt: skip
        ax.text(x0 + (per_node * box - 0.1) / 2, 1.7, f"node {node}", ha="center", weight="bold")
    for info in infos:
        x = nodes.index(info["node_rank"]) * (per_node * box + gap) + info["local_rank"] * box
        color = rank_color(info["rank"])
        ax.add_patch(
            FancyBboxPatch(
                (x + 0.08, 0.15), box - 0.36, 1.25, boxstyle="round,pad=0.02",
                facecolor=color, edgecolor="black", alpha=0.9,
            )
        )  # fmt: skip
        label = f"rank {info['rank']}\nlocal {info['local_rank']}\nnode {info['node_rank']}"
        ax.text(x + box / 2 - 0.1, 0.77, label, ha="center", va="center", fontsize=9)
    ax.set_xlim(-0.2, len(nodes) * (per_node * box + gap) - gap + 0.1)
    ax.set_ylim(-0.1, 2.05)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title)
    return ax

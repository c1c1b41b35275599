"""Collectives, drawn: each rank's values before and after, and the ring step by step.

A value keeps the colour of the rank it came from; a value combined from several
ranks is grey, one that combines every rank's is dark.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from labsupport.comm.collectives import ring_chunk
from labsupport.viz.style import STYLE, figure, rank_color

COMBINED = "#d9d9d9"  # a value made by combining several ranks' values
COMPLETE = "#333333"  # a value that combines every rank's
CELL = 1.3  # width of a chunk's box in the ring figure


def draw_collective(results: list[dict], name: str, ax=None, key: str = "ours", width=None):
    """Each rank's tensor before and after a collective, one row per rank.

    ``results[r]`` holds ``before`` and ``after`` (under ``key``) for rank ``r``, as
    :func:`labsupport.labs.lab07_collectives.run_primitive` returns them. A box takes the colour
    of the rank the value came from; a value combined from several ranks is grey.
    ``width`` (boxes per side) lines up several panels.
    """
    world = len(results)
    origin = {}
    for rank, result in enumerate(results):
        for value in result["before"].tolist():
            origin.setdefault(value, rank)
    width = width or max(max(len(r["before"]), len(r[key])) for r in results)
    if ax is None:
        _, ax = figure(0.42 * (2 * width + 4), 0.42 * world + 0.7)
    for rank, result in enumerate(results):
        y = world - 1 - rank
        ax.text(-0.3, y + 0.4, f"rank {rank}", ha="right", va="center", fontsize=9)
        for side, values in ((0, result["before"]), (width + 2, result[key])):
            for i, value in enumerate(values.tolist()):
                color = rank_color(origin[value]) if value in origin else COMBINED
                ax.add_patch(
                    plt.Rectangle(
                        (side + i, y), 0.92, 0.8, facecolor=color, edgecolor="black", linewidth=0.5
                    )
                )
                ax.text(
                    side + i + 0.46, y + 0.4, f"{value:g}", ha="center", va="center", fontsize=8
                )
    ax.annotate(
        "",
        xy=(width + 1.7, world / 2),
        xytext=(width + 0.3, world / 2),
        arrowprops={"arrowstyle": "->", "lw": 1.5},
    )
    ax.text(width / 2, world + 0.1, "before", ha="center", fontsize=9)
    ax.text(width + 2 + width / 2, world + 0.1, "after", ha="center", fontsize=9)
    ax.set_title(name, loc="left", fontsize=11, family="monospace")
    ax.set_xlim(-2.2, 2 * width + 2.2)
    ax.set_ylim(-0.3, world + 0.6)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax


def ring_states(world_size: int) -> list[tuple[str, list[tuple[int, int, int]], list[list[set]]]]:
    """Who has contributed to each chunk on each rank, after each step of a ring all-reduce.

    Follows :func:`labsupport.comm.collectives.ring_chunk`, the schedule the implementation
    uses. Returns ``(label, messages, state)`` per step, where ``messages`` lists
    ``(src, dst, chunk)`` and ``state[rank][chunk]`` is the set of contributing ranks.
    """
    n = world_size
    state = [[{rank} for _ in range(n)] for rank in range(n)]
    steps = [("start", [], [[set(c) for c in row] for row in state])]
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            messages = [(r, (r + 1) % n, ring_chunk(phase, r, step, n)) for r in range(n)]
            sent = {(dst, chunk): set(state[src][chunk]) for src, dst, chunk in messages}
            for (dst, chunk), contributions in sent.items():
                if phase == "reduce-scatter":
                    state[dst][chunk] |= contributions
                else:
                    state[dst][chunk] = contributions
            label = f"{phase} step {step + 1}"
            steps.append((label, messages, [[set(c) for c in row] for row in state]))
    return steps


def draw_ring_allreduce(world_size: int = 4):
    """The ring all-reduce, step by step: ranks as columns, chunks as rows.

    A cell shows which ranks' values it sums; a chunk with every rank's contribution is
    drawn dark. Cells with a thick border are the ones sent to the right neighbour in
    that step.
    """
    steps = ring_states(world_size)
    n = world_size
    cols = (len(steps) + 1) // 2
    plt.rcParams.update(STYLE)
    fig, axes = plt.subplots(2, cols, figsize=(3.6 * cols, 6.4))
    for ax in axes.flat:
        ax.axis("off")
    order = [0, *range(1, n)] + [n - 1 + i for i in range(1, n)]
    placement = [(0, i) for i in range(n)] + [(1, i) for i in range(n - 1)]
    for (row, col), index in zip(placement, order, strict=True):
        label, messages, state = steps[index]
        ax = axes[row, col]
        ax.set_title(label, fontsize=10)
        next_sent = (
            {(src, chunk) for src, _, chunk in steps[index + 1][1]}
            if index + 1 < len(steps)
            else set()
        )
        for rank in range(n):
            for chunk in range(n):
                who = state[rank][chunk]
                full = len(who) == n
                color = (
                    "#333333"
                    if full
                    else rank_color(next(iter(who)))
                    if len(who) == 1
                    else COMBINED
                )
                thick = (rank, chunk) in next_sent
                x, y = rank * CELL, n - 1 - chunk
                ax.add_patch(
                    plt.Rectangle(
                        (x, y),
                        CELL - 0.08,
                        0.85,
                        facecolor=color,
                        edgecolor="black",
                        linewidth=2.2 if thick else 0.5,
                    )
                )
                text = "Σ" if full else "+".join(str(r) for r in sorted(who))
                ax.text(
                    x + CELL / 2,
                    y + 0.42,
                    text,
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white" if full else "black",
                )
            ax.text(rank * CELL + CELL / 2, n + 0.05, f"rank {rank}", ha="center", fontsize=8)
        for chunk in range(n):
            ax.text(
                -0.1, n - 1 - chunk + 0.42, f"chunk {chunk}", ha="right", va="center", fontsize=8
            )
        ax.set_xlim(-1.4, n * CELL + 0.1)
        ax.set_ylim(-0.2, n + 0.5)
        ax.set_aspect("equal")
    fig.suptitle(
        f"Ring all-reduce on {n} ranks: {n - 1} reduce-scatter steps, then {n - 1} all-gather"
        " steps\n(thick border: sent to the right neighbour in the next step)",
        fontsize=11,
    )
    return fig

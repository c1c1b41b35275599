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
RING_CELL, RING_ROW = 0.66, 0.34  # inches: a chunk's box in the ring figure, wide and tall
BOX_W, ROW_H = 0.45, 0.30  # inches: a value's box (wide enough for 4 digits), a rank's row
NAMES, GAP = 1.45, 0.25  # boxes' widths left of a panel: with the ranks' names, without


def draw_collective(
    results: list[dict],
    name: str,
    ax=None,
    key: str = "ours",
    width=None,
    below: bool = False,
    labels: bool = True,
):
    """Each rank's tensor before and after a collective, one row per rank.

    ``results[r]`` holds ``before`` and ``after`` (under ``key``) for rank ``r``, as
    :func:`labsupport.labs.lab07_collectives.run_primitive` returns them. A box takes the colour
    of the rank the value came from; a value combined from several ranks is grey.
    ``width`` (boxes per side) lines up several panels. The result is drawn right of the
    input, or ``below`` it (no headings then: a figure of several panels says it once);
    ``labels=False`` leaves out the ranks' names, for a panel beside one that has them.
    """
    world = len(results)
    origin = {}
    for rank, result in enumerate(results):
        for value in result["before"].tolist():
            origin.setdefault(value, rank)
    width = width or max(max(len(r["before"]), len(r[key])) for r in results)
    left = -NAMES if labels else -GAP
    right = width + 0.1 if below else 2 * width + 2.1
    rows = 2 * world + 1 if below else world + 1
    if ax is None:
        _, ax = figure(BOX_W * (right - left), ROW_H * rows + 0.5)
        ax.set_position((0, 0, 1, ROW_H * rows / (ROW_H * rows + 0.5)))
    after_x, after_y = (0, -(world + 1)) if below else (width + 2, 0)
    for rank, result in enumerate(results):
        y = world - 1 - rank
        for side, values in ((0, result["before"]), (1, result[key])):
            x0, y0 = side * after_x, y + side * after_y
            if labels and (side == 0 or below):
                ax.text(-0.3, y0 + 0.4, f"rank {rank}", ha="right", va="center")
            for i, value in enumerate(values.tolist()):
                color = rank_color(origin[value]) if value in origin else COMBINED
                ax.add_patch(
                    plt.Rectangle(
                        (x0 + i, y0), 0.95, 0.8, facecolor=color, edgecolor="black", linewidth=0.5
                    )
                )
                ax.text(x0 + i + 0.475, y0 + 0.4, f"{value:g}", ha="center", va="center")
    if below:
        start, end = (width / 2, -0.05), (width / 2, -0.85)
    else:
        start, end = (width + 0.3, world / 2), (width + 1.7, world / 2)
        ax.text(width / 2, world + 0.1, "before", ha="center")
        ax.text(width + 2 + width / 2, world + 0.1, "after", ha="center")
    ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "->", "lw": 1.5})
    ax.set_title(name, loc="left", family="monospace")
    ax.set_xlim(left, right)
    ax.set_ylim(-(world + 1.1) if below else -0.2, world + (0.1 if below else 0.7))
    ax.axis("off")
    return ax


def draw_collective_key(ax) -> None:
    """What a box of :func:`draw_collective` means, for a figure of panels drawn ``below``."""
    entries = [(rank_color(0), "from rank 0"), (rank_color(1), "from rank 1"),
               (COMBINED, "combined from\nseveral ranks")]  # fmt: skip
    for row, (color, text) in enumerate(entries):
        y = 0.5 - 1.7 * row
        ax.add_patch(
            plt.Rectangle((0, y), 0.95, 0.8, facecolor=color, edgecolor="black", linewidth=0.5)
        )
        ax.text(1.3, y + 0.4, text, va="center")
    ax.text(0, 2.0, "above: before the call\nbelow: after it", va="bottom")
    ax.set_xlim(-GAP, 4.1)
    ax.set_ylim(-5.1, 4.1)
    ax.axis("off")


def collectives_figure(runs: dict, columns: int = 3):
    """Chapter 7: one :func:`draw_collective` panel per entry of ``runs`` (name ->
    results), each result below its input, ``columns`` to a row, and a key in the last
    cell. The ranks' names are written once per row of panels."""
    world = len(next(iter(runs.values())))
    width = max(len(r["before"]) for results in runs.values() for r in results)
    rows = -(-(len(runs) + 1) // columns)
    panel = [BOX_W * (width + 0.1 + NAMES), BOX_W * (width + 0.1 + GAP)]  # with, without names
    tall, title = ROW_H * (2 * world + 1.2), 0.42
    size = (panel[0] + (columns - 1) * panel[1], rows * (tall + title))
    plt.rcParams.update(STYLE)
    fig = plt.figure(figsize=size)
    for i in range(rows * columns):
        column, row = i % columns, i // columns
        x = 0 if column == 0 else panel[0] + (column - 1) * panel[1]
        y = size[1] - (row + 1) * (tall + title)
        ax = fig.add_axes((x / size[0], y / size[1], panel[column > 0] / size[0], tall / size[1]))
        if i < len(runs):
            name = list(runs)[i]
            draw_collective(runs[name], name, ax=ax, width=width, below=True, labels=column == 0)
        elif i == len(runs):
            draw_collective_key(ax)
        else:
            ax.axis("off")
    return fig


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
    """The ring all-reduce, step by step: ranks as columns, chunks as rows; the
    reduce-scatter's steps down the left, the all-gather's down the right.

    A cell shows which ranks' values it sums; a chunk with every rank's contribution is
    drawn dark. Cells with a thick border are the ones sent to the right neighbour in
    the next step.
    """
    steps = ring_states(world_size)
    n = world_size
    names, panel = 0.8, RING_CELL * n  # inches: the chunks' names, a step's panel
    tall, title, gap, top = RING_ROW * (n + 0.9), 0.45, 0.3, 0.75
    size = (names + 2 * panel + gap, top + n * (tall + title))
    plt.rcParams.update(STYLE)
    fig = plt.figure(figsize=size)
    for index, (label, _, state) in enumerate(steps):
        column, row = (0, index) if index < n else (1, index - n + 1)
        x = names + column * (panel + gap)
        y = size[1] - top - (row + 1) * (tall + title) + title / 2
        ax = fig.add_axes((x / size[0], y / size[1], panel / size[0], tall / size[1]))
        next_sent = (
            {(src, chunk) for src, _, chunk in steps[index + 1][1]}
            if index + 1 < len(steps)
            else set()
        )
        _draw_ring_step(ax, state, next_sent, label, chunk_names=column == 0)
    key = fig.add_axes(((names + panel + gap) / size[0], 1 - (top + tall + title) / size[1],
                        panel / size[0], tall / size[1]))  # fmt: skip
    key.text(
        0.05,
        0.5,
        "Σ (dark): summed over\nevery rank\n\n"
        "thick border: sent to\nthe right neighbour\nin the next step",
        va="center",
        transform=key.transAxes,
    )
    key.axis("off")
    fig.suptitle(
        f"Ring all-reduce on {n} ranks: {n - 1} reduce-scatter\nsteps (left), then {n - 1}"
        " all-gather steps (right)",
        y=1 - 0.08 / size[1],
        va="top",
    )
    return fig


def _draw_ring_step(ax, state, next_sent, label, chunk_names) -> None:
    """One step of :func:`draw_ring_allreduce`: ``state[rank][chunk]``, the ranks each
    cell sums; ``next_sent``, the ``(rank, chunk)`` cells sent in the next step."""
    n = len(state)
    ax.set_title(label)
    for rank in range(n):
        for chunk in range(n):
            who = state[rank][chunk]
            full = len(who) == n
            color = COMPLETE if full else rank_color(next(iter(who))) if len(who) == 1 else COMBINED
            thick = (rank, chunk) in next_sent
            y = n - 1 - chunk
            ax.add_patch(
                plt.Rectangle(
                    (rank + 0.04, y + 0.06),
                    0.92,
                    0.88,
                    facecolor=color,
                    edgecolor="black",
                    linewidth=2.2 if thick else 0.5,
                )
            )
            text = "Σ" if full else "+".join(str(r) for r in sorted(who))
            ax.text(rank + 0.5, y + 0.5, text, ha="center", va="center",
                    color="white" if full else "black")  # fmt: skip
        ax.text(rank + 0.5, n + 0.1, f"rank {rank}", ha="center", va="bottom")
    if chunk_names:
        for chunk in range(n):
            ax.text(-0.1, n - 1 - chunk + 0.5, f"chunk {chunk}", ha="right", va="center")
    ax.set_xlim(0, n)
    ax.set_ylim(0, n + 0.9)
    ax.axis("off")

"""Pipeline schedules, drawn: who computes what when (a Gantt chart per rank), the
activations each rank holds over time, and the bubble against the number of micro-batches.

A timeline is, per rank, a list of ``(kind, micro-batch, chunk, start, end)``: measured
(:func:`labsupport.labs.lab11_pipeline.compute_events`) or read off the simulated
schedule (:func:`simulated`). Each rank keeps its colour; a forward is drawn light, a
backward solid, a second model chunk hatched.
"""

from __future__ import annotations

from labsupport.parallel import schedules, simulator
from labsupport.viz.style import PAGE_WIDTH, SMALL, figure, rank_color, subplots


def simulated(name: str, p: int, m: int, v: int = 1, durations=None) -> list[list[tuple]]:
    """The timeline of schedule ``name`` played by :func:`~labsupport.parallel.
    simulator.simulate`, every chunk's forward or backward one slot of ``1/v`` (or
    ``durations[kind]`` of them): time in units of one whole stage's forward."""
    lists = schedules.build(name, p, m, v)
    timeline = simulator.simulate(lists, schedules.style(name), durations)
    d = durations or {}
    return [
        [(a.kind, a.microbatch, a.chunk, t / v, (t + d.get(a.kind, 1)) / v) for a, t in rank]
        for rank in timeline
    ]


def draw_timeline(
    timeline, ax=None, title: str | None = None, xlabel: str = "time", labels=True, span=None
):
    """A Gantt chart: one row per rank (rank 0 on top), one box per forward (light),
    backward or B of a split backward (solid), or W (between), labelled with its
    micro-batch where the box has room for the number; chunk 1 and up hatched. The time
    axis ends at ``span`` (the timeline's end by default)."""
    p = len(timeline)
    if ax is None:
        _, ax = figure(PAGE_WIDTH, 0.45 * p + 1.0)
    span = span or max(e for rank in timeline for *_, e in rank)
    # points per unit of time: the axes' width (as laid out so far) over the span
    per_unit = ax.get_position().width * ax.figure.get_figwidth() * 72 / span
    for rank, events in enumerate(timeline):
        y = p - 1 - rank
        for kind, mb, chunk, start, end in events:
            forward = kind == "forward"
            ax.broken_barh(
                [(start, end - start)],
                (y - 0.38, 0.76),
                facecolors=rank_color(rank),
                alpha={"forward": 0.35, "backward_weight": 0.7}.get(kind, 1.0),
                edgecolor="white",
                linewidth=0.6,
                hatch="///" if chunk else None,
            )
            if labels and (end - start) * per_unit > 0.65 * SMALL * len(str(mb)) + 4:
                ax.text(
                    (start + end) / 2,
                    y,
                    str(mb),
                    ha="center",
                    va="center",
                    color="black" if forward else "white",
                )
    ax.set_yticks(range(p), [f"rank {r}" for r in reversed(range(p))])
    ax.set_xlim(0, span)
    ax.set_ylim(-0.6, p - 0.4)
    ax.set_xlabel(xlabel)
    ax.spines["left"].set_visible(False)
    ax.tick_params(axis="y", length=0)
    if title:
        ax.set_title(title, loc="left")
    return ax


def draw_schedules(cases, p: int = 4, durations=None):
    """One simulated Gantt chart per ``(title, name, m, v)`` of ``cases``, on one time
    axis (units of one stage's forward; a backward takes one unit too, or as many as
    ``durations`` gives)."""
    fig, axes = subplots(len(cases), 1, PAGE_WIDTH, 1.7 * len(cases) + 0.5, sharex=True)
    span = max(
        max(e for rank in simulated(n, p, m, v, durations) for *_, e in rank)
        for _, n, m, v in cases
    )
    for ax, (title, name, m, v) in zip(axes, cases, strict=True):
        timeline = simulated(name, p, m, v, durations)
        lists = schedules.build(name, p, m, v)
        played = simulator.simulate(lists, schedules.style(name), durations)
        bubble = simulator.measured_bubble(played, durations)
        title = f"{title}: idle {bubble:.0%} of the total"
        draw_timeline(timeline, ax, title, xlabel="", span=span)
    unit = "forward or backward" if durations is None else "forward, B or W"
    axes[-1].set_xlabel(f"time (slots: one stage's {unit}\nof one micro-batch)")
    fig.tight_layout()
    return fig


def draw_measured_and_simulated(cases, p: int = 4, durations=None):
    """Each schedule's measured timeline (in ms) above its simulation (in slots, each
    kind of action ``durations[kind]`` of them), for ``(name, m, v, measured)`` in
    ``cases``: one column, so that the figure is shown at the page's width with its text
    as large as the page's."""
    fig, axes = subplots(2 * len(cases), 1, PAGE_WIDTH, 3.2 * len(cases) + 0.3)
    for (top, bottom), (name, m, v, measured) in zip(axes.reshape(-1, 2), cases, strict=True):
        draw_timeline(measured, top, f"{name}, m = {m}: measured", xlabel="ms")
        draw_timeline(
            simulated(name, p, m, v, durations), bottom, f"{name}: simulated", xlabel="slots"
        )
    fig.tight_layout()
    return fig


def held_over_time(timeline) -> list[list[tuple[float, int]]]:
    """Per rank, ``(time, micro-batches held)`` after each action: a forward adds the
    micro-batch's activations, its backward (or its W, when split) frees them."""
    out = []
    for events in timeline:
        held, steps = 0, [(0.0, 0)]
        for kind, _, _, _, end in sorted(events, key=lambda e: e[4]):
            held += {"forward": 1, "backward_input": 0}.get(kind, -1)
            steps.append((end, held))
        out.append(steps)
    return out


def draw_held(cases, p: int = 4):
    """Micro-batches whose activations each rank holds over a step, per schedule
    ``(title, name, m, v)`` (chunks counted as ``1/v`` of a micro-batch)."""
    fig, axes = subplots(len(cases), 1, PAGE_WIDTH, 2.0 * len(cases) + 0.4, sharex=True)
    for ax, (title, name, m, v) in zip(axes, cases, strict=True):
        for rank, steps in enumerate(held_over_time(simulated(name, p, m, v))):
            ax.step(
                [t for t, _ in steps],
                [h / v for _, h in steps],
                where="post",
                color=rank_color(rank),
                label=f"rank {rank}",
            )
        ax.set_title(title, loc="left")
        ax.set_ylabel("micro-batches\nheld")
    axes[-1].set_xlabel("time (slots)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def draw_bubble(p_values=(4, 8), m_max: int = 64, interleaved=(), measured=None, ax=None):
    """The bubble against the number of micro-batches ``m``, both ways the literature
    writes it, (p-1)/(m+p-1) (idle over the total) and (p-1)/m (idle over the ideal
    time), for each ``p``; for each ``(p, v)`` of ``interleaved``, (p-1)/(vm+p-1) with
    ``m`` a multiple of ``p``; ``measured`` adds points ``{label: [(m, bubble), ...]}``."""
    if ax is None:
        _, ax = figure(PAGE_WIDTH, 3.2)
    ms = list(range(1, m_max + 1))
    for i, p in enumerate(p_values):
        total = [schedules.bubble_fraction(p, m)["of_total"] for m in ms]
        ideal = [min(schedules.bubble_fraction(p, m)["of_ideal"], 1.5) for m in ms]
        ax.plot(ms, total, color=rank_color(i), label=f"p={p}: (p-1)/(m+p-1), idle / total")
        ax.plot(ms, ideal, ":", color=rank_color(i), label=f"p={p}: (p-1)/m, idle / ideal")
    for j, (p, v) in enumerate(interleaved):
        chunked = [(m, schedules.bubble_fraction(p, m, v)["of_total"]) for m in ms if m % p == 0]
        ax.plot(
            *zip(*chunked, strict=True),
            "--",
            color=rank_color(len(p_values) + j),
            label=f"p={p}, v={v} (interleaved): (p-1)/(vm+p-1)",
        )
    for j, (label, points) in enumerate((measured or {}).items()):
        ax.plot(*zip(*points, strict=True), "o", color=rank_color(4 + j), label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per step, m")
    ax.set_ylabel("bubble")
    ax.set_ylim(0, 1.05)
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(0, -0.2))
    return ax


# --------------------------------------------------------------------------- chapter 11


def schedules_figure():
    """Chapter 11: four schedules on 4 ranks, from the simulator."""
    return draw_schedules(
        [
            ("Naive, m = 4", "naive", 4, 1),
            ("GPipe, m = 8", "gpipe", 8, 1),
            ("1F1B, m = 8", "1f1b", 8, 1),
            ("Interleaved 1F1B, v = 2, m = 8", "interleaved", 8, 2),
        ]
    )


def held_figure():
    """Chapter 11: activations held per rank over a step of 8 micro-batches."""
    return draw_held(
        [
            ("GPipe, m = 8", "gpipe", 8, 1),
            ("1F1B, m = 8", "1f1b", 8, 1),
            ("Interleaved, v = 2, m = 8", "interleaved", 8, 2),
        ]
    )


def bubble_figure():
    """Chapter 11: the bubble against m, both denominators, and interleaving (shown at
    85 % of the page)."""
    _, ax = figure(0.85 * PAGE_WIDTH, 3.2)
    return draw_bubble(p_values=(4, 8), m_max=64, interleaved=((4, 2),), ax=ax).figure


def zero_bubble_figure():
    """Chapter 11: 1F1B and the zero-bubble schedules on 4 ranks, ``T_F = T_B = T_W``."""
    return draw_schedules(
        [
            ("1F1B, m = 8", "1f1b", 8, 1),
            ("ZB-H1, m = 8", "zb-h1", 8, 1),
            ("ZB-V, m = 8", "zbv", 8, 2),
            ("DualPipeV, m = 8", "dualpipev", 8, 2),
        ],
        durations=simulator.SPLIT,
    )

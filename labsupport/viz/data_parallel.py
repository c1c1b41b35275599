"""Chapter 10 and lab 10, drawn: one data-parallel step as lanes of bars (the backward
pass and each bucket's all-reduce, measured or modelled), and step time against the
bucket size."""

from __future__ import annotations

import torch
from matplotlib.patches import Patch

from labsupport.estimate.overlap import overlap_schedule
from labsupport.models.gpt import GPT, GPT2_SMALL
from labsupport.parallel.data_parallel import make_buckets
from labsupport.viz.style import PAGE_WIDTH, SMALL, figure, rank_color, subplots

COMPUTE, COMM, WAIT = "#555555", rank_color(0), "#bbbbbb"


#: What the colours of :func:`step_lanes` mean, for :func:`draw_lanes`'s ``legend``.
STEP_LEGEND = [
    ("forward", "#aaaaaa"),
    ("backward", COMPUTE),
    ("optimizer step", rank_color(2)),
    ("a bucket's all-reduce (two shades alternate)", COMM),
]


def draw_lanes(
    panels: dict,
    xlabel: str = "milliseconds since the step started",
    legend=None,
    width: float = 8.0,
):
    """One panel per entry of ``panels``, each a dict ``lane -> [(start, end, color)]``
    (bars; ``end == start`` draws a tick). Lanes read from top to bottom; the figure is
    ``width`` inches wide. ``legend``: ``[(label, color)]`` drawn under the panels, e.g.
    :data:`STEP_LEGEND`."""
    heights = [0.8 + 0.38 * len(lanes) for lanes in panels.values()]
    size = (len(panels), 1, width, 0.4 + sum(heights))
    fig, axes = subplots(*size, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights})
    for ax, (title, lanes) in zip(axes[:, 0], panels.items(), strict=True):
        names = list(lanes)
        for row, name in enumerate(names):
            y = len(names) - 1 - row
            for start, end, color in lanes[name]:
                if end > start:
                    ax.barh(
                        y,
                        end - start,
                        left=start,
                        height=0.62,
                        color=color,
                        edgecolor="white",
                        lw=0.4,
                    )
                else:
                    ax.plot([start, start], [y - 0.31, y + 0.31], color=color, lw=1.2)
        ax.set_yticks(range(len(names)), list(reversed(names)), fontsize=SMALL)
        ax.set_ylim(-0.6, len(names) - 0.4)
        ax.set_title(title, loc="left")
    axes[-1, 0].set_xlabel(xlabel)
    bottom = 0.0
    if legend:
        handles = [Patch(facecolor=color, label=label) for label, color in legend]
        fig.legend(handles=handles, loc="lower center", ncol=2, frameon=False, fontsize=SMALL)
        rows = (len(handles) + 1) // 2
        bottom = (0.1 + 0.28 * rows) / fig.get_figheight()  # inches kept for the legend
    fig.tight_layout(rect=(0, bottom, 1, 1))
    return fig


def step_lanes(per_rank: list, scale: float = 1e3) -> dict:
    """Two lanes per rank of a measured step
    (:func:`labsupport.labs.lab10_data_parallel.step_timeline` on every rank).

    Compute: forward (light), backward until its last gradient (dark), the optimizer
    step (green). Communication: each bucket's all-reduce, drawn from when it started
    or the previous bucket's finished, whichever is later, to when it finished: the
    all-reduces of one rank run one after another, so a bar is the time that bucket
    had the network to itself (buckets alternate in two shades).
    """
    lanes = {}
    for rank, events in enumerate(per_rank):
        at = {what: t * scale for what, t in events}
        last_grad = max(t * scale for what, t in events if what.startswith("grad "))
        lanes[f"rank {rank} compute"] = [
            (at["forward"], at["backward"], "#aaaaaa"),
            (at["backward"], last_grad, COMPUTE),
            (at["waited"], at["step"], rank_color(2)),
        ]
        bars, previous = [], 0.0
        buckets = sum(1 for what, _ in events if what.startswith("all-reduce start"))
        for b in range(buckets):
            start = max(at[f"all-reduce start bucket {b}"], previous)
            previous = at[f"all-reduce finished bucket {b}"]
            bars.append((start, previous, COMM if b % 2 == 0 else rank_color(4)))
        lanes[f"rank {rank} all-reduce"] = bars
    return lanes


def draw_bucket_sweep(caps_mb, measured_s, predicted_s, compute_s: float):
    """Step time against the bucket size: measured (markers) and the overlap model
    (line), with the step without communication for reference."""
    fig, ax = figure(6.5, 3.4)
    ax.semilogx(caps_mb, [t * 1e3 for t in measured_s], "o", color=rank_color(0), label="measured")
    ax.semilogx(caps_mb, [t * 1e3 for t in predicted_s], "-", color=rank_color(1), label="model")
    ax.axhline(compute_s * 1e3, color="#999999", ls=":", lw=1, label="no communication")
    ax.set_xlabel("bucket_cap_mb (MiB)")
    ax.set_ylabel("one training step (ms)")
    ax.legend(fontsize=SMALL)
    fig.tight_layout()
    return fig


def overlap_figure():
    """Chapter 10: one step of GPT-2 small on 64 GPUs, modelled (not measured) by
    :func:`~labsupport.estimate.overlap.overlap_schedule`: forward 5 ms and backward
    10 ms (6·N·D FLOPs for 8,192 tokens per GPU at about 400 TFLOP/s), float32 gradients
    all-reduced by a ring over 400 Gb/s links (50 GB/s), 50 µs of latency per
    all-reduce; one all-reduce per parameter after backward, then buckets."""
    with torch.device("meta"):
        params = [p for p in GPT(GPT2_SMALL).parameters() if p.requires_grad]
    forward, backward, a, b = 5e-3, 10e-3, 50e-6, 2 * 63 / 64 / 50e9
    cases = {
        "naive: one all-reduce per parameter, after backward": (
            [4 * p.numel() for p in reversed(params)],
            False,
        )
    }
    for cap in (25, 1):
        cases[f"buckets of {cap} MiB, all-reduced during backward"] = (
            [bk.nbytes for bk in make_buckets(params, cap * 2**20)],
            True,
        )
    panels = {}
    for title, (sizes, overlap) in cases.items():
        buckets, step = overlap_schedule(sizes, forward, backward, a, b, overlap)
        bars = [
            (s * 1e3, e * 1e3, COMM if i % 2 == 0 else rank_color(4))
            for i, (_, s, e) in enumerate(buckets)
        ]
        compute = [
            (0, forward * 1e3, "#aaaaaa"),
            (forward * 1e3, (forward + backward) * 1e3, COMPUTE),
        ]
        panels[f"{title}: {step * 1e3:.1f} ms"] = {
            "forward, backward": compute,
            f"{len(sizes)} all-reduces": bars,
        }
    return draw_lanes(panels, width=PAGE_WIDTH)

"""The walls of chapter 3, drawn: model states per part, and days of compute against
days of communication as the number of GPUs grows."""

from __future__ import annotations

import numpy as np

from labsupport.estimate.datasheets import ASSUMED_MFU, MODELS, device_spec
from labsupport.estimate.flops import SECONDS_PER_DAY
from labsupport.estimate.memory import training_memory
from labsupport.estimate.units import GB
from labsupport.estimate.walls import crossover_devices, step_times
from labsupport.viz.style import PAGE_WIDTH, SMALL, figure, rank_color, subplots

PART_COLORS = {
    "weights": rank_color(0),
    "gradients": rank_color(1),
    "master weights": rank_color(2),
    "momentum": rank_color(3),
    "variance": rank_color(4),
}


def memory_breakdown_figure(models=None, gpu: str = "H100 SXM"):
    """Chapter 3: mixed-precision Adam model states, part by part, for a few model sizes.

    ``models`` maps a label to a parameter count (default 7B, 70B, 175B). Each panel has
    its own scale, with one GPU's memory drawn as a dashed line.
    """
    models = models or {"7B": 7e9, "70B": 70e9, "175B": 175e9}
    rows = (len(models) + 1) // 2  # two panels a row, the legend in a spare cell or below
    fig, grid = subplots(rows, 2, PAGE_WIDTH, 3.1 * rows + 0.6, squeeze=False)
    axes, spare = list(grid.flat[: len(models)]), list(grid.flat[len(models) :])
    limit, short = device_spec(gpu)["memory_bytes"] / GB, gpu.split()[0]
    for ax, (label, n) in zip(axes, models.items(), strict=False):
        bottom = 0.0
        for part, nbytes in training_memory(n).items():
            ax.bar(
                0,
                nbytes / GB,
                bottom=bottom,
                width=0.6,
                color=PART_COLORS[part],
                edgecolor="black",
                linewidth=0.5,
                label=part,
            )
            bottom += nbytes / GB
        ax.axhline(limit, color="black", ls="--", lw=1)
        ax.text(0.33, limit, f" one {short}: {limit:.0f} GB", va="bottom", fontsize=SMALL)
        ax.text(0, bottom, f"{bottom:,.0f} GB", ha="center", va="bottom", fontsize=SMALL)
        ax.set_xlim(-0.5, 1.7)
        ax.set_ylim(0, max(bottom, limit) * 1.25)
        ax.set_xticks([0], [f"{label} parameters"])
        ax.set_ylabel("GB")
    fig.suptitle("Model states of mixed-precision Adam: 16 bytes per parameter")
    fig.tight_layout(rect=(0, 0 if spare else 0.12, 1, 1))
    handles, labels = axes[0].get_legend_handles_labels()
    if spare:
        fig.legend(handles, labels, loc="center", bbox_to_anchor=spare[0].get_position())
        fig.delaxes(spare[0])
    else:
        fig.legend(handles, labels, loc="lower center", ncol=3, frameon=False)
    return fig


def time_to_train_figure(model: str = "GPT-3 175B", gpu: str = "A100 SXM 80GB", bandwidth=50 * GB):
    """Chapter 3: days of compute and of gradient all-reduce against the number of GPUs.

    Plain data parallelism, the model's published batch, ``gpu`` at 40% MFU, a ring
    all-reduce of 16-bit gradients at ``bandwidth`` per GPU with alpha = 5 µs, and no
    overlap. Memory is ignored here, as if every GPU could hold the model states.
    """
    spec, peak, short = MODELS[model], device_spec(gpu)["tensor"], gpu.split()[0]
    devices = np.unique(np.geomspace(8, 16384, 60).astype(int))
    steps = spec["tokens"] / spec["batch_tokens"]
    compute, communication = [], []
    for g in devices:
        t = step_times(spec["params"], spec["batch_tokens"], int(g), peak, bandwidth)
        compute.append(steps * t["compute"] / SECONDS_PER_DAY)
        communication.append(steps * t["communication"] / SECONDS_PER_DAY)
    compute, communication = np.array(compute), np.array(communication)
    cross = crossover_devices(spec["batch_tokens"], peak * ASSUMED_MFU, bandwidth)
    fig, ax = figure(0.9 * PAGE_WIDTH, 4.0)
    ax.plot(devices, compute, color=rank_color(0), lw=2, label="compute")
    ax.plot(devices, communication, color=rank_color(1), lw=2, label="gradient all-reduce (ring)")
    ax.plot(
        devices,
        compute + communication,
        color="black",
        lw=1.2,
        ls="--",
        label="total, without overlap",
    )
    ax.axvline(cross, color="#999999", lw=1, ls=":")
    ax.text(
        cross * 1.08,
        compute.max() / 3,
        f"communication\ndominates beyond\n~{cross:,.0f} GPUs",
        fontsize=SMALL,
        color="#555555",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"number of {short} GPUs (data parallel)")
    ax.set_ylabel("days")
    ax.set_title(
        f"{model} on {spec['tokens'] / 1e9:.0f}B tokens:\n{short} at 40% MFU, "
        f"{bandwidth / GB:g} GB/s per GPU",
        fontsize=SMALL,
    )
    ax.legend(fontsize=SMALL, frameon=False, loc="lower left")
    return fig

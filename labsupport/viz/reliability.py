"""Chapter and lab 16, fault tolerance, drawn: the MTBF of a job as the cluster grows, the
time a checkpoint interval wastes, and a resumed loss curve on the uninterrupted one."""

from __future__ import annotations

import numpy as np

from labsupport.estimate import reliability
from labsupport.viz.style import PAGE_WIDTH, SMALL, rank_color, subplots

HOUR = 3600.0


def draw_job_mtbf(per_device_s: float, gpus=(8, 100_000), marks=None, ax=None):
    """A job's MTBF (hours) against its number of GPUs, each failing independently with
    MTBF ``per_device_s``; ``marks`` ({label: GPUs}) are pointed out on the line."""
    if ax is None:
        _, ax = subplots(1, 1, 4.6, 3.4)
    n = np.geomspace(*gpus, 200)
    ax.loglog(n, [reliability.job_mtbf(per_device_s, k) / HOUR for k in n], color=rank_color(0))
    for label, k in (marks or {}).items():
        hours = reliability.job_mtbf(per_device_s, k) / HOUR
        ax.plot([k], [hours], "o", color=rank_color(5))
        ax.annotate(
            _hours_or_days(label, hours),
            (k, hours),
            textcoords="offset points",
            xytext=(6, 4),
            fontsize=SMALL,
        )
    ax.set(xlabel="GPUs in the job", ylabel="job MTBF (hours)")
    ax.set_title("At Llama 3's failure rate per GPU")
    ax.grid(True, which="major", alpha=0.3)
    return ax


def _hours_or_days(label: str, hours: float) -> str:
    """``label`` and a time: hours under 100 h, days above (one decimal under 10 days)."""
    if hours < 100:
        return f"{label}\n{hours:,.1f} h"
    days = hours / 24
    return f"{label}\n{days:.1f} days" if days < 10 else f"{label}\n{days:,.0f} days"


def draw_wasted_fraction(checkpoint_s: float, mtbf_s: float, ax=None, label: str = ""):
    """The extra time per second of work against the checkpoint interval: Young's
    first-order C/τ + τ/(2M) and Daly's complete model, T_w/T_s − 1 (both the same
    quantity, so Daly's lies above Young's), with Young's and Daly's optima marked."""
    if ax is None:
        _, ax = subplots(1, 1, 4.6, 3.4)
    young = reliability.young_interval(checkpoint_s, mtbf_s)
    taus = np.geomspace(young / 8, min(8 * young, 2 * mtbf_s), 300)
    first = [reliability.wasted_fraction(t, checkpoint_s, mtbf_s) for t in taus]
    exact = [reliability.expected_wall_time(1.0, t, checkpoint_s, mtbf_s) - 1 for t in taus]
    minutes = taus / 60
    ax.plot(minutes, np.array(first) * 100, color=rank_color(0), label="C/τ + τ/(2M)")
    ax.plot(minutes, np.array(exact) * 100, color=rank_color(1), ls="--", label="Daly's model")
    waste = reliability.wasted_fraction(young, checkpoint_s, mtbf_s)
    ax.plot([young / 60], [waste * 100], "o", color=rank_color(0))
    ax.annotate(
        f"Young: every {young / 60:.0f} min,\n{waste:.1%} wasted",
        (young / 60, waste * 100),
        textcoords="offset points",
        xytext=(0, 26),
        ha="center",
        fontsize=SMALL,
    )
    daly = reliability.daly_interval(checkpoint_s, mtbf_s)
    ax.axvline(daly / 60, color=rank_color(1), lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_ylim(0, max(first) * 100 * 0.6)
    ax.set(xlabel="checkpoint every ... minutes of work", ylabel="extra time (% of the work)")
    ax.set_title(label or f"C = {checkpoint_s:g} s, M = {mtbf_s / HOUR:.2f} h")
    ax.legend(fontsize=SMALL, loc="upper right")
    return ax


def failures_figure():
    """Chapter 16: the MTBF of a job at Llama 3's failure rate per GPU, as the job grows;
    and the extra time per second of work against the checkpoint interval for BLOOM's 40 s
    checkpoint at that job's MTBF."""
    snap = reliability.LLAMA3_SNAPSHOT
    job = reliability.mtbf(snap["days"] * 24 * HOUR, snap["unexpected"])
    per_gpu = reliability.device_mtbf(job, snap["gpus"])
    fig, (left, right) = subplots(2, 1, PAGE_WIDTH, 7.0)
    marks = {"384 (BLOOM's size)": 384, "16,384 (Llama 3)": 16_384, "100,000": 100_000}
    draw_job_mtbf(per_gpu, marks=marks, ax=left)
    draw_wasted_fraction(
        reliability.BLOOM_CHECKPOINTS["save_s"],
        job,
        ax=right,
        label=f"C = 40 s (BLOOM's save), M = {job / HOUR:.2f} h (Llama 3's job)",
    )
    fig.tight_layout()
    return fig


def draw_resumed(straight: list, resumed: list, resumed_at: int, killed_at: int, ax=None):
    """The loss of every step of the uninterrupted run, under the killed run's steps up
    to its last checkpoint and the resumed run's steps after it."""
    if ax is None:
        _, ax = subplots(1, 1, 6.5, 3.2)
    steps = range(len(straight))
    ax.plot(steps, straight, "o-", color="0.75", lw=4, label="uninterrupted")
    ax.plot(
        steps[:resumed_at],
        resumed[:resumed_at],
        "x-",
        color=rank_color(5),
        label="killed run (to its last checkpoint)",
    )
    ax.plot(
        steps[resumed_at:],
        resumed[resumed_at:],
        "x-",
        color=rank_color(0),
        label=f"resumed from step {resumed_at}",
    )
    ax.axvline(killed_at, color=rank_color(5), ls=":", lw=1)
    ax.text(killed_at + 0.1, max(straight), " a rank killed", va="top", color=rank_color(5))
    ax.set(xlabel="step", ylabel="loss", title="Resumed from a checkpoint: the same curve")
    ax.legend(fontsize=SMALL)
    return ax

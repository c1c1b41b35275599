"""Chapter 9 and lab 9, drawn: parameter-server timelines (simulated or measured), loss
curves, staleness, and the bytes through a server against a ring all-reduce.

A worker keeps the colour of its rank: with one server on rank 0, worker ``w`` is rank
``w + 1``.
"""

from __future__ import annotations

import numpy as np

from labsupport.viz.style import PAGE_WIDTH, SMALL, figure, rank_color, subplots

#: GPT-2 small's parameters (chapter 2): the gradient of the chapter's worked number.
GPT2_SMALL_PARAMS = 124_439_808


def simulate(compute_s: list[float], mode: str, until: float, server_s: float = 0.0) -> dict:
    """A timeline of parameter-server training up to time ``until``, computed (not
    measured): worker ``w`` takes ``compute_s[w]`` per gradient, the server ``server_s``
    per update.

    Synchronous: every round starts together and ends when the slowest worker's
    gradient has been applied. Asynchronous: the server applies gradients in the order
    they arrive, one at a time; a worker starts its next gradient as soon as its own has
    been applied. Returns ``compute`` (per worker, its ``(start, end)`` intervals) and
    ``updates`` (``worker``, ``time`` applied, ``staleness``), in the order applied.
    """
    workers = range(len(compute_s))
    compute: dict[int, list] = {w: [] for w in workers}
    updates: list[dict] = []
    start, pulled, version = [0.0 for _ in workers], [0 for _ in workers], 0
    while True:
        if mode == "sync":
            done = max(start[w] + compute_s[w] for w in workers) + server_s
            arrivals = [(w, start[w] + compute_s[w], done) for w in workers]
        else:
            w = min(workers, key=lambda w: start[w] + compute_s[w])
            arrival = start[w] + compute_s[w]
            done = max(arrival, updates[-1]["time"] if updates else 0.0) + server_s
            arrivals = [(w, arrival, done)]
        if done > until:
            return {"compute": compute, "updates": updates}
        for w, arrival, applied in arrivals:
            compute[w].append((start[w], arrival))
            stale = version - pulled[w]
            updates.append({"worker": w, "time": applied, "staleness": stale, "version": version})
            version += mode != "sync"
        version += mode == "sync"
        for w, _, applied in arrivals:
            start[w], pulled[w] = applied, version


def draw_simulated(sims: dict, first_rank: int = 1):
    """One panel per simulated run (:func:`simulate`):
    a row per worker with its gradient computations as bars, and the server's updates
    as ticks on the top row; the slowest worker's ticks are labelled with the staleness
    of its gradient."""
    fig, axes = subplots(
        len(sims), 1, PAGE_WIDTH, 1.0 + 1.25 * len(sims), sharex=True, squeeze=False
    )
    for ax, (title, sim) in zip(axes[:, 0], sims.items(), strict=True):
        workers = len(sim["compute"])
        slowest = max(sim["compute"], key=lambda w: np.diff(sim["compute"][w][0]).item())
        for w, intervals in sim["compute"].items():
            row = workers - 1 - w
            for start, end in intervals:
                ax.barh(row, end - start, left=start, height=0.6, color=rank_color(w + first_rank))
        for u in sim["updates"]:
            color = rank_color(u["worker"] + first_rank)
            ax.plot([u["time"]] * 2, [workers - 0.3, workers + 0.3], color=color, lw=2)
            if u["worker"] == slowest and u["staleness"]:
                ax.text(u["time"], workers + 0.45, str(u["staleness"]), ha="center", fontsize=SMALL)
        labels = [f"worker {w}" for w in reversed(range(workers))] + ["server"]
        ax.set_yticks(range(workers + 1), labels)
        ax.set_ylim(-0.6, workers + 1.0)
        ax.set_title(title, loc="left")
    axes[-1, 0].set_xlabel("time (units of one worker's gradient)")
    fig.tight_layout()
    return fig


def draw_pushes(runs: dict, workers: int, first_rank: int = 1):
    """Measured: one panel per run, a row per worker, a dot each time the server
    received that worker's gradient (the server's record of the run)."""
    fig, axes = subplots(len(runs), 1, 7.5, 0.9 + 1.1 * len(runs), sharex=True, squeeze=False)
    for ax, (title, updates) in zip(axes[:, 0], runs.items(), strict=True):
        for w in range(workers):
            times = [u["time"] for u in updates if u["worker"] == w]
            ax.plot(
                times,
                [workers - 1 - w] * len(times),
                "|",
                ms=9,
                mew=1.5,
                color=rank_color(w + first_rank),
            )
        ax.set_yticks(range(workers), [f"worker {w}" for w in reversed(range(workers))])
        ax.set_ylim(-0.7, workers - 0.3)
        ax.set_title(title, loc="left")
    axes[-1, 0].set_xlabel("seconds since the start (measured on this machine)")
    fig.tight_layout()
    return fig


def draw_losses(runs: dict):
    """Loss of each pushed gradient's batch, against gradients received (left) and
    against the time the server received it (right), one line per run."""
    fig, (left, right) = subplots(2, 1, PAGE_WIDTH, 6.4, sharey=True)
    for i, (label, updates) in enumerate(runs.items()):
        losses = [u["loss"] for u in updates]
        left.plot(range(1, len(losses) + 1), losses, color=rank_color(i), label=label, lw=1.3)
        right.plot([u["time"] for u in updates], losses, color=rank_color(i), label=label, lw=1.3)
    for ax in (left, right):
        ax.set_yscale("log")
    left.set_xlabel("gradients received by the server")
    right.set_xlabel("seconds (measured)")
    left.set_ylabel("loss of the batch (MSE)")
    left.legend(fontsize=SMALL)
    fig.tight_layout()
    return fig


def draw_staleness(runs: dict):
    """How many gradients arrived with each staleness, one group of bars per run."""
    fig, ax = figure(7.0, 3.0)
    largest = max(u["staleness"] for updates in runs.values() for u in updates)
    bins = np.arange(largest + 1)
    width = 0.8 / len(runs)
    for i, (label, updates) in enumerate(runs.items()):
        counts = np.bincount([u["staleness"] for u in updates], minlength=largest + 1)
        ax.bar(
            bins + (i - (len(runs) - 1) / 2) * width,
            counts,
            width,
            color=rank_color(i),
            label=label,
        )
    ax.set_xlabel("staleness: updates applied since the worker pulled its parameters")
    ax.set_ylabel("gradients")
    ax.set_xticks(bins)
    ax.legend(fontsize=SMALL)
    fig.tight_layout()
    return fig


def draw_server_traffic(workers, series: dict, link_bytes_per_s: float):
    """Bytes into the busiest rank per step against the number of workers (log-log),
    one line per design, with the seconds that takes on a link of the given speed on a
    second axis."""
    fig, ax = figure(0.85 * PAGE_WIDTH - 0.6, 4.0)  # the right axis's labels run past
    for i, (label, nbytes) in enumerate(series.items()):
        ax.loglog(workers, np.asarray(nbytes) / 1e9, "o-", ms=3, color=rank_color(i), label=label)
    ax.set_xlabel("workers")
    ax.set_ylabel("GB into the busiest rank, per step")
    seconds = ax.secondary_yaxis(
        "right",
        functions=(lambda gb: gb * 1e9 / link_bytes_per_s, lambda s: s * link_bytes_per_s / 1e9),
    )
    seconds.set_ylabel(f"seconds at {link_bytes_per_s / 1e9:.0f} GB/s")
    ax.legend(fontsize=SMALL, frameon=False, loc="upper left", bbox_to_anchor=(-0.2, -0.18))
    ax.grid(True, which="major", color="#eeeeee")
    fig.tight_layout()
    return fig


def sync_async_figure():
    """Chapter 9: three workers, worker 2 taking 2.5 times as long, simulated."""
    compute = [1.0, 1.0, 2.5]
    return draw_simulated(
        {
            "synchronous: every round waits for worker 2": simulate(compute, "sync", 10, 0.1),
            "asynchronous: each gradient applied as it arrives": simulate(
                compute, "async", 10, 0.1
            ),
        }
    )


def server_traffic_figure():
    """Chapter 9: bytes into the busiest rank per step, GPT-2 small's float32 gradient."""
    s = 4 * GPT2_SMALL_PARAMS
    workers = np.array([2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    series = {
        "one server: W·S": workers * s,
        "8 sharded servers: W·S/8": workers * s / 8,
        "ring all-reduce, no server: 2(W−1)/W·S": 2 * (workers - 1) / workers * s,
    }
    return draw_server_traffic(workers, series, link_bytes_per_s=50e9)

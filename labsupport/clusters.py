"""Lab 5, clusters: ping-pong measurements next to the alpha-beta model, and its predictions.

The measuring and fitting live in :mod:`labsupport.comm` (``measure_p2p``,
``fit_alpha_beta``, ``all_reduce_time``) and the datasheet numbers in
:mod:`labsupport.hardware`. This module holds what only lab 5 needs: tables and a plot of
measured against modelled times, the half-bandwidth message size of Hockney's model, a
two-level (rail) all-reduce estimate, and the exercises' checkers.

Reference: R. W. Hockney, "The communication challenge for MPP: Intel Paragon and Meiko
CS-2", Parallel Computing 20(3), 1994, for ``t = alpha + beta * n`` and ``n_1/2``.
"""

from __future__ import annotations

import math

import numpy as np

from labsupport import comm, hardware, plotting

ASSUMED_ALPHA = 5e-6
"""Seconds of latency per message assumed for the *modelled* clusters.

No datasheet gives it: it depends on the software (NCCL's protocol, kernel launches) as
much as on the wire. 5 microseconds is an order of magnitude, not a measurement; replace
it with what ``nccl-tests`` reports for small messages on your own cluster."""


def human_bytes(nbytes: float) -> str:
    """A size as people write it: ``1 GB``, ``350 GB`` (decimal), ``16 KiB``, ``1 MiB``.

    Exact multiples of a power of 1000 get decimal units (datasheets and model sizes use
    them), other exact multiples of a power of 1024 binary ones, anything else bytes.
    """
    n = int(nbytes)
    for base, units in ((1000, ("kB", "MB", "GB", "TB")), (1024, ("KiB", "MiB", "GiB", "TiB"))):
        for power in range(len(units), 0, -1):
            if n >= base**power and n % base**power == 0:
                return f"{n // base**power} {units[power - 1]}"
    return f"{n} B"


def p2p_rows(results: list[dict], alpha: float | None = None, beta: float | None = None):
    """Rows for :func:`labsupport.notebook.format_table`: size, time, bandwidth (and model).

    Times are one-way (half a round trip), in microseconds; bandwidth is bytes over
    one-way time, in GB/s (10^9 bytes/s).
    """
    rows = []
    for r in results:
        row = {
            "size": human_bytes(r["bytes"]),
            "time (µs)": f"{r['seconds'] * 1e6:.1f}",
            "bandwidth (GB/s)": f"{r['bytes'] / r['seconds'] / 1e9:.3f}",
        }
        if alpha is not None:
            model = float(comm.p2p_time(r["bytes"], alpha, beta))
            row["model (µs)"] = f"{model * 1e6:.1f}"
            row["measured / model"] = f"{r['seconds'] / model:.2f}"
        rows.append(row)
    return rows


def half_bandwidth_size(alpha: float, beta: float) -> float:
    """Hockney's ``n_1/2``: the message size that reaches half the peak bandwidth.

    The effective bandwidth of an ``n``-byte message is ``n / (alpha + beta * n)``; it is
    half of ``1 / beta`` when ``beta * n = alpha``, that is at ``n = alpha / beta``.
    Smaller messages are latency-bound, larger ones bandwidth-bound.
    """
    return alpha / beta


def plot_fit(results: list[dict], alpha: float, beta: float, ax=None, title: str | None = None):
    """Measured one-way times against ``alpha + beta * n`` on log-log axes.

    Marks the two asymptotes (``alpha`` alone, ``beta * n`` alone) and where they cross,
    at :func:`half_bandwidth_size`.
    """
    if ax is None:
        _, ax = plotting.figure(7.0, 3.6)
    sizes = np.array([r["bytes"] for r in results], dtype=float)
    times = np.array([r["seconds"] for r in results])
    grid = np.geomspace(sizes.min(), sizes.max(), 200)
    ax.plot(
        grid,
        comm.p2p_time(grid, alpha, beta) * 1e6,
        color="black",
        lw=1.5,
        label=f"model: α + βn  (α = {alpha * 1e6:.1f} µs, 1/β = {1 / beta / 1e9:.2f} GB/s)",
    )
    ax.plot(
        grid,
        np.full_like(grid, alpha * 1e6),
        color="#777777",
        ls=":",
        lw=1,
        label="α alone (latency)",
    )
    ax.plot(grid, beta * grid * 1e6, color="#777777", ls="--", lw=1, label="βn alone (bandwidth)")
    ax.plot(
        sizes,
        times * 1e6,
        "o",
        color=plotting.rank_color(0),
        ms=6,
        label="measured, rank 0 ↔ rank 1",
    )
    n_half = half_bandwidth_size(alpha, beta)
    if sizes.min() < n_half < sizes.max():
        ax.axvline(n_half, color="#bbbbbb", lw=1)
        ax.annotate(
            f"n½ = α/β ≈ {n_half / 1024:.0f} KiB",
            (n_half, alpha * 1e6 * 0.55),
            xytext=(6, 0),
            textcoords="offset points",
            fontsize=9,
            color="#555555",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = [s for s in sizes if math.log2(s) % 4 == 0]
    ax.set_xticks(ticks, [human_bytes(s) for s in ticks])
    ax.set_ylim(
        alpha * 1e6 * 0.3, max(times.max(), float(comm.p2p_time(sizes.max(), alpha, beta))) * 3e6
    )
    ax.set_xlabel("message size n")
    ax.set_ylabel("one-way time (µs)")
    ax.legend(fontsize=8, loc="upper left", frameon=False)
    ax.set_title(title or "Ping-pong: measured against the α-β model")
    return ax


def hierarchical_all_reduce_time(
    nbytes, nodes: int, gpus_per_node: int, alpha: float, beta_intra: float, beta_inter: float
):
    """Predicted all-reduce time on ``nodes`` x ``gpus_per_node`` GPUs, in two levels.

    1. Inside each node, a ring reduce-scatter: GPU ``g`` ends up with the node's sum of
       shard ``g`` (``1 / gpus_per_node`` of the data).
    2. Across nodes, GPU ``g`` of every node all-reduces shard ``g`` over its own NIC, in
       a ring of ``nodes`` ranks: one ring per *rail*, all rails at once.
    3. Inside each node, a ring all-gather brings the full result to every GPU.

    Steps 1 and 3 together cost exactly one ring all-reduce inside the node.
    """
    inside = comm.all_reduce_time("ring", gpus_per_node, nbytes, alpha, beta_intra)
    across = comm.all_reduce_time(
        "ring", nodes, np.asarray(nbytes) / gpus_per_node, alpha, beta_inter
    )
    return inside + across


# --------------------------------------------------------------------------- exercises


def check_bytes_per_second(fn) -> None:
    """Exercise 1: ``fn(value, unit)`` must give bytes per second in one direction."""
    cases = [
        (400, "Gb/s"), (100, "Gb/s"), (800, "Gb/s"),
        (900, "GB/s bidirectional"), (1800, "GB/s bidirectional"), (64, "GB/s bidirectional"),
        (50, "GB/s"), (12.5, "GB/s"),
    ]  # fmt: skip
    for value, unit in cases:
        got, want = fn(value, unit), hardware.per_direction(value, unit)
        hint = ""
        if unit == "Gb/s" and math.isclose(got, value * 1e9):
            hint = " (Gb/s counts bits: 8 bits make a byte)"
        elif unit == "GB/s bidirectional" and math.isclose(got, value * 1e9):
            hint = " (a bidirectional total counts both directions; one message uses one)"
        elif math.isclose(got, want / 1e9):
            hint = " (the answer is in bytes per second, not GB/s)"
        assert math.isclose(got, want, rel_tol=1e-9), (
            f"{value} {unit}: got {got!r} bytes/s, expected {want:.4g}{hint}"
        )
    print("Correct: 400 Gb/s = 50 GB/s per direction; NVLink's 900 GB/s = 450 GB/s each way.")


def check_min_bucket_bytes(fn) -> None:
    """Exercise 2: ``fn(world_size, alpha, beta, latency_share)``, the smallest bucket.

    Checked against the model itself: at the returned size, the latency part of
    :func:`labsupport.comm.all_reduce_time` (ring) must be exactly ``latency_share`` of
    the total, and it must be more for any smaller bucket.
    """
    ndr = hardware.beta("InfiniBand NDR")
    cases = [
        (64, ASSUMED_ALPHA, ndr, 0.1),
        (8, 1e-6, 1 / 450e9, 0.5),
        (2, 50e-6, 1 / 4e9, 0.01),
        (512, ASSUMED_ALPHA, ndr, 0.25),
    ]
    for world, alpha, beta, share in cases:
        size = float(fn(world, alpha, beta, share))
        label = f"world_size={world}, alpha={alpha:g} s, beta={beta:g} s/B, share={share}"
        assert size > 0, f"{label}: got {size!r}, a bucket size must be positive"

        def latency_share(s, world=world, alpha=alpha, beta=beta):
            latency = comm.all_reduce_time("ring", world, s, alpha, 0.0)
            return float(latency / comm.all_reduce_time("ring", world, s, alpha, beta))

        got = latency_share(size)
        assert math.isclose(got, share, rel_tol=1e-6), (
            f"{label}: at {size:.6g} bytes the latency part is {got:.4%} of the all-reduce, "
            f"not {share:.0%} (latency part 2(N-1)α, bandwidth part 2(N-1)/N·n·β)"
        )
        assert latency_share(0.99 * size) > share, f"{label}: a smaller bucket also qualifies"
    print("Correct: n = N·α·(1 - f) / (f·β); below it, latency takes more than f of the time.")


def check_hierarchical_all_reduce(fn) -> None:
    """Exercise 3: ``fn(nbytes, nodes, gpus_per_node, alpha, beta_intra, beta_inter)``."""
    nvlink, ndr = hardware.beta("NVLink 4 (H100)"), hardware.beta("InfiniBand NDR")
    cases = [
        (10**9, 64, 8, ASSUMED_ALPHA, nvlink, ndr),
        (350 * 10**9, 64, 8, ASSUMED_ALPHA, nvlink, ndr),
        (2**20, 2, 4, 1e-5, 1e-11, 1e-10),
        (10**9, 1, 8, ASSUMED_ALPHA, nvlink, ndr),
        (10**9, 16, 1, ASSUMED_ALPHA, nvlink, ndr),
    ]
    for case in cases:
        got, want = float(fn(*case)), float(hierarchical_all_reduce_time(*case))
        assert math.isclose(got, want, rel_tol=1e-9), (
            f"nbytes={case[0]:g}, nodes={case[1]}, gpus_per_node={case[2]}: got {got:.6g} s, "
            f"expected {want:.6g} s"
        )
    print("Correct: a ring all-reduce inside the node plus one ring per rail across nodes.")

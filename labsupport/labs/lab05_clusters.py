"""Lab 5, clusters: ping-pong measurements next to the alpha-beta model, and the
exercises' checkers.

The measuring is in :mod:`labsupport.comm.measure`, the model and its predictions in
:mod:`labsupport.comm.cost`, the datasheet numbers in
:mod:`labsupport.estimate.datasheets`, the drawings in :mod:`labsupport.viz.clusters`.
"""

from __future__ import annotations

import math

from labsupport.comm.cost import all_reduce_time, hierarchical_all_reduce_time, p2p_time
from labsupport.estimate import datasheets
from labsupport.estimate.units import format_bytes
from labsupport.labs.cells import exercise


def p2p_rows(results: list[dict], alpha: float | None = None, beta: float | None = None):
    """Rows for :func:`labsupport.labs.cells.format_table`: size, time, bandwidth (and model).

    Times are one-way (half a round trip), in microseconds; bandwidth is bytes over
    one-way time, in GB/s (10^9 bytes/s).
    """
    rows = []
    for r in results:
        row = {
            "size": format_bytes(r["bytes"], "auto"),
            "time (µs)": f"{r['seconds'] * 1e6:.1f}",
            "bandwidth (GB/s)": f"{r['bytes'] / r['seconds'] / 1e9:.3f}",
        }
        if alpha is not None:
            model = float(p2p_time(r["bytes"], alpha, beta))
            row["model (µs)"] = f"{model * 1e6:.1f}"
            row["measured / model"] = f"{r['seconds'] / model:.2f}"
        rows.append(row)
    return rows


def link_rows() -> list[dict]:
    """Rows for :func:`labsupport.labs.cells.format_table`: each datasheet link, what its
    datasheet says, and the bytes per second in one direction the model uses."""
    return [
        {
            "link": link["name"],
            "datasheet says": link["datasheet"],
            "GB/s per direction": f"{link['gb_per_s']:.1f}",
        }
        for link in datasheets.LINKS.values()
    ]


# --------------------------------------------------------------------------- exercises


def _close(a: float, b: float) -> bool:
    """Equal up to the order of the operations: the answers are float64 formulas of a
    dozen operations or fewer, each off by at most 2^-53 relative (1.1e-16), so two ways
    of writing one differ by about 1e-15; every mistake the checkers name is off by 1e-3
    or more. 1e-9 lies far from both."""
    return math.isclose(a, b, rel_tol=1e-9)


@exercise
def check_bytes_per_second(fn) -> str:
    """Exercise 1: ``fn(value, unit)`` must give bytes per second in one direction."""
    cases = [
        (400, "Gb/s"),
        (100, "Gb/s"),
        (800, "Gb/s"),
        (900, "GB/s bidirectional"),
        (1800, "GB/s bidirectional"),
        (64, "GB/s bidirectional"),
        (50, "GB/s"),
        (12.5, "GB/s"),
    ]
    for value, unit in cases:
        got, want = float(fn(value, unit)), datasheets.per_direction(value, unit)
        if _close(got, want):
            continue
        hint = "check the prefix (giga = 10^9) and whether the figure counts bits or bytes"
        if _close(got, want / 1e9):
            hint = "the answer is in bytes per second, not GB/s"
        elif unit == "Gb/s" and _close(got, value * 1e9):
            hint = "Gb/s counts bits: 8 bits make a byte"
        elif unit == "Gb/s" and _close(got, value * 1e9 / 16):
            hint = "a port's Gb/s is already per direction"
        elif unit == "GB/s bidirectional" and _close(got, value * 1e9):
            hint = "a bidirectional total counts both directions; one message uses one"
        elif unit != "Gb/s" and _close(got, value * 1e9 / 8):
            hint = "GB/s, with a capital B, is already bytes"
        raise AssertionError(f"{value} {unit}: got {got:.6g} bytes/s; {hint}")
    return "8 datasheet figures in Gb/s, GB/s and bidirectional GB/s, in bytes/s each way"


@exercise
def check_min_bucket_bytes(fn) -> str:
    """Exercise 2: ``fn(world_size, alpha, beta, latency_share)``, the smallest bucket.

    Checked against the model itself: at the returned size, the latency part of
    :func:`labsupport.comm.cost.all_reduce_time` (ring) must be exactly ``latency_share`` of
    the total, and it must be more for any smaller bucket.
    """
    ndr = datasheets.beta("InfiniBand NDR")
    cases = [
        (64, datasheets.ASSUMED_ALPHA, ndr, 0.1),
        (8, 1e-6, 1 / 450e9, 0.5),
        (2, 50e-6, 1 / 4e9, 0.01),
        (512, datasheets.ASSUMED_ALPHA, ndr, 0.25),
    ]
    for world, alpha, beta, share in cases:
        size = float(fn(world, alpha, beta, share))
        label = f"world_size={world}, alpha={alpha:g} s, beta={beta:g} s/B, share={share}"
        assert size > 0, f"{label}: got {size!r}, a bucket size must be positive"

        def latency_share(s, world=world, alpha=alpha, beta=beta):
            latency = all_reduce_time("ring", world, s, alpha, 0.0)
            return float(latency / all_reduce_time("ring", world, s, alpha, beta))

        got = latency_share(size)
        # float64 throughout: the share at an exact answer is off by about 1e-15; the
        # smallest slip checked (a factor 1 - f or N) moves it by about a percent or more
        assert math.isclose(got, share, rel_tol=1e-6), (
            f"{label}: at {size:.6g} bytes the latency part is {got:.4%} of the all-reduce, "
            f"not {share:.0%} (latency part 2(N-1)α, bandwidth part 2(N-1)/N·n·β)"
        )
        assert latency_share(0.99 * size) > share, f"{label}: a smaller bucket also qualifies"
    return "the size at which latency is the asked share of a ring all-reduce, on 2 to 512 ranks"


@exercise
def check_hierarchical_all_reduce(fn) -> str:
    """Exercise 3: ``fn(nbytes, nodes, gpus_per_node, alpha, beta_intra, beta_inter)``.

    First on links of unlimited bandwidth (both betas 0), where only the latencies of
    the steps remain, the algorithm's gain over a flat ring; then on five clusters.
    """
    alpha = datasheets.ASSUMED_ALPHA
    steps = float(fn(10**9, 64, 8, alpha, 0.0, 0.0)) / alpha
    if not _close(steps, float(hierarchical_all_reduce_time(10**9, 64, 8, alpha, 0, 0)) / alpha):
        hint = "count the steps of each of the three phases"
        if _close(steps, 2 * (64 * 8 - 1)):
            hint = "that is the step count of a flat ring through all 512 GPUs"
        elif _close(steps, 2 * (64 - 1)) or _close(steps, 2 * (8 - 1)):
            hint = "the steps inside the nodes and the steps across them add up"
        raise AssertionError(
            f"64 nodes x 8 GPUs, infinitely fast links: your time is {steps:g} latencies "
            f"(alpha each); {hint}"
        )
    nvlink, ndr = datasheets.beta("NVLink 4 (H100)"), datasheets.beta("InfiniBand NDR")
    cases = [
        (10**9, 64, 8, alpha, nvlink, ndr),
        (350 * 10**9, 64, 8, alpha, nvlink, ndr),
        (2**20, 2, 4, 1e-5, 1e-11, 1e-10),
        (10**9, 1, 8, alpha, nvlink, ndr),
        (10**9, 16, 1, alpha, nvlink, ndr),
    ]
    for nbytes, nodes, gpus, alpha, intra, inter in cases:
        got = float(fn(nbytes, nodes, gpus, alpha, intra, inter))

        def two_level(inside_beta, across_beta, case=(nbytes, nodes, gpus, alpha)):
            return float(hierarchical_all_reduce_time(*case, inside_beta, across_beta))

        if _close(got, two_level(intra, inter)):
            continue
        inside = float(all_reduce_time("ring", gpus, nbytes, alpha, intra))
        hint = "compare your sum with the three steps of the statement"
        if _close(got, inside + float(all_reduce_time("ring", nodes, nbytes, alpha, inter))):
            hint = "each rail carries one shard across the nodes, not the whole tensor"
        elif _close(got, two_level(inter, intra)):
            hint = "NVLink carries the steps inside a node, the network the step across"
        raise AssertionError(
            f"nbytes={nbytes:g}, nodes={nodes}, gpus_per_node={gpus}: got {got:.6g} s; {hint}"
        )
    return (
        "the steps of a two-level all-reduce on 512 GPUs, and its time on 5 clusters, "
        "one node and one GPU per node included"
    )

"""The alpha-beta model of communication, and the cost of each collective in it.

The alpha-beta (Hockney) model says a message of ``n`` bytes takes ``alpha + beta * n``
seconds: ``alpha`` is the latency every message pays, ``1 / beta`` the bandwidth. The
collective costs below are the standard ones for a single-port network, in which a rank
sends one message and receives one at a time (Thakur, Rabenseifner and Gropp 2005;
Patarasuk and Yuan 2009 for the ring). They are what chapter 8's measurements are
compared with (:mod:`labsupport.comm.measure` measures).

Reference: R. W. Hockney, "The communication challenge for MPP: Intel Paragon and Meiko
CS-2", Parallel Computing 20(3), 1994, for ``t = alpha + beta * n`` and ``n_1/2``.
"""

from __future__ import annotations

import math

try:
    import numpy as np
except ModuleNotFoundError:  # the website's Pyodide has no numpy: plain numbers only
    np = None


def fit_alpha_beta(nbytes, seconds) -> tuple[float, float]:
    """Least-squares fit of ``seconds = alpha + beta * nbytes``; returns ``(alpha, beta)``.

    Small messages pin down alpha and large ones beta, but their times differ by orders
    of magnitude, so the fit minimises *relative* errors (each point weighted by
    1/time): otherwise the largest message alone would decide alpha.
    """
    x = np.asarray(nbytes, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError("fit_alpha_beta needs two equally long lists of at least 2 points")
    if np.any(y <= 0) or np.any(x < 0) or len(set(x)) < 2:
        raise ValueError("times must be positive and there must be at least 2 distinct sizes")
    weights = 1.0 / y
    design = np.stack([np.ones_like(x), x], axis=1) * weights[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, y * weights, rcond=None)
    return float(alpha), float(beta)


def p2p_time(nbytes, alpha: float, beta: float):
    """The alpha-beta model's time for one message of ``nbytes``."""
    return alpha + beta * np.asarray(nbytes, dtype=float)


def all_reduce_time(algorithm: str, world_size: int, nbytes, alpha: float, beta: float):
    """Predicted all-reduce time of ``nbytes`` on ``world_size`` ranks (single-port model).

    ring, halving_doubling: 2(N-1) (resp. 2 log2 N) steps; both send 2(N-1)/N of the data.
    ps (sharded parameter server): each rank pushes and pulls N-1 shards of S/N.
    naive: rank 0 receives N-1 whole tensors, then sends N-1 back, one at a time.
    tree: binomial reduce then broadcast, 2 ceil(log2 N) steps of the whole tensor.

    ``nbytes`` may be an array (a curve); without numpy (the website's calculators, in
    Pyodide) it must be a number, and so is the result.
    """
    n = world_size
    s = float(nbytes) if np is None else np.asarray(nbytes, dtype=float)
    if n == 1:
        return 0.0 if np is None else np.zeros_like(s)
    log_n = math.ceil(math.log2(n))
    if algorithm in ("ring", "ps"):
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * s * beta
    if algorithm == "halving_doubling":
        return 2 * log_n * alpha + 2 * (n - 1) / n * s * beta
    if algorithm == "naive":
        return 2 * (n - 1) * (alpha + s * beta)
    if algorithm == "tree":
        return 2 * log_n * (alpha + s * beta)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def bus_bandwidth(nbytes, seconds, world_size: int):
    """nccl-tests' bus bandwidth of an all-reduce: algbw x 2(N-1)/N, in bytes/s.

    Algorithm bandwidth is ``nbytes / seconds``; the factor makes the number comparable
    with the link speed, since a bandwidth-optimal all-reduce moves 2(N-1)/N of the
    data over each rank's link. See nccl-tests, doc/PERFORMANCE.md.
    """
    algbw = np.asarray(nbytes, dtype=float) / np.asarray(seconds, dtype=float)
    return algbw * 2 * (world_size - 1) / world_size


def ring_all_reduce_bytes(nbytes, world_size: int):
    """Bytes each rank sends in a bandwidth-optimal (ring) all-reduce: 2(N-1)/N · S.

    Patarasuk and Yuan 2009. :func:`labsupport.comm.allreduce.bytes_sent` gives the
    exact count of the course's ring, chunk by chunk, for sizes that do not divide.
    """
    return 2 * (world_size - 1) / world_size * np.asarray(nbytes, dtype=float)


def half_bandwidth_size(alpha: float, beta: float) -> float:
    """Hockney's ``n_1/2``: the message size that reaches half the peak bandwidth.

    The effective bandwidth of an ``n``-byte message is ``n / (alpha + beta * n)``; it is
    half of ``1 / beta`` when ``beta * n = alpha``, that is at ``n = alpha / beta``.
    Smaller messages are latency-bound, larger ones bandwidth-bound.
    """
    return alpha / beta


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
    inside = all_reduce_time("ring", gpus_per_node, nbytes, alpha, beta_intra)
    across = all_reduce_time("ring", nodes, np.asarray(nbytes) / gpus_per_node, alpha, beta_inter)
    return inside + across

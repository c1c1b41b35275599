"""Measuring communication, and the alpha-beta model that predicts it.

The alpha-beta (Hockney) model says a message of ``n`` bytes takes ``alpha + beta * n``
seconds: ``alpha`` is the latency every message pays, ``1 / beta`` the bandwidth. The
collective costs below are the standard ones for a single-port network, in which a rank
sends one message and receives one at a time (Thakur, Rabenseifner and Gropp 2005;
Patarasuk and Yuan 2009 for the ring). They are what chapter 8's measurements are
compared with.
"""

from __future__ import annotations

import math
import random
import time

import numpy as np
import torch
import torch.distributed as dist

from labsupport.runtime import device

DEFAULT_SIZES = tuple(2**k for k in range(2, 25, 2))  # 4 B ... 16 MiB


def measure_p2p(sizes=DEFAULT_SIZES, rounds: int = 20, warmup: int = 3) -> list[dict] | None:
    """Ping-pong between ranks 0 and 1 for each message size (run on every rank).

    Rank 0 sends ``n`` bytes to rank 1, which sends them back. Each round visits every
    size once, ``rounds`` times after ``warmup`` untimed rounds: a burst of load on a
    shared machine then lands on a few rounds of every size, which the median discards,
    rather than on every round of a few sizes; the order of the sizes changes from
    round to round, so that no size always follows the largest one. Returns, on rank 0,
    one dict per size with ``bytes`` and ``seconds``, the median one-way time (half a
    round trip); ``None`` on the other ranks, which take no part.
    """
    if dist.get_world_size() < 2:
        raise ValueError("measure_p2p needs at least 2 ranks (world_size >= 2)")
    for size in sizes:
        if size % 4:
            raise ValueError(f"message sizes must be multiples of 4 bytes (float32), got {size}")
    rank = dist.get_rank()
    buffers = [torch.zeros(size // 4, dtype=torch.float32, device=device()) for size in sizes]
    times = [[] for _ in sizes]
    for i in range(warmup + rounds):
        order = list(range(len(sizes)))
        random.Random(i).shuffle(order)  # the same order on both ranks, a new one each round
        for index in order:
            buffer, series = buffers[index], times[index]
            start = time.perf_counter()
            if rank == 0:
                dist.send(buffer, dst=1)
                dist.recv(buffer, src=1)
            elif rank == 1:
                dist.recv(buffer, src=0)
                dist.send(buffer, dst=0)
            if buffer.is_cuda:  # NCCL returns before the transfer ends: wait for it
                torch.cuda.synchronize()
            if i >= warmup:
                series.append(time.perf_counter() - start)
    results = [
        {"bytes": size, "seconds": float(np.median(series)) / 2}
        for size, series in zip(sizes, times, strict=True)
    ]
    return results if rank == 0 else None


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
    """
    n, s = world_size, np.asarray(nbytes, dtype=float)
    if n == 1:
        return np.zeros_like(s)
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


def time_all_reduce(sizes, algorithm: str = "ring", repeats: int = 5) -> list[dict] | None:
    """Median time of an all-reduce of each size in bytes (run on every rank).

    ``algorithm`` is one of ``labsupport.collectives.ALGORITHMS`` or ``"torch"`` for
    ``torch.distributed.all_reduce``. Every repetition starts after a barrier, and the
    slowest rank's time counts (an all-reduce is done when every rank has the result).
    Returns on rank 0 one dict per size with ``bytes`` and ``seconds``; ``None`` elsewhere.
    """
    from labsupport import collectives

    results = []
    for size in sizes:
        tensor = torch.ones(max(1, size // 4), dtype=torch.float32, device=device())
        times = []
        for i in range(repeats + 1):  # the first run warms up buffers and connections
            dist.barrier()
            start = time.perf_counter()
            if algorithm == "torch":
                dist.all_reduce(tensor)
            else:
                collectives.all_reduce(tensor, algorithm=algorithm)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i:
                times.append(elapsed.item())
        results.append({"bytes": size, "seconds": float(np.median(times))})
    return results if dist.get_rank() == 0 else None


def check_ring_bytes(fn) -> None:
    """Exercise (lab 8): ``fn(nbytes, world_size)`` must give the bytes each rank sends
    in a ring all-reduce of ``nbytes``, for sizes that divide by the world size."""
    for world in (2, 3, 4, 8, 64):
        for nbytes in (world * 4, world * 4096, world * 10**6):
            got, want = fn(nbytes, world), 2 * (world - 1) * nbytes // world
            assert got == want, f"nbytes={nbytes}, world_size={world}: got {got}, expected {want}"
    print("Correct: 2 (N-1)/N x S, whatever the number of ranks.")


def check_ring_time(fn) -> None:
    """Exercise (lab 8): ``fn(nbytes, world_size, alpha, beta)`` must give the alpha-beta
    time of a ring all-reduce."""
    for world in (2, 8, 1024):
        for nbytes in (4, 2**20, 2**30):
            got = fn(nbytes, world, 1e-5, 1e-10)
            want = float(all_reduce_time("ring", world, nbytes, 1e-5, 1e-10))
            assert abs(got - want) <= 1e-9 * want, (
                f"nbytes={nbytes}, world_size={world}: got {got:.6g} s, expected {want:.6g} s"
            )
    print("Correct: 2 (N-1) alpha + 2 (N-1)/N S beta.")

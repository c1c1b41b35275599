"""Measuring communication: ping-pong between two ranks, and all-reduce times.

Both run on every rank of a launch and return their results on rank 0. Timings on a
GPU wait for the device (:func:`labsupport.launch.synchronize`) before reading the
clock: NCCL returns before the transfer ends.
"""

from __future__ import annotations

import random
import time

import numpy as np
import torch
import torch.distributed as dist

from labsupport.comm import allreduce
from labsupport.launch.runtime import device, synchronize

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
            synchronize()
            if i >= warmup:
                series.append(time.perf_counter() - start)
    results = [
        {"bytes": size, "seconds": float(np.median(series)) / 2}
        for size, series in zip(sizes, times, strict=True)
    ]
    return results if rank == 0 else None


def time_all_reduce(sizes, algorithm: str = "ring", repeats: int = 5) -> list[dict] | None:
    """Median time of an all-reduce of each size in bytes (run on every rank).

    ``algorithm`` is one of ``labsupport.comm.allreduce.ALGORITHMS`` or ``"torch"`` for
    ``torch.distributed.all_reduce``. Every repetition starts after a barrier, and the
    slowest rank's time counts (an all-reduce is done when every rank has the result).
    Returns on rank 0 one dict per size with ``bytes`` and ``seconds``; ``None`` elsewhere.
    """
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
                allreduce.all_reduce(tensor, algorithm=algorithm)
            synchronize()
            elapsed = torch.tensor([time.perf_counter() - start], device=device())
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i:
                times.append(elapsed.item())
        results.append({"bytes": size, "seconds": float(np.median(times))})
    return results if dist.get_rank() == 0 else None

"""Timing on a shared machine: one kernel, and several functions side by side.

Two rules make a timing worth printing. On a GPU, kernels return before they finish:
every sample waits for the device (:func:`labsupport.launch.synchronize`) before the
clock is read. On a shared machine, another program can slow any sample down, never
speed it up: a single time says little, a *ratio* of two functions timed in turns,
round after round, says much more, because a burst of load lands on both alike. The
labs assert only such ratios, with wide margins, and print raw times without asserting.
"""

from __future__ import annotations

import math
import statistics
import time

from labsupport.launch.runtime import synchronize


def time_op(
    fn, device="cpu", repeats: int = 5, min_sample_s: float = 2e-3, best: bool = False
) -> float:
    """Median (or, with ``best``, shortest) seconds per call of ``fn()`` on ``device``.

    A sample runs ``fn`` often enough to last at least ``min_sample_s``, so that the
    timer's resolution and the launch cost of a tiny kernel do not dominate. It warms
    up with one call first (memory allocation, caches, lazy initialization). The median
    of ``repeats`` samples is robust to a sample slowed down by another program; the
    shortest (``best=True``, as STREAM reports) estimates what the hardware can do,
    since interference only ever makes a sample slower.
    """
    inner = _calls_per_sample(fn, device, min_sample_s)
    samples = [_sample(fn, device, inner) for _ in range(repeats)]
    return min(samples) if best else statistics.median(samples)


def side_by_side(fns: dict, rounds: int = 7, device="cpu", min_sample_s: float = 2e-3) -> dict:
    """Time several functions in turns: each round takes one sample of each of ``fns``.

    ``fns`` maps a name to a function of no arguments. Returns, per name, the median
    seconds per call, and, under ``"ratio"``, each name's median over the rounds of
    *its time divided by the first function's time in the same round*: the number to
    assert on, since both sides of each ratio ran under the same load. The order within
    a round rotates, so that no function always runs right after another.
    """
    names = list(fns)
    inner = {name: _calls_per_sample(fns[name], device, min_sample_s) for name in names}
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(_sample(fns[name], device, inner[name]))
    first = samples[names[0]]
    result = {name: statistics.median(s) for name, s in samples.items()}
    result["ratio"] = {
        name: statistics.median(a / b for a, b in zip(s, first, strict=True))
        for name, s in samples.items()
    }
    return result


def _calls_per_sample(fn, device, min_sample_s: float) -> int:
    """Warm ``fn`` up with one call, time a second, and return how many calls make a
    sample of at least ``min_sample_s`` (at most 10,000)."""
    fn()
    once = _sample(fn, device, 1)
    return max(1, min(10_000, math.ceil(min_sample_s / max(once, 1e-9))))


def _sample(fn, device, inner: int) -> float:
    """Seconds per call of ``inner`` calls of ``fn``, the device synchronised around them."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / inner

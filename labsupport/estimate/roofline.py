"""The roofline model: FLOPs and bytes of a kernel, and the FLOP/s it can reach.

A kernel (one operation on a device: a copy, an addition, a matrix multiply) is limited
either by how fast the device computes (FLOP/s) or by how fast it moves bytes to and
from memory (bytes/s). :func:`kernel_cost` counts a kernel's FLOPs and bytes from its
definition, so its *arithmetic intensity* is computed, not guessed; :func:`roofline`
gives what it can reach: ``min(peak, bandwidth x intensity)``.

References: S. Williams, A. Waterman and D. Patterson, "Roofline: an insightful visual
performance model for multicore architectures", Communications of the ACM 52(4), 2009;
J. D. McCalpin, "Memory bandwidth and machine balance in current high performance
computers", IEEE TCCA Newsletter, December 1995 (the STREAM benchmark, whose *copy*
counts two bytes moved per byte copied, as :func:`kernel_cost` does).
"""

from __future__ import annotations

import numpy as np


def kernel_cost(
    kind: str, *, numel: int = 0, m: int = 0, k: int = 0, n: int = 0, itemsize: int = 4
) -> dict:
    """FLOPs and bytes of memory traffic of one kernel, counted from its definition.

    * ``"copy"``, ``dst = src`` of ``numel`` elements: 0 FLOPs; reads ``numel`` and writes
      ``numel`` elements, ``2 * numel * itemsize`` bytes (8 per fp32 element);
    * ``"add"``, ``c = a + b`` elementwise: ``numel`` FLOPs; reads two, writes one,
      ``3 * numel * itemsize`` bytes (12 per fp32 element);
    * ``"matmul"``, ``C (m x n) = A (m x k) @ B (k x n)``: ``2 * m * n * k`` FLOPs (a
      multiply and an add per term of each of the ``m * n`` sums); reads A and B and
      writes C once, ``itemsize * (m*k + k*n + m*n)`` bytes.

    The byte counts are the minimum traffic to and from main memory, the convention of
    the roofline model: each input read once, each output written once. Caches that
    are too small, or a CPU's write-allocate (reading a line before writing it), make a
    real kernel move more; on-chip reuse is what lets a matmul get close to this count.
    """
    if kind == "copy":
        flops, nbytes = 0, 2 * numel * itemsize
    elif kind == "add":
        flops, nbytes = numel, 3 * numel * itemsize
    elif kind == "matmul":
        flops, nbytes = 2 * m * n * k, itemsize * (m * k + k * n + m * n)
    else:
        raise ValueError(f"unknown kernel {kind!r}: use 'copy', 'add' or 'matmul'")
    return {"flops": flops, "bytes": nbytes}


def arithmetic_intensity(kind: str, **shape) -> float:
    """FLOPs per byte of memory traffic of a kernel (see :func:`kernel_cost`).

    A copy has intensity 0, an fp32 addition 1/12, a square fp32 matmul of side ``n``
    ``2n^3 / (12 n^2) = n / 6``: it grows with the size, because each element read is
    used ``n`` times.
    """
    cost = kernel_cost(kind, **shape)
    return cost["flops"] / cost["bytes"]


def roofline(peak_flops, bandwidth, intensity):
    """The roofline model: the FLOP/s a kernel of ``intensity`` (FLOP/byte) can reach.

    A kernel needs ``flops / peak_flops`` seconds to compute and ``bytes / bandwidth``
    seconds to move its data; at best the two overlap, so it runs at
    ``min(peak_flops, bandwidth * intensity)`` FLOP/s (Williams, Waterman and Patterson,
    2009). Works on numbers and on numpy arrays of intensities.
    """
    return np.minimum(peak_flops, np.multiply(bandwidth, intensity))


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """The intensity (FLOP/byte) where the two roofs meet: ``peak_flops / bandwidth``.

    Kernels below it are memory-bound, kernels above it compute-bound.
    """
    return peak_flops / bandwidth


def predicted_seconds(flops: float, nbytes: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline's time for a kernel: the longer of computing and moving its data."""
    return max(flops / peak_flops, nbytes / bandwidth)

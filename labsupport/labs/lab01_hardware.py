"""Lab 1, hardware: the datasheet table, two ranks sharing memory bandwidth, exercises.

The probes are in :mod:`labsupport.measure.probe`, the roofline model in
:mod:`labsupport.estimate.roofline`, the datasheets in
:mod:`labsupport.estimate.datasheets`, the drawings in :mod:`labsupport.viz.roofline`.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

from labsupport.estimate.datasheets import DEVICES, device_spec
from labsupport.estimate.roofline import (
    arithmetic_intensity,
    kernel_cost,
    predicted_seconds,
    ridge_point,
    roofline,
)
from labsupport.estimate.units import GB, TFLOPS, MiB


def datasheet_rows() -> list[dict]:
    """Rows for :func:`labsupport.labs.cells.format_table`: peaks, bandwidth, ridge points."""
    rows = []
    for e in DEVICES.values():
        tensor = e["tensor"]
        rows.append(
            {
                "device": e["name"],
                "memory": e["memory"],
                "GB/s": f"{e['bandwidth'] / GB:,.0f}" if e["bandwidth"] >= 100 * GB
                else f"{e['bandwidth'] / GB:.1f}",
                "FP32 TFLOP/s": f"{e['fp32'] / TFLOPS:g}",
                "ridge FP32": f"{ridge_point(e['fp32'], e['bandwidth']):.1f}",
                "16-bit tensor TFLOP/s": "-" if tensor is None
                else f"{tensor / TFLOPS:g} ({e['tensor_precision']})",
                "ridge 16-bit": "-" if tensor is None
                else f"{ridge_point(tensor, e['bandwidth']):.0f}",
            }
        )  # fmt: skip
    return rows


def shared_copy_bandwidth(nbytes: int = 256 * MiB, rounds: int = 5, threads: int = 1) -> dict:
    """Run under :func:`labsupport.launch`: each rank's copy bandwidth, alone and together.

    Every round, each rank in turn copies its ``nbytes`` while the others wait at a
    barrier (*alone*), then all ranks copy at the same moment (*together*). Alternating
    the two within one run means a burst of load from another program affects both
    alike. Returns this rank's median bandwidth (bytes/s, 2 bytes moved per byte copied)
    in each case.

    The buffers are CPU tensors in the machine's RAM whatever the backend: the point is
    the memory that the ranks of one node share (GPUs each have their own). Each rank
    uses ``threads`` threads, 1 by default, so that two ranks do not compete for cores
    on a 2-core machine; what they compete for is the memory system.
    """
    torch.set_num_threads(threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = nbytes // 4
    src = torch.ones(numel)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages before timing

    def timed_copy():
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start

    alone, together = [], []
    for _ in range(rounds):
        for turn in range(world):
            dist.barrier()
            if rank == turn:
                alone.append(timed_copy())
        dist.barrier()
        together.append(timed_copy())
    dist.barrier()
    moved = 2 * numel * 4
    return {"rank": rank, "alone": moved / statistics.median(alone),
            "together": moved / statistics.median(together)}  # fmt: skip


# --------------------------------------------------------------------------- exercises


def check_roofline(fn) -> None:
    """Exercise 1: ``fn(peak_flops, bandwidth, intensity)`` is the attainable FLOP/s."""
    cases = [(e["fp32"], e["bandwidth"]) for e in DEVICES.values()]
    cases += [(e["tensor"], e["bandwidth"]) for e in DEVICES.values() if e["tensor"]]
    for peak, bw in cases:
        ridge = ridge_point(peak, bw)
        for intensity in (0.0, 1 / 12, ridge / 3, ridge, 3 * ridge, 1e4):
            got, want = float(fn(peak, bw, intensity)), float(roofline(peak, bw, intensity))
            hint = ""
            if math.isclose(got, bw * intensity) and intensity > ridge:
                hint = " (above the ridge point the compute roof caps it)"
            elif math.isclose(got, peak) and intensity < ridge:
                hint = " (below the ridge point memory bandwidth caps it)"
            assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9), (
                f"peak={peak:.4g} FLOP/s, bandwidth={bw:.4g} B/s, intensity={intensity:.4g}: "
                f"got {got:.4g}, expected {want:.4g}{hint}"
            )
    print("Correct: attainable = min(peak, bandwidth x intensity).")


def min_tokens_compute_bound(d_in: int, d_out: int, peak_flops: float, bandwidth: float,
                             itemsize: int = 2):  # fmt: skip
    """Reference for exercise 2: the fewest tokens ``b`` for which a linear layer
    ``(b x d_in) @ (d_in x d_out)`` reaches the ridge point; ``None`` if none does."""
    ridge = ridge_point(peak_flops, bandwidth)
    # 2 b d_in d_out >= ridge * itemsize * (b d_in + d_in d_out + b d_out)
    denominator = 2 * d_in * d_out - ridge * itemsize * (d_in + d_out)
    if denominator <= 0:
        return None
    b = max(1, math.ceil(ridge * itemsize * d_in * d_out / denominator))
    while b > 1 and _linear_intensity(b - 1, d_in, d_out, itemsize) >= ridge:
        b -= 1  # guard against rounding at the boundary
    while _linear_intensity(b, d_in, d_out, itemsize) < ridge:
        b += 1
    return b


def _linear_intensity(b, d_in, d_out, itemsize):
    return arithmetic_intensity("matmul", m=b, k=d_in, n=d_out, itemsize=itemsize)


def check_min_tokens(fn) -> None:
    """Exercise 2: ``fn(d_in, d_out, peak_flops, bandwidth, itemsize)``, smallest batch."""
    h100, a100 = device_spec("H100 SXM"), device_spec("A100 SXM 80GB")
    cases = [
        (8192, 8192, h100["tensor"], h100["bandwidth"], 2),
        (4096, 4096, a100["tensor"], a100["bandwidth"], 2),
        (8192, 28672, h100["tensor"], h100["bandwidth"], 2),
        (1024, 1024, h100["fp32"], h100["bandwidth"], 4),
        (256, 256, h100["tensor"], h100["bandwidth"], 2),  # never compute-bound
    ]
    for d_in, d_out, peak, bw, itemsize in cases:
        got, want = (
            fn(d_in, d_out, peak, bw, itemsize),
            min_tokens_compute_bound(d_in, d_out, peak, bw, itemsize),
        )
        label = f"d_in={d_in}, d_out={d_out}, ridge={ridge_point(peak, bw):.1f}"
        if want is None:
            assert got is None, (
                f"{label}: no batch reaches the ridge (the weights alone "
                "bound the intensity below it); return None"
            )
            continue
        assert got is not None and int(got) == got, f"{label}: expected a whole number of tokens"
        got = int(got)
        ridge = ridge_point(peak, bw)
        assert _linear_intensity(got, d_in, d_out, itemsize) >= ridge, (
            f"{label}: {got} tokens give intensity "
            f"{_linear_intensity(got, d_in, d_out, itemsize):.1f}, below the ridge"
        )
        assert got == 1 or _linear_intensity(got - 1, d_in, d_out, itemsize) < ridge, (
            f"{label}: {got - 1} tokens already reach the ridge; {got} is not the fewest"
        )
    print("Correct: b >= R·s·d_in·d_out / (2·d_in·d_out - R·s·(d_in + d_out)).")


def check_predicted_seconds(fn) -> None:
    """Exercise 3: ``fn(flops, nbytes, peak_flops, bandwidth)``, the roofline's time."""
    h100 = device_spec("H100 SXM")
    add = kernel_cost("add", numel=2**28)
    big = kernel_cost("matmul", m=8192, k=8192, n=8192, itemsize=2)
    cases = [
        (add["flops"], add["bytes"], h100["fp32"], h100["bandwidth"]),
        (big["flops"], big["bytes"], h100["tensor"], h100["bandwidth"]),
        (0, 2**30, 1e12, 1e11),
        (1e12, 0, 1e12, 1e11),
    ]
    for flops, nbytes, peak, bw in cases:
        got, want = float(fn(flops, nbytes, peak, bw)), predicted_seconds(flops, nbytes, peak, bw)
        hint = ""
        if math.isclose(got, flops / peak + nbytes / bw) and flops and nbytes:
            hint = " (the roofline assumes computing and moving data overlap: take the longer)"
        assert math.isclose(got, want, rel_tol=1e-9), (
            f"flops={flops:.4g}, bytes={nbytes:.4g}: got {got:.4g} s, expected {want:.4g} s{hint}"
        )
    print("Correct: t = max(FLOPs / peak, bytes / bandwidth).")

"""Lab 1, hardware: the datasheet table, the roofline checked side by side, two ranks
sharing memory bandwidth, and the exercises' checkers.

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
from labsupport.labs.cells import exercise
from labsupport.measure.probe import cpu_model
from labsupport.measure.timing import side_by_side


def datasheet_rows() -> list[dict]:
    """Rows for :func:`labsupport.labs.cells.format_table`: peaks, bandwidth, ridge points."""
    rows = []
    for e in DEVICES.values():
        bandwidth, tensor = e["bandwidth"], e["tensor"]
        rows.append(
            {
                "device": e["name"],
                "memory": e["memory"],
                "GB/s": f"{bandwidth / GB:,.0f}"
                if bandwidth >= 100 * GB
                else f"{bandwidth / GB:.1f}",
                "FP32 TFLOP/s": f"{e['fp32'] / TFLOPS:g}",
                "ridge FP32": f"{ridge_point(e['fp32'], bandwidth):.1f}",
                "16-bit tensor TFLOP/s": "-"
                if tensor is None
                else f"{tensor / TFLOPS:g} ({e['tensor_precision']})",
                "ridge 16-bit": "-" if tensor is None else f"{ridge_point(tensor, bandwidth):.0f}",
            }
        )
    return rows


#: Which names, as PyTorch and ``/proc/cpuinfo`` give them, are the exact parts of the
#: datasheet table. A PCIe or NVL card, or an A100 with 40 GB, has other clocks or
#: another memory, so it matches nothing rather than the wrong entry.
_DATASHEET_NAMES = {
    "V100 SXM2": lambda n: "V100" in n and "SXM2" in n,
    "A100 SXM 80GB": lambda n: "A100" in n and "SXM4" in n and "80GB" in n,
    "H100 SXM": lambda n: "H100" in n and "HBM3" in n and "PCIe" not in n and "NVL" not in n,
    "H200 SXM": lambda n: "H200" in n and "NVL" not in n and "PCIe" not in n,
    "RTX 4090": lambda n: n.rstrip().endswith("RTX 4090"),
    "Ryzen 7 7840U (laptop CPU)": lambda n: "Ryzen 7 7840U" in n,
}


def datasheet_for(name: str) -> dict | None:
    """The entry of :data:`~labsupport.estimate.datasheets.DEVICES` for a device named
    ``name`` (``torch.cuda.get_device_name`` for a GPU, the CPU's model name), or
    ``None`` for a device the table does not hold.

    A roof the lab measures is the best this machine showed, so a kernel measured
    against it says how it compares with the lab's other kernels; measured against the
    datasheet, it says how close the machine comes to what its hardware can do.
    """
    for key, matches in _DATASHEET_NAMES.items():
        if matches(name):
            return DEVICES[key]
    return None


def device_name(device: str) -> str:
    """What the device calls itself: the CPU's model name, or the GPU's."""
    if device == "cpu":
        return cpu_model()
    return torch.cuda.get_device_name(torch.device(device))


ROOFLINE_KERNELS = {
    "add": ("add", {"numel": 16 * 2**20}),
    "copy": ("copy", {"numel": 64 * 2**20}),
    "matmul": ("matmul", {"m": 1024, "k": 1024, "n": 1024}),
}
"""The kernels :func:`roofline_side_by_side` times: section 5's addition, copy and
largest matmul, in fp32."""


def roofline_side_by_side(device="cpu", rounds: int = 7) -> dict:
    """Time an addition, a copy and a large matmul *in turns* on ``device``.

    The roofline says two things about the addition, far below the ridge point: it moves
    bytes at the copy's pace, and it reaches a small fraction of the FLOP/s of a large
    matmul. Times measured one after the other on a busy machine cannot test that: load
    from another program can slow any of them. :func:`side_by_side` takes one sample
    of each kernel per round, round after round, so that load lands on all three alike.

    Returns, for each kernel of :data:`ROOFLINE_KERNELS`, its counted ``flops`` and
    ``bytes`` (:func:`kernel_cost`), its median ``seconds``, and ``"vs add"``: its time
    over the addition's in the same round, the median over the rounds.
    """
    cost = {name: kernel_cost(kind, **shape) for name, (kind, shape) in ROOFLINE_KERNELS.items()}
    n_add = ROOFLINE_KERNELS["add"][1]["numel"]
    n_copy = ROOFLINE_KERNELS["copy"][1]["numel"]
    side = ROOFLINE_KERNELS["matmul"][1]["m"]
    a, b = torch.full((n_add,), 1.0, device=device), torch.full((n_add,), 2.0, device=device)
    c = torch.empty_like(a)
    src = torch.full((n_copy,), 1.0, device=device)
    dst = torch.empty_like(src)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(side, side, generator=gen).to(device) for _ in range(2))
    z = torch.empty(side, side, device=device)
    timed = side_by_side(
        {
            "add": lambda: torch.add(a, b, out=c),
            "copy": lambda: dst.copy_(src),
            "matmul": lambda: torch.matmul(x, y, out=z),
        },
        rounds=rounds,
        device=device,
    )
    return {
        name: cost[name] | {"seconds": timed[name], "vs add": timed["ratio"][name]}
        for name in ROOFLINE_KERNELS
    }


def shared_copy_bandwidth(nbytes: int = 256 * MiB, rounds: int = 5, threads: int = 1) -> dict:
    """Run under :func:`labsupport.launch`: each rank's copy bandwidth, alone and together.

    Every round, each rank in turn copies its ``nbytes`` while the others wait at a
    barrier (*alone*), then all ranks copy at the same moment (*together*). Alternating
    the two within one run means a burst of load from another program affects both
    alike. Returns this rank's median bandwidth (bytes/s, 2 bytes moved per byte copied)
    in each case, and ``"together / alone"``: the median over the rounds of this rank's
    time alone divided by its time together in the same round.

    The buffers are CPU tensors in the machine's RAM whatever the backend, on purpose:
    what the ranks of one node share is its RAM (GPUs each have their own memory). Each
    rank uses ``threads`` threads, 1 by default, so that two ranks do not compete for
    cores on a 2-core machine; what they compete for is the memory system.
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
    return {
        "rank": rank,
        "alone": moved / statistics.median(alone),
        "together": moved / statistics.median(together),
        "together / alone": statistics.median(a / t for a, t in zip(alone, together, strict=True)),
    }


# --------------------------------------------------------------------------- exercises


@exercise
def check_roofline(fn) -> str:
    """Exercise 1: ``fn(peak_flops, bandwidth, intensity)`` is the attainable FLOP/s."""
    cases = [(e["fp32"], e["bandwidth"]) for e in DEVICES.values()]
    cases += [(e["tensor"], e["bandwidth"]) for e in DEVICES.values() if e["tensor"]]
    for peak, bw in cases:
        ridge = ridge_point(peak, bw)
        for intensity in (0.0, 1 / 12, ridge / 3, ridge, 3 * ridge, 1e4):
            got, want = float(fn(peak, bw, intensity)), float(roofline(peak, bw, intensity))
            hint = ""
            if got > peak * (1 + 1e-9):
                hint = " (above the ridge point the compute roof caps it: nothing beats the peak)"
            elif got > bw * intensity * (1 + 1e-9):
                hint = " (below the ridge point memory bandwidth caps it)"
            elif got < want:
                hint = " (lower than the model allows: only the peak and the bandwidth limit it)"
            assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9), (
                f"peak={peak:.4g} FLOP/s, bandwidth={bw:.4g} B/s, intensity={intensity:.4g}: "
                f"got {got:.4g} FLOP/s{hint}"
            )
    return (
        f"the attainable FLOP/s of {len(cases)} datasheet rooflines, below, at and above "
        "each ridge point"
    )


def min_tokens_compute_bound(
    d_in: int, d_out: int, peak_flops: float, bandwidth: float, itemsize: int = 2
):
    """The fewest tokens ``b`` for which a linear layer ``(b x d_in) @ (d_in x d_out)``
    reaches the ridge point; ``None`` if none does (exercise 2's answer, for its checker)."""
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


@exercise
def check_min_tokens(fn) -> str:
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
        got = fn(d_in, d_out, peak, bw, itemsize)
        want = min_tokens_compute_bound(d_in, d_out, peak, bw, itemsize)
        ridge = ridge_point(peak, bw)
        label = f"d_in={d_in}, d_out={d_out}, {itemsize} bytes per number, ridge={ridge:.1f}"
        if want is None:
            assert got is None, (
                f"{label}: no batch reaches the ridge (the weights alone bound the "
                "intensity below it); return None"
            )
            continue
        assert got is not None and int(got) == got, f"{label}: expected a whole number of tokens"
        got = int(got)
        assert _linear_intensity(got, d_in, d_out, itemsize) >= ridge, (
            f"{label}: {got} tokens give intensity "
            f"{_linear_intensity(got, d_in, d_out, itemsize):.1f}, below the ridge"
        )
        assert got == 1 or _linear_intensity(got - 1, d_in, d_out, itemsize) < ridge, (
            f"{label}: {got - 1} tokens already reach the ridge; {got} is not the fewest"
        )
    return (
        f"the fewest tokens for {len(cases) - 1} layers on H100 and A100 rooflines, and None "
        "for a layer that never reaches the ridge"
    )


@exercise
def check_predicted_seconds(fn) -> str:
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
            hint = " (the roofline assumes computing and moving data overlap)"
        elif got < want:
            hint = " (a kernel can take no less time than its arithmetic, nor than its traffic)"
        assert math.isclose(got, want, rel_tol=1e-9), (
            f"flops={flops:.4g}, bytes={nbytes:.4g}, peak={peak:.4g} FLOP/s, "
            f"bandwidth={bw:.4g} B/s: got {got:.4g} s{hint}"
        )
    return (
        "the roofline's time of a memory-bound addition, a compute-bound matmul, and "
        "kernels with no FLOPs or no bytes"
    )

"""Lab 1, hardware: probe this machine, measure its two speeds, and draw its roofline.

A kernel (one operation on a device: a copy, an addition, a matrix multiply) is limited
either by how fast the device computes (FLOP/s) or by how fast it moves bytes to and from
memory (bytes/s). This module

* describes the machine it runs on (:func:`machine_info`);
* measures both ceilings: memory bandwidth with a large copy (:func:`measure_bandwidth`)
  and FLOP/s with a matrix multiply (:func:`measure_matmul_flops`), on the CPU and on
  every GPU it finds;
* counts the FLOPs and bytes of a few kernels (:func:`kernel_cost`), so that their
  *arithmetic intensity* is computed, not guessed, and times them (:func:`measure_kernel`);
* puts it together in the roofline model (:func:`roofline`, :func:`draw_roofline`);
* holds datasheet numbers for a few accelerators and a laptop CPU (:data:`DATASHEETS`),
  with their sources, and draws the chapter's figures from them;
* runs the copy on several ranks, alone and at once (:func:`shared_copy_bandwidth`), to show that
  processes on one machine share its memory bandwidth.

References: S. Williams, A. Waterman and D. Patterson, "Roofline: an insightful visual
performance model for multicore architectures", Communications of the ACM 52(4), 2009;
J. D. McCalpin, "Memory bandwidth and machine balance in current high performance
computers", IEEE TCCA Newsletter, December 1995 (the STREAM benchmark, whose *copy*
counts two bytes moved per byte copied, as :func:`measure_bandwidth` does).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time

import numpy as np
import psutil
import torch
import torch.distributed as dist

from labsupport import plotting

MiB = 2**20
GB = 1e9  # datasheets use decimal units: 1 GB/s = 10^9 bytes/s
TFLOPS = 1e12

# --------------------------------------------------------------------------- the machine


def cpu_model() -> str:
    """The CPU's name from ``/proc/cpuinfo`` (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask), which a container or
    a job scheduler can set below the machine's total."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return psutil.cpu_count(logical=True) or 1


def gpu_info() -> list[dict]:
    """Name, memory (bytes), streaming multiprocessors and compute capability of each
    visible CUDA GPU; an empty list on a machine without one."""
    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            {
                "index": index,
                "name": props.name,
                "memory_bytes": props.total_memory,
                "multiprocessors": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}",
                "bf16": torch.cuda.is_bf16_supported(),
            }
        )
    return gpus


def machine_info() -> dict:
    """What this machine has: CPU model, cores, RAM, and its GPUs with their memory.

    ``cores`` counts the cores this process may use, ``logical_cpus`` and
    ``physical_cores`` the machine's (hyper-threads count twice in the first).
    """
    return {
        "cpu_model": cpu_model(),
        "cores": usable_cores(),
        "logical_cpus": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
        "ram_bytes": psutil.virtual_memory().total,
        "torch_threads": torch.get_num_threads(),
        "gpus": gpu_info(),
    }


def devices() -> list[str]:
    """The devices the lab measures: ``"cpu"``, then ``"cuda:0"``, ``"cuda:1"``, ..."""
    return ["cpu"] + [f"cuda:{g['index']}" for g in gpu_info()]


# --------------------------------------------------------------------------- timing


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn, device="cpu", repeats: int = 5, min_sample_s: float = 2e-3,
            best: bool = False) -> float:  # fmt: skip
    """Median (or, with ``best``, shortest) seconds per call of ``fn()`` on ``device``.

    GPUs run asynchronously, so each sample waits for the device to finish
    (``torch.cuda.synchronize``). A sample runs ``fn`` often enough to last at least
    ``min_sample_s``, so that the timer's resolution and the launch cost of a tiny
    kernel do not dominate. It warms up with one call first (memory allocation, caches,
    lazy initialization). The median of ``repeats`` samples is robust to a sample slowed
    down by another program; the shortest (``best=True``, as STREAM reports) estimates
    what the hardware can do, since interference only ever makes a sample slower.
    """
    fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    once = time.perf_counter() - start
    inner = max(1, min(10_000, math.ceil(min_sample_s / max(once, 1e-9))))
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - start) / inner)
    return min(samples) if best else statistics.median(samples)


# --------------------------------------------------------------------------- FLOPs and bytes


def kernel_cost(kind: str, *, numel: int = 0, m: int = 0, k: int = 0, n: int = 0,
                itemsize: int = 4) -> dict:  # fmt: skip
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


# --------------------------------------------------------------------------- the roofline


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


# --------------------------------------------------------------------------- measuring


def measure_bandwidth(nbytes: int = 256 * MiB, device="cpu", repeats: int = 5) -> dict:
    """Memory bandwidth of ``device``, from copying an fp32 tensor of ``nbytes``.

    A copy reads ``nbytes`` and writes ``nbytes``: ``bytes_moved = 2 * nbytes``, the
    STREAM convention. The tensor must be much larger than the caches (a CPU's last-level
    cache is tens of MB, an H100's L2 50 MB), or the copy measures the cache instead.
    A ceiling is the best the device does, so this keeps the fastest of ``repeats``.
    """
    numel = nbytes // 4
    src = torch.arange(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = time_op(lambda: dst.copy_(src), device, repeats, best=True)
    if not torch.equal(dst[-1000:], src[-1000:]):
        raise RuntimeError("the copy did not copy")
    moved = kernel_cost("copy", numel=numel)["bytes"]
    return {"device": str(device), "nbytes": numel * 4, "bytes_moved": moved,
            "seconds": seconds, "bandwidth": moved / seconds}  # fmt: skip


def measure_matmul_flops(n: int = 1024, dtype=torch.float32, device="cpu", repeats: int = 5,
                         seed: int = 0) -> dict:  # fmt: skip
    """FLOP/s of a square ``n x n`` matrix multiply in ``dtype`` on ``device``.

    Counts ``2 n^3`` FLOPs per multiply (:func:`kernel_cost`), the count PyTorch's own
    ``torch.utils.flop_counter`` uses. Large matrices get close to the device's peak;
    small ones do not (too little work to fill every core, and fixed costs per call).
    Keeps the fastest of ``repeats``, like :func:`measure_bandwidth`.
    """
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype, device=device)
    seconds = time_op(lambda: torch.matmul(a, b, out=out), device, repeats, best=True)
    flops = kernel_cost("matmul", m=n, k=n, n=n)["flops"]
    return {"device": str(device), "n": n, "dtype": str(dtype).removeprefix("torch."),
            "flops": flops, "seconds": seconds, "flop_per_s": flops / seconds}  # fmt: skip


def measure_kernel(kind: str, device="cpu", repeats: int = 5, dtype=torch.float32,
                   seed: int = 0, **shape) -> dict:  # fmt: skip
    """Time one kernel (``"copy"``, ``"add"`` or ``"matmul"``) and place it on the roofline.

    ``shape`` is ``numel=`` for copy and add, ``m=, k=, n=`` for matmul. Returns the
    counted FLOPs and bytes, the intensity, the fastest of ``repeats`` times (what the
    kernel can do, as for the ceilings), and the FLOP/s and bytes/s achieved.
    """
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty(0, dtype=dtype).element_size()

    def tensor(*size):
        return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)

    if kind == "copy":
        src, dst = tensor(shape["numel"]), torch.empty(shape["numel"], dtype=dtype, device=device)
        fn = lambda: dst.copy_(src)  # noqa: E731
        label = f"copy, {shape['numel'] * itemsize / MiB:g} MiB"
    elif kind == "add":
        a, b = tensor(shape["numel"]), tensor(shape["numel"])
        c = torch.empty_like(a)
        fn = lambda: torch.add(a, b, out=c)  # noqa: E731
        label = f"add, {shape['numel'] / 2**20:g} Mi elements"
    elif kind == "matmul":
        a, b = tensor(shape["m"], shape["k"]), tensor(shape["k"], shape["n"])
        c = torch.empty(shape["m"], shape["n"], dtype=dtype, device=device)
        fn = lambda: torch.matmul(a, b, out=c)  # noqa: E731
        label = f"matmul {shape['m']}x{shape['k']}x{shape['n']}"
    else:
        raise ValueError(f"unknown kernel {kind!r}: use 'copy', 'add' or 'matmul'")
    cost = kernel_cost(kind, itemsize=itemsize, **shape)
    seconds = time_op(fn, device, repeats, best=True)
    return {"kind": kind, "label": label, "device": str(device), **cost,
            "intensity": cost["flops"] / cost["bytes"], "seconds": seconds,
            "flop_per_s": cost["flops"] / seconds,
            "bandwidth": cost["bytes"] / seconds}  # fmt: skip


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


# --------------------------------------------------------------------------- datasheets

NVIDIA = "https://www.nvidia.com/en-us/data-center/"
ADA = "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
AMD_7840U = (
    "https://www.amd.com/en/products/processors/laptop/ryzen/7000-series/amd-ryzen-7-7840u.html"
)


def _entry(name, kind, memory, bandwidth_gb_s, fp32_tflops, tensor_tflops, tensor_precision,
           datasheet, source):  # fmt: skip
    return {
        "name": name,
        "kind": kind,
        "memory": memory,
        "bandwidth": bandwidth_gb_s * GB,
        "fp32": fp32_tflops * TFLOPS,
        "tensor": None if tensor_tflops is None else tensor_tflops * TFLOPS,
        "tensor_precision": tensor_precision,
        "datasheet": datasheet,
        "source": source,
    }


LAPTOP_CPU = {
    "name": "AMD Ryzen 7 7840U",
    "cores": 8,
    "base_clock_hz": 3.3e9,
    # Zen 4: two 256-bit FMA pipes per core = 2 x 8 fp32 lanes x 2 FLOPs (multiply + add)
    "fp32_flops_per_cycle": 32,
    # DDR5-5600: 5600 million transfers/s on each of two 64-bit (8-byte) channels
    "memory_transfers_per_s": 5600e6,
    "channels": 2,
    "bytes_per_transfer": 8,
}
"""The ingredients of the laptop CPU's peak numbers, which no datasheet states directly:
cores, base clock and supported memory from AMD's product page, FLOPs per cycle from
AMD's Zen 4 software optimization guide (publication 57647)."""


def laptop_cpu_peaks(cpu: dict = LAPTOP_CPU) -> tuple[float, float]:
    """Peak fp32 FLOP/s (cores x clock x FLOPs per cycle) and DRAM bandwidth (bytes/s)."""
    flops = cpu["cores"] * cpu["base_clock_hz"] * cpu["fp32_flops_per_cycle"]
    bandwidth = cpu["memory_transfers_per_s"] * cpu["channels"] * cpu["bytes_per_transfer"]
    return flops, bandwidth


_CPU_FLOPS, _CPU_BANDWIDTH = laptop_cpu_peaks()

DATASHEETS = {
    entry["name"]: entry
    for entry in [
        _entry("V100 SXM2", "GPU", "32 GB HBM2", 900, 15.7, 125, "FP16",
               "FP32 15.7 TFLOPS; Tensor 125 TFLOPS (FP16 inputs); HBM2 900 GB/s",
               NVIDIA + "v100/"),
        _entry("A100 SXM 80GB", "GPU", "80 GB HBM2e", 2039, 19.5, 312, "BF16",
               "FP32 19.5 TFLOPS; BF16 Tensor 312 TFLOPS (624 with sparsity); 2,039 GB/s",
               NVIDIA + "a100/"),
        _entry("H100 SXM", "GPU", "80 GB HBM3", 3350, 67, 989, "BF16",
               "FP32 67 TFLOPS; BF16 Tensor 1,979 TFLOPS with sparsity (989 dense); 3.35 TB/s",
               NVIDIA + "h100/"),
        _entry("H200 SXM", "GPU", "141 GB HBM3e", 4800, 67, 989, "BF16",
               "FP32 67 TFLOPS; BF16 Tensor 1,979 TFLOPS with sparsity (989 dense); 4.8 TB/s",
               NVIDIA + "h200/"),
        _entry("RTX 4090", "GPU", "24 GB GDDR6X", 1008, 82.6, 165.2, "BF16",
               "FP32 82.6 TFLOPS; BF16 Tensor, FP32 accumulate, 165.2 TFLOPS (330.4 with "
               "sparsity); 1,008 GB/s", ADA),
        _entry("Ryzen 7 7840U (laptop CPU)", "CPU", "DDR5-5600, 2 channels",
               _CPU_BANDWIDTH / GB, _CPU_FLOPS / TFLOPS, None, None,
               "8 cores, 3.3 GHz base; computed: 8 x 3.3 GHz x 32 FLOP/cycle = 844.8 GFLOP/s; "
               "2 x 8 B x 5600 MT/s = 89.6 GB/s", AMD_7840U),
    ]
}  # fmt: skip
"""Datasheet numbers, **dense** (no sparsity): ``bandwidth`` in bytes/s, ``fp32`` and
``tensor`` in FLOP/s. ``fp32`` is the non-tensor (CUDA core, or CPU vector unit) rate;
``tensor`` is the tensor-core rate at ``tensor_precision``: NVIDIA lists the H100, H200 and
A100 16-bit rates *with* 2:4 structured sparsity, twice the dense rate given here. The
V100's tensor cores take FP16 (they predate BF16). The laptop CPU's numbers are computed
from its specifications (:data:`LAPTOP_CPU`), at base clock."""


def datasheet(name: str) -> dict:
    """The entry of :data:`DATASHEETS` called ``name`` (a clear error for a typo)."""
    try:
        return DATASHEETS[name]
    except KeyError:
        raise KeyError(f"no datasheet {name!r}; known: {', '.join(DATASHEETS)}") from None


def datasheet_rows() -> list[dict]:
    """Rows for :func:`labsupport.notebook.format_table`: peaks, bandwidth, ridge points."""
    rows = []
    for e in DATASHEETS.values():
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


# --------------------------------------------------------------------------- figures


def draw_roofline(ceilings: list[dict], kernels: list[dict] = (), ax=None, title=None,
                  intensities=(1 / 64, 4096)):  # fmt: skip
    """Rooflines on log-log axes, with measured kernels placed under them.

    ``ceilings``: dicts with ``label``, ``peak_flops`` and ``bandwidth`` (and optionally
    ``color``, ``ls``); each is drawn as the slanted memory roof meeting the flat compute
    roof at its ridge point (a dot). ``kernels``: dicts with ``label``, ``intensity`` and
    ``flop_per_s``, as :func:`measure_kernel` returns them; kernels with 0 FLOPs (a copy)
    have no place on a log axis and are skipped.
    """
    if ax is None:
        _, ax = plotting.figure(7.0, 4.2)
    x = np.geomspace(*intensities, 400)
    for i, c in enumerate(ceilings):
        color = c.get("color", plotting.rank_color(i))
        ax.plot(x, roofline(c["peak_flops"], c["bandwidth"], x) / 1e9, color=color,
                ls=c.get("ls", "-"), lw=1.8, label=c["label"])  # fmt: skip
        ridge = ridge_point(c["peak_flops"], c["bandwidth"])
        if intensities[0] <= ridge <= intensities[1]:
            ax.plot(ridge, c["peak_flops"] / 1e9, "o", color=color, ms=5)
    markers = "sD^v<>p*"
    for j, k in enumerate(kn for kn in kernels if kn["flop_per_s"] > 0):
        ax.plot(k["intensity"], k["flop_per_s"] / 1e9, markers[j % len(markers)],
                color="black", mfc="white", ms=7, mew=1.4, label=k["label"])  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = [2.0**e for e in range(-8, 16, 2) if intensities[0] <= 2.0**e <= intensities[1]]
    ax.set_xticks(ticks, [f"{t:g}" if t >= 1 else f"1/{1 / t:g}" for t in ticks])
    ax.set_xlabel("arithmetic intensity (FLOP per byte of memory traffic)")
    ax.set_ylabel("attainable GFLOP/s")
    ax.legend(fontsize=8, loc="lower right", frameon=False)
    if title:
        ax.set_title(title)
    return ax


def datasheet_rooflines():
    """Chapter 1: rooflines from :data:`DATASHEETS`, FP32 (left) and 16-bit tensor (right).

    Vertical lines mark the computed intensities of an elementwise add and of a square
    matmul of side 1024, for 4-byte (left) and 2-byte (right) elements.
    """
    plotting.plt.rcParams.update(plotting.STYLE)
    fig, (left, right) = plotting.plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    panels = (
        (left, "fp32", 4, "FP32 (CUDA cores; CPU vector units)"),
        (right, "tensor", 2, "16-bit tensor cores, dense (BF16; V100: FP16)"),
    )
    for ax, key, itemsize, title in panels:
        ceilings = [
            {"label": e["name"], "peak_flops": e[key], "bandwidth": e["bandwidth"],
             "color": plotting.rank_color(i), "ls": "--" if e["kind"] == "CPU" else "-"}
            for i, e in enumerate(DATASHEETS.values())
            if e[key] is not None
        ]  # fmt: skip
        draw_roofline(ceilings, ax=ax, title=title, intensities=(1 / 32, 8192))
        marks = [
            ("add", arithmetic_intensity("add", numel=1, itemsize=itemsize)),
            ("matmul 1024³", arithmetic_intensity("matmul", m=1024, k=1024, n=1024,
                                                  itemsize=itemsize)),
        ]  # fmt: skip
        for name, intensity in marks:
            ax.axvline(intensity, color="#999999", lw=1, ls=":")
            ax.text(intensity * 1.12, 3, f"{name}\n{intensity:.3g} FLOP/B", fontsize=8,
                    color="#555555")  # fmt: skip
        ax.set_ylim(1, 3e6)
        ax.legend(fontsize=8, loc="upper left", frameon=False)
    right.set_ylabel("")
    fig.suptitle("Rooflines from datasheets: min(peak FLOP/s, bandwidth × intensity); "
                 "dots are ridge points", fontsize=11)  # fmt: skip
    fig.tight_layout()
    return fig


HIERARCHY = {
    "H100 SXM (one GPU)": [
        ("registers", 132 * 256 * 1024, "256 KB per SM x 132 SMs"),
        ("L1 / shared memory", 132 * 256 * 1024, "256 KB per SM x 132 SMs"),
        ("L2 cache", 50 * 10**6, "50 MB"),
        ("HBM3 (VRAM)", 80 * 10**9, "80 GB, 3.35 TB/s"),
        ("host RAM (DGX H100)", 2 * 10**12, "2 TB, over PCIe 5.0: 63 GB/s each way"),
    ],
    "Ryzen 7 7840U (laptop CPU)": [
        ("L1 data cache", 8 * 32 * 1024, "32 KB per core x 8"),
        ("L2 cache", 8 * 2**20, "1 MB per core x 8"),
        ("L3 cache", 16 * 2**20, "16 MB shared"),
        ("DDR5 RAM", 32 * 10**9, "size varies (32 GB drawn); 89.6 GB/s"),
    ],
}
"""Capacities (bytes) of the memory levels, fastest first: H100 from NVIDIA's Hopper
architecture description and the DGX H100 reference architecture; the laptop CPU from
AMD's product page and Zen 4 optimization guide. The RAM size of a laptop varies."""


def memory_hierarchy():
    """Chapter 1: capacity of each memory level of an H100 and of a laptop CPU (log scale)."""
    plotting.plt.rcParams.update(plotting.STYLE)
    fig, axes = plotting.plt.subplots(1, 2, figsize=(11, 3.6), sharex=True)
    for ax, (device, levels) in zip(axes, HIERARCHY.items(), strict=True):
        names = [name for name, _, _ in levels]
        sizes = [size for _, size, _ in levels]
        y = np.arange(len(levels))[::-1]
        ax.barh(y, sizes, color=plotting.rank_color(0), alpha=0.85, height=0.6)
        for yi, size, (_, _, note) in zip(y, sizes, levels, strict=True):
            ax.text(size * 1.3, yi, note, va="center", fontsize=8)
        ax.set_yticks(y, names)
        ax.set_xscale("log")
        ax.set_xlim(1e5, 1e16)
        ax.set_xticks([1e6, 1e9, 1e12], ["1 MB", "1 GB", "1 TB"])
        ax.set_title(device)
        ax.set_xlabel("capacity (bytes, log scale)")
    fig.suptitle("The memory hierarchy: each level down is larger and slower "
                 "(fastest at the top)", fontsize=11)  # fmt: skip
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- exercises


def check_roofline(fn) -> None:
    """Exercise 1: ``fn(peak_flops, bandwidth, intensity)`` is the attainable FLOP/s."""
    cases = [(e["fp32"], e["bandwidth"]) for e in DATASHEETS.values()]
    cases += [(e["tensor"], e["bandwidth"]) for e in DATASHEETS.values() if e["tensor"]]
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
    h100, a100 = datasheet("H100 SXM"), datasheet("A100 SXM 80GB")
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
            assert got is None, f"{label}: no batch reaches the ridge (the weights alone "
            "bound the intensity below it); return None"
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
    h100 = datasheet("H100 SXM")
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

"""Probes of this machine: what it has, and how fast it computes and moves memory.

* :func:`machine_info`: CPU model, cores, RAM, and each GPU with its memory;
* :func:`measure_bandwidth`: memory bandwidth, from a copy much larger than the caches;
* :func:`measure_matmul_flops`: FLOP/s of a square matrix multiply;
* :func:`measure_kernel`: one kernel timed and placed on the roofline
  (:mod:`labsupport.estimate.roofline` counts its FLOPs and bytes).

Measurements run on the CPU and on every GPU this process sees (:func:`devices`).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import psutil
import torch

from labsupport.estimate.roofline import kernel_cost
from labsupport.estimate.units import MiB
from labsupport.measure.timing import time_op


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


def cpu_bf16_flags() -> list[str]:
    """The CPU's native bf16 instruction sets (Linux ``/proc/cpuinfo``; empty elsewhere):
    x86's AVX-512 BF16, AMX and AVX-VNNI, or Arm's BF16 extension (``bf16``)."""
    path = Path("/proc/cpuinfo")
    flags = set(path.read_text().split()) if path.exists() else set()
    return sorted(f for f in ("avx512_bf16", "amx_bf16", "avx_vnni_bf16", "bf16") if f in flags)


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
    return {
        "device": str(device),
        "nbytes": numel * 4,
        "bytes_moved": moved,
        "seconds": seconds,
        "bandwidth": moved / seconds,
    }


def measure_matmul_flops(
    n: int = 1024, dtype=torch.float32, device="cpu", repeats: int = 5, seed: int = 0
) -> dict:
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
    return {
        "device": str(device),
        "n": n,
        "dtype": str(dtype).removeprefix("torch."),
        "flops": flops,
        "seconds": seconds,
        "flop_per_s": flops / seconds,
    }


def measure_kernel(
    kind: str, device="cpu", repeats: int = 5, dtype=torch.float32, seed: int = 0, **shape
) -> dict:
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
    return {
        "kind": kind,
        "label": label,
        "device": str(device),
        **cost,
        "intensity": cost["flops"] / cost["bytes"],
        "seconds": seconds,
        "flop_per_s": cost["flops"] / seconds,
        "bandwidth": cost["bytes"] / seconds,
    }

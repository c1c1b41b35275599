"""``make gpu-check``'s bandwidth lines: ``make bench``'s all-reduce line on CUDA/NCCL.

GPU 0's copy bandwidth against its datasheet's memory bandwidth and, with two GPUs or
more, torch's all-reduce over every GPU, its bus bandwidth against the datasheet's link
(NVLink, one direction) and against the floor :mod:`bench.floors` takes for the CPU
(``2(N-1)/N`` of a copy of the ranks' own tensors, all at once), each as "x of the floor"
(:mod:`bench.report`), timed as the bench times them (:func:`bench.allreduce.alternate`).
Without a GPU, the all-reduce runs on two CPU ranks over gloo (``python -m
tools.gpu_check --cpu``), so that this code is tested everywhere.
"""

from __future__ import annotations

import torch

from bench.allreduce import alternate
from labsupport import launch

#: The NVLink generation of each GPU family (SXM boards), by a word of its CUDA name.
NVLINK = {"V100": "NVLink 2 (V100)", "A100": "NVLink 3 (A100)", "H100": "NVLink 4 (H100)",
          "H200": "NVLink 4 (H100)", "B200": "NVLink 5 (B200)"}  # fmt: skip
#: The datasheet entry (:data:`labsupport.estimate.datasheets.DEVICES`) of each family.
DATASHEET = {"V100": "V100 SXM2", "A100": "A100 SXM 80GB", "H100": "H100 SXM", "H200": "H200 SXM"}


def _family(name: str, table: dict) -> str | None:
    return next((table[word] for word in table if word in name), None)


def allreduce_lines(times: dict, nbytes: int, world: int, link: dict | None) -> list[str]:
    """The all-reduce's bus bandwidth against the link's and the copy floor's."""
    from bench import floors, report
    from labsupport.comm.cost import bus_bandwidth

    floor = [floors.ring_floor_seconds(nbytes, world, t) for t in times["copy"]]
    median = sorted(times["torch"])[len(times["torch"]) // 2]
    busbw = float(bus_bandwidth(nbytes, median, world))
    lines = [
        f"all-reduce {nbytes / 2**20:.0f} MiB on {world} ranks: bus bandwidth "
        f"{busbw / 1e9:,.1f} GB/s, {report.paired(times['torch'], floor)} of the floor "
        f"(2(N-1)/N of a copy of the ranks' own tensors, all at once)"
    ]
    if link is not None:
        lines.append(
            f"all-reduce against the datasheet's {link['name']}, {link['gb_per_s']:,.0f} GB/s "
            f"each way: {link['gb_per_s'] * 1e9 / busbw:.2f}x of that floor"
        )
    return lines


def bandwidth_lines(gpus: int, backend: str, nbytes: int, rounds: int) -> list[str]:
    """Step 5: the copy against the datasheet (with a GPU), the all-reduce over
    ``max(gpus, 2)`` ranks (one per GPU; two CPU ranks on gloo without one)."""
    from labsupport.estimate.datasheets import device_spec, link
    from labsupport.measure.probe import measure_bandwidth

    lines = []
    name = torch.cuda.get_device_name(0) if gpus else ""
    if gpus:
        copy = measure_bandwidth(nbytes, device="cuda:0")["bandwidth"]
        spec = _family(name, DATASHEET)
        sheet = device_spec(spec)["bandwidth"] if spec else None
        lines.append(
            f"copy bandwidth of {name}: {copy / 1e9:,.0f} GB/s (read + write)"
            + (
                f", {sheet / copy:.2f}x of the floor, the datasheet's {sheet / 1e9:,.0f} GB/s"
                if sheet
                else ", no datasheet entry for this GPU"
            )  # fmt: skip
        )
    if gpus == 1:
        return lines + ["all-reduce: one GPU here; NCCL needs a GPU per rank (2 or more)"]
    world = max(gpus, 2)
    times = launch(alternate, world, args=(nbytes, rounds, False), backend=backend, timeout=300)
    family = _family(name, NVLINK)
    return lines + allreduce_lines(times[0], nbytes, world, link(family) if family else None)

"""Ring all-reduce (labsupport.comm.all_reduce) vs torch.distributed.all_reduce on gloo,
and both against the machine's memory-copy rate.

4 ranks, 16 MiB of float32, in one launch: the ring, torch's all-reduce and a copy of
each rank's own tensor into a buffer of its size (every rank at once) run in turns,
ROUNDS rounds after a warm-up, each from a barrier to the slowest rank's end. Ratios are
the median of each round's pair, with their spread. The floor: ranks on one machine pass
their bytes through its memory, and a bandwidth-optimal ring sends ``2(N-1)/N`` of the
tensor per rank, so no all-reduce beats ``2(N-1)/N`` copies' time (its bus bandwidth
cannot pass the copy rate). The target (issue: "the ring within 1.5x of the built-in's
time") is checked at the end.
"""

from __future__ import annotations

import statistics
import sys

import torch
import torch.distributed as dist

from bench import floors, report

WORLD, NBYTES, ROUNDS = 4, 16 * 2**20, 15


def alternate(nbytes: int, rounds: int, ring: bool = True) -> dict | None:
    """Time the ring (unless ``ring=False``), torch's all-reduce and a copy of the same
    tensor in turns, on every rank; rank 0 returns the lists of seconds."""
    from labsupport import comm
    from labsupport.launch.runtime import device

    tensor = torch.ones(nbytes // 4, device=device())
    buffer = torch.empty_like(tensor)
    runs = {
        "ring": report.slowest(lambda: comm.all_reduce(tensor)),
        "torch": report.slowest(lambda: dist.all_reduce(tensor)),
        "copy": report.slowest(lambda: buffer.copy_(tensor)),
    }
    if not ring:
        del runs["ring"]
    times = report.in_turns(runs, rounds, warmup=1)
    return times if dist.get_rank() == 0 else None


def summarise(times: dict, nbytes: int = NBYTES, world: int = WORLD) -> list[dict]:
    """The bench's lines from the three runs' times, round by round."""
    from labsupport.comm.cost import bus_bandwidth

    floor = [floors.ring_floor_seconds(nbytes, world, t) for t in times["copy"]]
    copy_rate = nbytes / statistics.median(times["copy"]) / 1e9
    described = (
        f"2(N-1)/N = {2 * (world - 1) / world:.2f} of a copy of the {nbytes // 2**20} MiB, "
        f"at the rate the ranks copy their own tensors, all at once: {copy_rate:.2f} GB/s; "
        f"median {statistics.median(floor) * 1e3:.1f} ms"
    )
    lines = []
    for name, label in (("torch", "torch.distributed.all_reduce"), ("ring", "labsupport ring")):
        median = statistics.median(times[name])
        busbw = float(bus_bandwidth(nbytes, median, world)) / 1e9
        vs = None if name == "torch" else ("torch", report.paired(times[name], times["torch"]))
        lines.append(
            report.timed(label, times[name], floor, described, vs, f"{busbw:.2f} GB/s bus")
        )
    return lines


def main() -> int:
    from labsupport import launch

    times = launch(alternate, WORLD, args=(NBYTES, ROUNDS), timeout=600)[0]
    print(
        f"\nall-reduce of {NBYTES // 2**20} MiB float32 on {WORLD} ranks (gloo, CPU), "
        f"{ROUNDS} rounds of ring, torch and copy in turns"
    )
    lines = summarise(times)
    report.print_lines(lines, "x torch")
    ratio = report.paired(times["ring"], times["torch"])
    ok = ratio.median <= 1.5
    targets = [report.target("ring within 1.5x of the built-in's time", str(ratio), ok)]
    config = {"world": WORLD, "nbytes": NBYTES, "rounds": ROUNDS, "backend": "gloo"}
    return report.record("allreduce", config, lines, targets)


if __name__ == "__main__":
    sys.exit(main())

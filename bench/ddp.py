"""Bucketed data parallelism from scratch vs torch's DistributedDataParallel.

4 ranks, the course GPT (4 layers, d = 128, 128 tokens of context), one training step
(forward, backward with the bucketed all-reduces, SGD step) of each, alternating step
by step inside one launch so that both see the same machine load. Each step starts
after a barrier and counts the slowest rank. Target (issue 10): the from-scratch
version's throughput at least 0.9x torch's.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

WORLD, STEPS, BATCH = 4, 12, 4
CONFIG = {"vocab_size": 256, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 128}


def alternate(steps: int) -> dict | None:
    """Train both wrappers step by step in turns; rank 0 returns each one's step times."""
    from labsupport.models import random_tokens, tiny_gpt
    from labsupport.parallel.data_parallel import DistributedDataParallel

    runs = {}
    for name, wrap in (("ours", DistributedDataParallel),
                       ("torch", torch.nn.parallel.DistributedDataParallel)):  # fmt: skip
        model = tiny_gpt(0, **CONFIG)
        ddp = wrap(model, bucket_cap_mb=1)
        runs[name] = (ddp, torch.optim.SGD(model.parameters(), lr=0.01))
    times = {name: [] for name in runs}
    for step in range(steps + 1):
        idx, targets = random_tokens(BATCH, CONFIG["block_size"], 256, seed=step)
        for name, (ddp, opt) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            ddp(idx, targets)[1].backward()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step:  # the first step warms up
                times[name].append(elapsed.item())
    return times if dist.get_rank() == 0 else None


def main() -> int:
    from labsupport import launch

    times = launch(alternate, WORLD, args=(STEPS,), timeout=900)[0]
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    tokens = WORLD * BATCH * CONFIG["block_size"]
    print(f"\ndata-parallel training step of the course GPT on {WORLD} ranks (gloo, CPU), "
          f"{STEPS} alternating steps each, 1 MiB buckets")  # fmt: skip
    print(f"{'implementation':44s} {'median':>9s} {'tokens/s':>9s} {'x torch':>8s}")
    for name, label in (("torch", "torch.nn.parallel.DistributedDataParallel"),
                        ("ours", "labsupport DistributedDataParallel")):  # fmt: skip
        print(f"{label:44s} {medians[name] * 1e3:7.1f}ms {tokens / medians[name]:9.0f} "
              f"{medians['torch'] / medians[name]:7.2f}x")  # fmt: skip
    ratio = statistics.median(t / o for t, o in zip(times["torch"], times["ours"], strict=True))
    ok = ratio >= 0.9
    print(f"\ntarget: throughput >= 0.9x torch's -> {ratio:.2f}x ({'met' if ok else 'MISSED'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

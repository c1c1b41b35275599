"""Bucketed data parallelism from scratch vs torch's DistributedDataParallel, and both
against chapter 10's overlap limit.

4 ranks, the course GPT (4 layers, d = 128, 128 tokens of context), 1 MiB buckets. In one
launch, round after round: a training step (forward, backward with the bucketed
all-reduces, SGD step) of ours, one of torch's, and the same step of the bare model with
no communication, its forward, backward and optimizer step timed apart; each from a
barrier to the slowest rank's end, the first round a warm-up. Before the rounds, torch's
all-reduce is timed at sizes around a bucket's and ``t = a + b * bytes`` fitted
(:func:`labsupport.comm.cost.fit_alpha_beta`). The floor of a round:
:func:`bench.floors.ddp_floor_seconds`, the compute of that round plus what the buckets'
all-reduces cannot hide (at least the last bucket). Target (issue 10): the from-scratch
version's throughput at least 0.9x torch's, the median of the rounds' paired ratios.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from bench import floors, report

WORLD, ROUNDS, BATCH, BUCKET_MB = 4, 30, 4, 1
CONFIG = {"vocab_size": 256, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 128}
SIZES = tuple(2**k for k in range(12, 23, 2))  # 4 KiB ... 4 MiB


def alternate(rounds: int) -> dict | None:
    """Train ours, torch's and the bare model in turns; rank 0 returns the times, the
    compute's parts, the buckets' bytes and the fitted ``a``, ``b``."""
    from labsupport.comm.cost import fit_alpha_beta
    from labsupport.comm.measure import time_all_reduce
    from labsupport.models import random_tokens, tiny_gpt
    from labsupport.parallel.data_parallel import DistributedDataParallel

    measured = time_all_reduce(SIZES, "torch", repeats=5)  # on rank 0; None elsewhere
    idx, targets = random_tokens(BATCH, CONFIG["block_size"], 256, seed=dist.get_rank())
    models = {}
    for name, wrap in (("ours", DistributedDataParallel),
                       ("torch", torch.nn.parallel.DistributedDataParallel),
                       ("compute", None)):  # fmt: skip
        model = tiny_gpt(0, **CONFIG)
        module = model if wrap is None else wrap(model, bucket_cap_mb=BUCKET_MB)
        models[name] = (module, torch.optim.SGD(model.parameters(), lr=0.01))
    parts = []

    def step(name):
        module, opt = models[name]
        opt.zero_grad()
        if name != "compute":
            module(idx, targets)[1].backward()
            opt.step()
            return
        start = time.perf_counter()
        loss = module(idx, targets)[1]
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        opt.step()
        parts.append([forward - start, backward - forward, time.perf_counter() - backward])

    runs = {name: report.slowest(lambda name=name: step(name)) for name in models}
    times = report.in_turns(runs, rounds, warmup=1)
    slowest_parts = torch.tensor(parts[1:])
    dist.all_reduce(slowest_parts, op=dist.ReduceOp.MAX)
    if dist.get_rank():
        return None
    a, b = fit_alpha_beta([m["bytes"] for m in measured], [m["seconds"] for m in measured])
    buckets = [bucket.nbytes for bucket in models["ours"][0].buckets]
    return times | {"parts": slowest_parts.tolist(), "buckets": buckets, "a": a, "b": b}


def summarise(out: dict) -> list[dict]:
    """The bench's lines from the rounds' times, parts, buckets and ``a``, ``b``."""
    floor = [
        floors.ddp_floor_seconds(out["buckets"], f, b, o, out["a"], out["b"])
        for f, b, o in out["parts"]
    ]
    last = out["buckets"][-1]
    described = (
        f"one rank's forward, backward and SGD step without communication (median "
        f"{statistics.median(map(sum, out['parts'])) * 1e3:.1f} ms) plus what chapter 10's "
        f"overlap model cannot hide of {len(out['buckets'])} buckets' all-reduces at "
        f"a + b x bytes, a = {out['a'] * 1e6:.0f} us, 1/b = {1 / out['b'] / 1e9:.2f} GB/s "
        f"(fitted in this run), at least the last bucket's {last:,} bytes; median "
        f"{statistics.median(floor) * 1e3:.1f} ms"
    )
    tokens = WORLD * BATCH * CONFIG["block_size"]
    lines = []
    for name, label in (("torch", "torch.nn.parallel.DistributedDataParallel"),
                        ("ours", "labsupport DistributedDataParallel")):  # fmt: skip
        vs = None if name == "torch" else ("torch", throughput(out))
        detail = f"{tokens / statistics.median(out[name]):,.0f} tokens/s"
        lines.append(report.timed(label, out[name], floor, described, vs, detail))
    return lines


def throughput(out: dict) -> report.Ratio:
    """Ours' throughput over torch's: torch's step time over ours', round by round."""
    return report.paired(out["torch"], out["ours"])


def main() -> int:
    from labsupport import launch

    out = launch(alternate, WORLD, args=(ROUNDS,), timeout=900)[0]
    print(
        f"\ndata-parallel training step of the course GPT on {WORLD} ranks (gloo, CPU), "
        f"{BUCKET_MB} MiB buckets, {ROUNDS} rounds of ours, torch's and the bare model in turns"
    )
    lines = summarise(out)
    report.print_lines(lines, "throughput x torch")
    ratio = throughput(out)
    targets = [report.target("throughput >= 0.9x torch's", str(ratio), ratio.median >= 0.9)]
    config = {"world": WORLD, "config": CONFIG, "batch_per_rank": BATCH,
              "bucket_cap_mb": BUCKET_MB, "rounds": ROUNDS}  # fmt: skip
    return report.record("ddp", config, lines, targets)


if __name__ == "__main__":
    sys.exit(main())

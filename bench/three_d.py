"""3D parallelism (data 2 x tensor 2 x pipeline 2, ZeRO-1 on the data axis, 1F1B) on 8
ranks against one process, on the same global batch, and against lab 11's model.

The course GPT (4 layers, d = 128, 64 tokens of context), a global batch of 16 sequences
in 2 micro-batches per data-parallel rank. A round is one launch of 8 ranks that trains
1 + STEPS steps with ``train_3d``, then one launch of one rank (the same settings) that
trains the same model on the same batches with plain Adam; the first step of each warms
up. A 3D step is timed on every rank, from one pipeline step's start to the next's, and
the slowest rank counts; the round's figure is the median step of each launch, and the
ratio is the median over ROUNDS rounds of the paired ratios.

The floor: lab 11's model, the 1F1B schedule played by the simulator with each pipeline
stage's measured forward and backward times (the median over its ranks, tensor-parallel
all-reduces inside) and free messages. What is above it: the messages between the
stages, ZeRO-1's step and all-gather, the loss's all-reduce. On a 2-core machine the 8
ranks share two cores: the 3D step is expected to be slower than one process (issue 12
reports the ratio, with no target).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch
import torch.distributed as dist

from bench import floors, report

CONFIG = {"vocab_size": 256, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}
DP = TP = PP = 2
BATCH, MICROBATCHES, STEPS, ROUNDS = 16, 2, 6, 7


@contextlib.contextmanager
def pipeline_steps():
    """Record each call of ``pipeline_parallel.run`` (one per training step): its start
    on this rank's clock and its actions' times."""
    from labsupport.parallel import pipeline_parallel

    calls, original = [], pipeline_parallel.run

    def run(*args, **kwargs):
        start = time.perf_counter()
        out = original(*args, **kwargs)
        calls.append((start, out["events"]))
        return out

    pipeline_parallel.run = run
    try:
        yield calls
    finally:
        pipeline_parallel.run = original


def three_d(steps: int) -> dict | None:
    """``train_3d`` for ``steps`` steps on every rank; rank 0 returns the median step of
    the slowest rank and each pipeline stage's median forward and backward seconds."""
    from labsupport.parallel.hybrid import train_3d
    from labsupport.parallel.parallel_state import Mesh

    with pipeline_steps() as calls:
        dist.barrier()
        train_3d(CONFIG, DP, TP, PP, MICROBATCHES, steps, BATCH)
        end = time.perf_counter()
    starts = [start for start, _ in calls] + [end]
    seconds = torch.tensor([b - a for a, b in zip(starts[:-1], starts[1:], strict=True)][1:])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    _, events = calls[-1]
    compute = {
        kind: statistics.median(e - b for a, b, e in events if a.kind == kind)
        for kind in ("forward", "backward")
    }
    mine = (Mesh(DP, TP, PP).coords(dist.get_rank())["pp"], compute)
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, mine)
    if dist.get_rank():
        return None
    per_stage = {
        kind: [statistics.median(c[kind] for s, c in stages if s == p) for p in range(PP)]
        for kind in ("forward", "backward")
    }
    return {"step": statistics.median(seconds.tolist()), **per_stage}


def single(steps: int) -> float:
    """The same training in one process with plain Adam (``hybrid.train_single``'s
    model, optimizer and batches); the median step after the first."""
    from labsupport.models import GPT, GPTConfig, train_one_process
    from labsupport.parallel.hybrid import global_batch

    cfg = GPTConfig(**CONFIG)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    seconds = []
    for step in range(steps):
        start = time.perf_counter()
        train_one_process(model, opt, [global_batch(step, BATCH, cfg)])
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def summarise(rounds: dict) -> list[dict]:
    """The bench's lines from each round's 3D result and single-process step."""
    steps = [r["step"] for r in rounds["3d"]]
    floor = [
        floors.pipeline_floor_seconds(MICROBATCHES, r["forward"], r["backward"])
        for r in rounds["3d"]
    ]
    return [
        report.line("one process, plain Adam", statistics.median(rounds["single"]), "s"),
        report.line(
            f"8 ranks: DP {DP} x TP {TP} x PP {PP}, 1F1B",
            statistics.median(steps),
            "s",
            of_floor=report.paired(steps, floor),
            floor=f"lab 11's model: 1F1B on {PP} stages, {MICROBATCHES} micro-batches, the "
            "stages' measured forward and backward times, free messages; median "
            f"{statistics.median(floor) * 1e3:.1f} ms",
            vs=("one process", report.paired(steps, rounds["single"])),
        ),
    ]


def main() -> int:
    from labsupport import launch

    runs = {
        "3d": lambda: launch(three_d, DP * TP * PP, args=(1 + STEPS,), timeout=900)[0],
        "single": lambda: launch(single, 1, args=(1 + STEPS,), timeout=900)[0],
    }
    rounds = report.in_turns(runs, ROUNDS)
    print(
        f"\none training step of the course GPT ({CONFIG['n_layer']} layers, d = "
        f"{CONFIG['n_embd']}), global batch {BATCH} x {CONFIG['block_size']} tokens; "
        f"{ROUNDS} rounds of {STEPS} steps each, in turns"
    )
    lines = summarise(rounds)
    report.print_lines(lines, "x one process")
    print("(reported, no target: 8 ranks share this machine's cores)")
    config = {"config": CONFIG, "dp": DP, "tp": TP, "pp": PP, "batch": BATCH,
              "microbatches": MICROBATCHES, "steps": STEPS, "rounds": ROUNDS}  # fmt: skip
    return report.record("three_d", config, lines, [])


if __name__ == "__main__":
    sys.exit(main())

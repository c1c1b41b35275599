"""3D parallelism (data 2 x tensor 2 x pipeline 2, ZeRO-1 on the data axis, 1F1B) on 8
ranks against one process, on the same global batch.

The course GPT (4 layers, d = 128, 64 tokens of context), a global batch of 16 sequences
in 2 micro-batches per data-parallel rank. A step's time is the difference between a run
of 1 + STEPS steps and a run of 1 step, divided by STEPS, so that setting up the model,
the process groups and the first step's warm-up cancel out; each run is timed inside the
ranks from a barrier to the slowest rank's end. The single process (a launch of one rank,
so that it runs under the same settings) trains the same model on the same batches with
plain Adam, timed the same way; the two alternate, round after round. On a 2-core machine the 8
ranks share two cores and every message crosses loopback: the 3D step is expected to be
slower (issue 12 reports the ratio, with no target).
"""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

CONFIG = {"vocab_size": 256, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}
DP = TP = PP = 2
BATCH, MICROBATCHES, STEPS, ROUNDS = 16, 2, 4, 3


def timed(kind: str, steps: int) -> float | None:
    """Seconds of ``steps`` training steps, from a barrier to the slowest rank's end, with
    ``train_3d`` on every rank (``kind="3d"``) or ``train_single`` on a world of one;
    rank 0 returns them."""
    import torch

    from labsupport.parallel.hybrid import train_3d, train_single

    dist.barrier()
    start = time.perf_counter()
    if kind == "3d":
        train_3d(CONFIG, DP, TP, PP, MICROBATCHES, steps, BATCH)
    else:
        train_single(CONFIG, steps, BATCH)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item() if dist.get_rank() == 0 else None


def step_time(kind: str) -> float:
    """One step's seconds: a run of 1 + STEPS steps minus a run of 1, over STEPS."""
    from labsupport import launch

    world = DP * TP * PP if kind == "3d" else 1
    long, short = (launch(timed, world, args=(kind, n), timeout=900)[0] for n in (1 + STEPS, 1))
    return (long - short) / STEPS


def main() -> int:
    three_d, single = [], []
    for _ in range(ROUNDS):  # alternate, so that both see the same machine load
        three_d.append(step_time("3d"))
        single.append(step_time("single"))
    ratios = sorted(t / s for t, s in zip(three_d, single, strict=True))
    tokens = BATCH * CONFIG["block_size"]
    print(
        f"\none training step of the course GPT ({CONFIG['n_layer']} layers, "
        f"d = {CONFIG['n_embd']}), global batch {BATCH} x {CONFIG['block_size']} tokens, "
        f"{ROUNDS} rounds"
    )
    print(f"{'run':46s} {'median step':>12s} {'tokens/s':>9s}")
    for label, times in (
        ("one process, plain Adam", single),
        (f"8 ranks: DP {DP} x TP {TP} x PP {PP}, ZeRO-1, 1F1B", three_d),
    ):
        median = sorted(times)[len(times) // 2]
        print(f"{label:46s} {median * 1e3:10.1f}ms {tokens / median:9.0f}")
    print(
        f"\n3D step / single-process step, median over rounds: {ratios[len(ratios) // 2]:.2f}x "
        "(reported, no target: 8 ranks share this machine's cores)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

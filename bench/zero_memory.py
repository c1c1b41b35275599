"""ZeRO-3 memory per rank at 4 ranks against the formula (issue 12's target: within 5 %).

The course GPT (4 layers, d = 256, vocabulary 1,000: 3.4 M parameters), trained for 2
steps with labsupport.parallel.zero at each stage on 4 ranks. After the last backward
pass every rank measures, from the tensors it holds, its bytes of parameters, gradients
and Adam's states, and holds them against the ZeRO paper's formula for fp32 Adam (4 bytes
each for weights, gradients, momentum and variance, sharded by stage). For stage 3 it also
reports what a step adds for a moment: the largest unit's gathered weights.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

CONFIG = {"vocab_size": 1000, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 256}
WORLD, STEPS, BATCH, TARGET = 4, 2, 8, 0.05


def measure(stage: int) -> dict:
    """This rank's model-state bytes after the last backward pass under ZeRO ``stage``."""
    from labsupport.models import random_tokens, tiny_gpt
    from labsupport.parallel.zero import ZeRO

    model = tiny_gpt(0, **CONFIG)
    zero = ZeRO(model, stage, lr=1e-3)
    rank = dist.get_rank()
    for step in range(STEPS):
        idx, targets = random_tokens(BATCH, CONFIG["block_size"], CONFIG["vocab_size"], step)
        share = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        zero.zero_grad()
        model(idx[share], targets[share])[1].backward()
        held = zero.state_bytes()
        zero.step()
    largest_unit = max(u.padded for _, u in zero.units) * 4
    return {
        "held": held,
        "numel": sum(p.numel() for p in model.parameters()),
        "largest_unit": largest_unit,
    }


def run_all() -> dict:
    return {stage: measure(stage) for stage in (1, 2, 3)}


def main() -> int:
    from labsupport import launch
    from labsupport.estimate.memory import training_memory

    ranks = launch(run_all, WORLD, timeout=900)
    numel = ranks[0][3]["numel"]
    print(
        f"\nmodel states per rank, {numel:,} parameters, fp32 Adam, {WORLD} ranks "
        "(measured from the tensors each rank holds after backward)"
    )
    print(f"{'stage':>5s} {'rank':>4s} {'measured':>12s} {'formula':>12s} {'off by':>8s}")
    worst = 0.0
    for stage in (1, 2, 3):
        formula = sum(training_memory(numel, "fp32", stage, WORLD).values())
        for rank, by_stage in enumerate(ranks):
            measured = sum(by_stage[stage]["held"].values())
            off = measured / formula - 1
            if stage == 3:
                worst = max(worst, abs(off))
            print(f"{stage:5d} {rank:4d} {measured:12,d} {formula:12,.0f} {off:+8.3%}")
    unsharded = sum(training_memory(numel, "fp32", 0, 1).values())
    gathered = ranks[0][3]["largest_unit"]
    zero3 = sum(training_memory(numel, "fp32", 3, WORLD).values())
    print(
        f"\nwithout ZeRO each rank would hold {unsharded:,.0f} bytes; ZeRO-3 gathers at most "
        f"{gathered:,} bytes more for a moment (the largest unit's weights): a peak "
        f"{(zero3 + gathered) / zero3 - 1:.0%} above the formula, activations apart"
    )
    ok = worst <= TARGET
    print(
        f"target: ZeRO-3 within {TARGET:.0%} of the formula on every rank -> "
        f"worst {worst:.3%} ({'met' if ok else 'MISSED'})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

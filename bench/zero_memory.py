"""ZeRO's memory and traffic per rank at 4 ranks, against the paper's formulas (issue 12's
target: ZeRO-3's memory within 5 % of its formula).

The course GPT (4 layers, d = 256, vocabulary 1,000: 3.4 M parameters), trained for 2
steps with labsupport.parallel.zero at each stage on 4 ranks. After the last backward
pass every rank measures, from the tensors it holds, its bytes of parameters, gradients
and Adam's states, and holds them against the ZeRO paper's formula for fp32 Adam (4 bytes
each for weights, gradients, momentum and variance, sharded by stage): the floor of what
a rank must hold. The last step's collectives are traced (:mod:`labsupport.comm.traced`)
and the bytes each rank sends for the model states held against the paper's 2 Psi
(stages 1 and 2) or 3 Psi (stage 3) times (N-1)/N, Psi the parameters as sharded, padding
included (the all-reduce of which parameters got a gradient, one byte per tensor, apart).
For stage 3 it also reports what a step adds for a moment: the largest unit's gathered
weights. Each line's ratio is the median over the 4 ranks, with the smallest and largest.
"""

from __future__ import annotations

import statistics
import sys

import torch.distributed as dist

from bench import floors, report

CONFIG = {"vocab_size": 1000, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 256}
WORLD, STEPS, BATCH, TARGET = 4, 2, 8, 0.05


def measure(stage: int) -> dict:
    """This rank's model-state bytes after the last backward pass under ZeRO ``stage``,
    and the bytes it sent for them in the last step."""
    from labsupport.comm import traced
    from labsupport.models import random_tokens, tiny_gpt
    from labsupport.parallel.zero import ZeRO

    model = tiny_gpt(0, **CONFIG)
    zero = ZeRO(model, stage, lr=1e-3)
    rank = dist.get_rank()
    for step in range(STEPS):
        idx, targets = random_tokens(BATCH, CONFIG["block_size"], CONFIG["vocab_size"], step)
        share = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        zero.zero_grad()
        with traced.trace_collectives() as trace:
            model(idx[share], targets[share])[1].backward()
            held = zero.state_bytes()
            zero.step()
    states = traced.Trace([c for c in trace.calls if c[0] != "all_reduce"])
    return {
        "held": sum(held.values()),
        "sent": traced.bytes_per_rank(states),
        "numel": sum(p.numel() for p in model.parameters()),
        "padded": sum(u.padded for _, u in zero.units),
        "largest_unit": max(u.padded for _, u in zero.units) * 4,
    }


def run_all() -> dict:
    return {stage: measure(stage) for stage in (1, 2, 3)}


def summarise(ranks: list[dict]) -> list[dict]:
    """The bench's lines: per stage, the bytes held and the bytes sent, over the ranks."""
    from labsupport.estimate.memory import training_memory

    lines = []
    for stage in (1, 2, 3):
        got = [r[stage] for r in ranks]
        held = sum(training_memory(got[0]["numel"], "fp32", stage, WORLD).values())
        sent = floors.zero_traffic_bytes(got[0]["padded"], stage, WORLD)
        psi = "3 Psi" if stage == 3 else "2 Psi"
        for what, key, floor, text in (
            ("held", "held", held, f"the paper's model states per rank, {held:,.0f} B"),
            ("sent", "sent", sent, f"{psi} x (N-1)/N of the sharded parameters, {sent:,.0f} B"),
        ):
            values = [g[key] for g in got]
            lines.append(
                report.line(
                    f"ZeRO-{stage}, bytes {what} per rank",
                    statistics.median(values),
                    "B",
                    of_floor=report.ratios((v / floor for v in values), "ranks"),
                    floor=text,
                )
            )
    return lines


def main() -> int:
    from labsupport import launch
    from labsupport.estimate.memory import training_memory

    ranks = launch(run_all, WORLD, timeout=900)
    numel = ranks[0][3]["numel"]
    print(
        f"\nmodel states per rank, {numel:,} parameters, fp32 Adam, {WORLD} ranks: bytes held "
        "after backward (measured from the tensors) and bytes sent in a step (traced)"
    )
    lines = summarise(ranks)
    report.print_lines(lines)
    unsharded = sum(training_memory(numel, "fp32", 0, 1).values())
    gathered = ranks[0][3]["largest_unit"]
    zero3 = sum(training_memory(numel, "fp32", 3, WORLD).values())
    print(
        f"without ZeRO each rank would hold {unsharded:,.0f} bytes; ZeRO-3 gathers at most "
        f"{gathered:,} bytes more for a moment (the largest unit's weights): a peak "
        f"{(zero3 + gathered) / zero3 - 1:.0%} above the formula, activations apart"
    )
    worst = max(abs(r[3]["held"] / zero3 - 1) for r in ranks)
    targets = [
        report.target(
            f"ZeRO-3 within {TARGET:.0%} of the formula on every rank",
            f"worst {worst:.3%}",
            worst <= TARGET,
        )
    ]
    config = {"config": CONFIG, "world": WORLD, "steps": STEPS, "batch": BATCH}
    return report.record("zero_memory", config, lines, targets)


if __name__ == "__main__":
    sys.exit(main())

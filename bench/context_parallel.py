"""Ring attention on 4 ranks against one process's scaled_dot_product_attention (issue 21).

Time: causal attention over one sequence of 2,048 tokens, 8 heads of dimension 64, forward
and backward, by ring attention (zig-zag) on 4 ranks and by ``scaled_dot_product_attention``
in one process (a launch of one rank, so that both run under the same settings), each timed
inside the ranks from a barrier to the slowest rank's end, the best of REPEATS runs; the two
alternate, round after round; the ratio is the median of the rounds' pairs. Reported,
with no target: 4 ranks share this machine's cores, and the ring's blocks are written out
in PyTorch where SDPA is one fused kernel. The floor: the one process's work spread
without loss over the cores the 4 ranks can use (:func:`bench.floors.
shared_cores_floor_seconds`; on a machine others load, the ranks, being more processes,
get a larger share of its cores and can pass it).

Memory: the peak of the bytes alive during one training step's forward and backward pass
(:class:`labsupport.measure.memory.LiveMemory`) of the course GPT (4 layers, d = 256) on one
sequence of 1,024 tokens, per rank with context parallelism 4 (ring attention) against one
process (the GPT's own SDPA). The weights and their gradient buffers exist before the step,
as in a training loop that keeps them. The floor: 1/cp of one process's peak. Target:
at most 1.1x the floor, 0.275 of one process's, on every rank.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from bench import floors, report

SEQ, HEADS, HEAD_DIM, REPEATS, ROUNDS = 2048, 8, 64, 3, 5
CONFIG = {"vocab_size": 256, "block_size": 1024, "n_layer": 4, "n_head": 4, "n_embd": 256}
CP, TARGET = 4, 1.1 / 4


def attention_seconds() -> tuple | None:
    """Best of REPEATS: seconds of one causal attention forward and backward over the
    whole sequence, ring attention on every rank (or SDPA on a world of one), and the
    threads each rank computes with."""
    import torch.nn.functional as F

    from labsupport.parallel.context_parallel import ring_attention, shard_sequence

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, SEQ, HEAD_DIM, generator=g) for _ in range(3))
    if dist.get_world_size() > 1:
        q, k, v = (shard_sequence(t, 2) for t in (q, k, v))
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    times = []
    for _ in range(REPEATS + 1):  # the first is a warm-up
        dist.barrier()
        start = time.perf_counter()
        if dist.get_world_size() > 1:
            out = ring_attention(*leaves)
        else:
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        out.sum().backward()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return (min(times[1:]), torch.get_num_threads()) if dist.get_rank() == 0 else None


def step_peak() -> int:
    """This rank's peak bytes alive in one forward and backward pass of the GPT, on its
    share of one sequence (the whole sequence on a world of one)."""
    from labsupport.measure.memory import LiveMemory
    from labsupport.models import random_tokens, tiny_gpt
    from labsupport.parallel.context_parallel import shard_sequence
    from labsupport.parallel.context_parallel_model import ContextParallelGPT

    model = tiny_gpt(0, **CONFIG)
    idx, targets = random_tokens(1, CONFIG["block_size"], CONFIG["vocab_size"], seed=1)
    if dist.get_world_size() > 1:
        model = ContextParallelGPT(model)
        idx, targets = (shard_sequence(t, 1) for t in (idx, targets))
    model(idx, targets)[1].backward()  # warm-up; allocates the gradients' buffers
    with LiveMemory() as memory:
        model(idx, targets)[1].backward()
    return memory.peak


def summarise(ring: list, single: list, one: int, per_rank: list, cores: int) -> list[dict]:
    """The bench's lines from the rounds' ``(seconds, threads)`` and the peak bytes."""
    floor = [
        floors.shared_cores_floor_seconds(s, s_threads, CP, r_threads, cores)
        for (s, s_threads), (_, r_threads) in zip(single, ring, strict=True)
    ]
    ring_s, single_s = [r for r, _ in ring], [s for s, _ in single]
    return [
        report.line("one process, scaled_dot_product_attention", statistics.median(single_s), "s"),
        report.line(
            f"{CP} ranks, ring attention (zig-zag)",
            statistics.median(ring_s),
            "s",
            of_floor=report.paired(ring_s, floor),
            floor=f"the one process's time, its threads spread over the {cores} cores "
            f"{CP} ranks of {ring[0][1]} thread(s) can use; median "
            f"{statistics.median(floor) * 1e3:.1f} ms",
            vs=("one process", report.paired(ring_s, single_s)),
        ),
        report.line(
            f"cp={CP}, peak bytes alive per rank",
            statistics.median(per_rank),
            "B",
            of_floor=report.ratios((p / (one / CP) for p in per_rank), "ranks"),
            floor=f"1/cp of one process's peak ({one:,} B), {one / CP:,.0f} B",
        ),
    ]


def main() -> int:
    from labsupport import launch
    from labsupport.measure.probe import usable_cores

    runs = {
        "ring": lambda: launch(attention_seconds, CP, timeout=900)[0],
        "single": lambda: launch(attention_seconds, 1, timeout=900)[0],
    }
    rounds = report.in_turns(runs, ROUNDS)
    one = launch(step_peak, 1, timeout=900)[0]
    per_rank = launch(step_peak, CP, timeout=900)
    print(
        f"\ncausal attention, forward and backward: one sequence of {SEQ} tokens, {HEADS} heads "
        f"of {HEAD_DIM}, best of {REPEATS}, {ROUNDS} rounds in turns; peak bytes alive in a "
        f"training step of the course GPT ({CONFIG['n_layer']} layers, d = {CONFIG['n_embd']}), "
        f"one sequence of {CONFIG['block_size']} tokens"
    )
    lines = summarise(rounds["ring"], rounds["single"], one, per_rank, usable_cores())
    report.print_lines(lines, "x one process")
    print("(time reported, no target: the ranks share this machine's cores)")
    worst = max(per_rank) / one
    targets = [
        report.target(
            f"every rank at most 1/cp + 10 % = {TARGET:.3f} of one process's peak",
            f"worst {worst:.3f}",
            worst <= TARGET,
        )
    ]
    config = {"seq": SEQ, "heads": HEADS, "head_dim": HEAD_DIM, "cp": CP, "rounds": ROUNDS,
              "repeats": REPEATS, "gpt": CONFIG}  # fmt: skip
    return report.record("context_parallel", config, lines, targets)


if __name__ == "__main__":
    sys.exit(main())

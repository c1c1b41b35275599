"""Ring attention on 4 ranks against the same ranks' compute with no messages, and against
one process's scaled_dot_product_attention (issue 21).

Time: causal attention over one sequence of 2,048 tokens, 8 heads of dimension 64, forward
and backward. In one launch of 4 ranks, in turns, REPEATS rounds after a warm-up: ring
attention (zig-zag), and its floor, :func:`local_ring`, each rank's share of the ring's
compute with the messages taken away (the same blocks, merges and gradient sums, on
copies of the K/V chunks the ring would bring, made before the clock starts); each from a
barrier to the slowest rank's end. Load on the machine lands on both alike, so the ring
over its floor, the median of the rounds' pairs, is at least 1 but for noise at any load,
and what it has above 1 is the messages and the waiting for them. That launch alternates
with one process's ``scaled_dot_product_attention`` (a launch of one rank, so that both
run under the same settings), ROUNDS rounds; the ratio to it is the median of the pairs
of the two launches' median times. Both reported, with no target: 4 ranks share this
machine's cores, and the ring's blocks are written out in PyTorch where SDPA is one fused
kernel.

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

import torch
import torch.distributed as dist

from bench import report

SEQ, HEADS, HEAD_DIM, REPEATS, ROUNDS = 2048, 8, 64, 5, 5
CONFIG = {"vocab_size": 256, "block_size": 1024, "n_layer": 4, "n_head": 4, "n_embd": 256}
CP, TARGET = 4, 1.1 / 4


def local_ring(q, kvs, rank: int, lay):
    """Rank ``rank``'s share of :func:`~labsupport.parallel.context_parallel.ring_attention`'s
    compute under the layout ``lay``, causal, forward and backward (the gradient of
    ``out.sum()``), with no messages: where the ring has received rank ``src``'s K and V,
    this computes with ``kvs[src]`` (K and V stacked, copies made beforehand). The ring's
    blocks, merges and sums of the travelling K/V gradients, in its order; returns this
    rank's output and its queries' gradient."""
    from labsupport.parallel.blockwise_attention import backward_step, forward_step
    from labsupport.parallel.context_parallel import empty_result

    mine, sources = lay.chunks[rank], [(rank - step) % lay.cp for step in range(lay.cp)]
    out, lse = empty_result(q)
    state = [out, lse, [False] * len(mine)]
    for src in sources:
        forward_step(q, kvs[src], mine, lay.chunks[src], True, state)
    dout = out.new_ones(()).expand(out.shape)  # out.sum()'s gradient, as autograd passes it
    stats = ((dout * out).sum(-1), lse)
    dq, own, travelling = torch.zeros(q.shape, dtype=torch.float32, device=q.device), None, None
    for src in sources:
        dkv = backward_step(dout, q, kvs[src], stats, mine, lay.chunks[src], True, dq)
        if src == rank:
            own = dkv
        else:  # the ring adds each arriving gradient to this rank's before passing it on
            travelling = dkv if travelling is None else dkv + travelling
    own = own if travelling is None else own + travelling
    return out, dq


def attention_seconds() -> dict | None:
    """REPEATS rounds, after a warm-up, of one causal attention forward and backward over
    the whole sequence, each from a barrier to the slowest rank's end: on a world of one,
    SDPA; on several, ring attention and, in turns with it, its floor (``"floor"``,
    :func:`local_ring`). Rank 0 returns the seconds, ``{"step": [...], ...}``."""
    import torch.nn.functional as F

    from labsupport.launch.runtime import device
    from labsupport.parallel.context_parallel import Layout, ring_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, SEQ, HEAD_DIM, generator=g).to(device()) for _ in range(3))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        sdpa = F.scaled_dot_product_attention
        runs = {"step": lambda: sdpa(*leaves, is_causal=True).sum().backward()}
    else:
        lay = Layout.zigzag(world)
        at = [lay.positions(r, SEQ).to(device()) for r in range(world)]
        leaves = [t.index_select(2, at[rank]).requires_grad_(True) for t in (q, k, v)]
        kvs = [torch.stack([k, v]).index_select(3, at[src]) for src in range(world)]
        mine = leaves[0].detach()
        runs = {
            "step": lambda: ring_attention(*leaves).sum().backward(),
            "floor": lambda: local_ring(mine, kvs, rank, lay),
        }
    timed = {name: report.slowest(fn) for name, fn in runs.items()}
    times = report.in_turns(timed, REPEATS, warmup=1)
    return times if rank == 0 else None


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


def summarise(cp: list, single: list, one: int, per_rank: list) -> list[dict]:
    """The bench's lines from the rounds' launches' seconds and the peak bytes."""
    names = ("one process, scaled_dot_product_attention", f"{CP} ranks, ring attention (zig-zag)")
    floor = (
        "each rank's share of the ring's compute with no messages (its blocks on copies of "
        "the K/V chunks the ring would bring), timed in turns with the ring"
    )
    return [
        *report.against_floor(names, cp, [r["step"] for r in single], floor),
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

    runs = {
        "cp": lambda: launch(attention_seconds, CP, timeout=900)[0],
        "single": lambda: launch(attention_seconds, 1, timeout=900)[0],
    }
    rounds = report.in_turns(runs, ROUNDS)
    one = launch(step_peak, 1, timeout=900)[0]
    per_rank = launch(step_peak, CP, timeout=900)
    print(
        f"\ncausal attention, forward and backward: one sequence of {SEQ} tokens, {HEADS} heads "
        f"of {HEAD_DIM}; {ROUNDS} rounds of a launch of {CP} ranks (the ring and its floor in "
        f"turns, {REPEATS} times each) and one of one process ({REPEATS} times); peak bytes in a "
        f"training step of the course GPT ({CONFIG['n_layer']} layers, d = {CONFIG['n_embd']}), "
        f"one sequence of {CONFIG['block_size']} tokens"
    )
    lines = summarise(rounds["cp"], rounds["single"], one, per_rank)
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

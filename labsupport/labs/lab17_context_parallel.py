"""Lab 17, context parallelism: ring attention step by step on 4 ranks, the causal work
per rank with and without zig-zag, the three variants' bytes against their formulas,
activations per rank against cp, and the exercises' checkers.

The exercises' checkers are in :mod:`labsupport.labs.lab17_exercises`. The attention is
:mod:`labsupport.parallel.context_parallel` (the ring),
:mod:`labsupport.parallel.context_parallel_variants` (all-gather, Ulysses) and
:mod:`labsupport.parallel.blockwise_attention` (one block, the merge); the GPT with
context parallelism :mod:`labsupport.parallel.context_parallel_model`; the formulas
:mod:`labsupport.estimate.context_parallel`; the drawings
:mod:`labsupport.viz.context_parallel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport.comm import p2p, traced
from labsupport.estimate import context_parallel as est
from labsupport.launch.runtime import device
from labsupport.measure.memory import SavedBytes
from labsupport.models import random_tokens, tiny_gpt
from labsupport.parallel import context_parallel as cp
from labsupport.parallel import context_parallel_model as cpm
from labsupport.parallel import context_parallel_variants as cpv
from labsupport.parallel.blockwise_attention import count_work

#: float32 attention over a few dozen keys, summed block by block in another order than
#: one process's kernel: differences of a few 1e-7; PyTorch's float32 tolerances
#: (``torch.testing.assert_close``: rtol 1.3e-6, atol 1e-5) hold them, and a wrong merge
#: or a missing block is off by 1e-2 or more.
TOL = {"rtol": 1.3e-6, "atol": 1e-5}

#: The GPT the lab trains and measures: 32 tokens, 8 per rank at cp = 4.
CONFIG = {"vocab_size": 64, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32}


def qkv(seq_len: int, heads: int = 4, kv_heads: int = 4, head_dim: int = 8, seed: int = 0):
    """One sequence's whole ``q, k, v`` and an output gradient, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, n, seq_len, head_dim) for n in (heads, kv_heads, kv_heads, heads)]
    return [torch.randn(s, generator=g).to(device()) for s in shapes]


def _close(a, b, tol=None) -> bool:
    return bool(torch.allclose(a.detach().cpu(), b.detach().cpu(), **(tol or TOL)))


def against_sdpa(attend, seq_len, causal, layout, q_scale=1.0, tol=None, **kw) -> dict:
    """Run ``attend(q, k, v, causal=, layout=, **kw)`` on this rank's tokens, forward
    and backward, and compare its output and gradients with
    ``scaled_dot_product_attention`` on the whole sequence (run on every rank), to
    ``tol`` (:data:`TOL` by default). ``q_scale`` multiplies the queries, and so the
    scores."""
    q, k, v, dout = qkv(seq_len)
    q = q * q_scale
    whole = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*whole, is_causal=causal)
    want.backward(dout)
    mine = [cp.shard_sequence(t, 2, layout=layout).requires_grad_(True) for t in (q, k, v)]
    out = attend(*mine, causal=causal, layout=layout, **kw)
    out.backward(cp.shard_sequence(dout, 2, layout=layout))
    pairs = [(out, want)] + [(a.grad, b.grad) for a, b in zip(mine, whole, strict=True)]
    same = [_close(got, cp.shard_sequence(w.detach(), 2, layout=layout), tol) for got, w in pairs]
    return dict(zip(["output", "dq", "dk", "dv"], same, strict=True))


# --------------------------------------------------------------------------- the ring


def ring_steps(seq_len: int = 16, layout: str = "zigzag") -> dict:
    """Ring attention on every rank, causal, with each step recorded: whose K/V the
    rank holds, which score blocks it computes, and for its last token (head 0) the
    running maximum and sum of the scores it has seen, and the log-sum-exp the ring
    keeps (which must be ``max + log(sum)``). Then the result against SDPA."""
    world, rank = dist.get_world_size(), dist.get_rank()
    lay = cp.make_layout(layout, world)
    q, k, v, _ = qkv(seq_len)
    position = int(lay.positions(rank, seq_len)[-1])  # this rank's last token
    scores = ((q[0, 0, position] @ k[0, 0].T) * q.size(-1) ** -0.5).cpu()
    mine = [cp.shard_sequence(t, 2, layout=lay) for t in (q, k, v)]
    steps, seen = [], torch.zeros(seq_len, dtype=torch.bool)

    def on_step(step, src, out, lse):
        done = sum(len(s["blocks"]) for s in steps)
        blocks = work.blocks[done:]  # the blocks computed at this step
        theirs = lay.positions(src, seq_len)
        seen[theirs[theirs <= position]] = True  # the keys this token may see
        best = scores[seen].max()
        steps.append(
            {
                "step": step,
                "rank": rank,
                "K/V of rank": src,
                "K/V chunks": lay.chunks[src],
                "blocks": [(b[4], b[5], b[3]) for b in blocks],
                "max": float(best),
                "sum": float(torch.exp(scores[seen] - best).sum()),
                "lse": float(lse[0, 0, -1]),
            }
        )

    with count_work() as work:
        cp.ring_attention(*mine, layout=lay, on_step=on_step)
    check = against_sdpa(cp.ring_attention, seq_len, True, lay)
    return {"steps": steps, "equal": all(check.values()), "position": position}


def step_rows(ranks: list) -> list[dict]:
    """The steps :func:`ring_steps` recorded on every rank, as table rows, step by step:
    a block is ``query chunk-key chunk``, ``d`` marking a diagonal (masked) block."""
    steps = sorted((s for r in ranks for s in r["steps"]), key=lambda s: (s["step"], s["rank"]))
    return [
        {
            "step": s["step"],
            "rank": s["rank"],
            "K/V of": s["K/V of rank"],
            "chunks": s["K/V chunks"],
            "blocks": " ".join(
                f"{a}-{b}{'d' if k == 'diagonal' else ''}" for a, b, k in s["blocks"]
            ),
            "max": f"{s['max']:.3f}",
            "sum": f"{s['sum']:.3f}",
            "lse": f"{s['lse']:.3f}",
        }
        for s in steps
    ]


def measured_schedule(ranks: list) -> list:
    """What :func:`ring_steps` counted, shaped as
    :func:`labsupport.parallel.context_parallel.ring_schedule`: ``[step][rank]`` is
    ``(src, blocks)``."""
    by = {(s["step"], s["rank"]): s for r in ranks for s in r["steps"]}
    n = len(ranks)
    return [[(by[i, r]["K/V of rank"], by[i, r]["blocks"]) for r in range(n)] for i in range(n)]


# --------------------------------------------------------------------------- the work


def causal_work(seq_len: int = 2048, heads: int = 8, head_dim: int = 32) -> dict:
    """The score blocks each rank computes in one causal forward pass, contiguous and
    zig-zag (counted by the kernels as they run), and the CPU seconds it spends in them
    forward and backward (the computing thread's time, not the wall clock's, which the
    ring's waiting and a busy machine would add to)."""
    found = {}
    warm = [
        cp.shard_sequence(t, 2).requires_grad_(True) for t in qkv(8 * dist.get_world_size())[:3]
    ]
    cp.ring_attention(*warm).sum().backward()
    for layout in ("contiguous", "zigzag"):
        q, k, v, dout = qkv(seq_len, heads, heads, head_dim)
        mine = [cp.shard_sequence(t, 2, layout=layout).requires_grad_(True) for t in (q, k, v)]
        with count_work() as work:
            out = cp.ring_attention(*mine, layout=layout)
            out.backward(cp.shard_sequence(dout, 2, layout=layout))
        unit = (seq_len // (2 * dist.get_world_size())) ** 2
        found[layout] = {
            "blocks": work.scores("forward") // unit,
            "cpu_s": sum(work.seconds.values()),
        }
    return found


# --------------------------------------------------------------------------- the bytes


def traffic(seq_len: int = 32, heads: int = 8) -> list[dict]:
    """Bytes this rank sends in one attention layer, forward and backward, and its
    messages (point-to-point) or collectives, for each variant, with as many K/V heads
    as query heads (MHA) and with half as many (grouped-query attention)."""
    rows = []
    for kv_heads in (heads, heads // 2):
        q, k, v, dout = qkv(seq_len, heads, kv_heads)
        for variant in cpm.VARIANTS:
            mine = [cp.shard_sequence(t, 2).requires_grad_(True) for t in (q, k, v)]
            with p2p.count_traffic() as sent, traced.trace_collectives() as calls:
                out = cpm.context_parallel_attention(*mine, variant=variant)
                forward = sent.bytes_sent + cpv.bytes_per_rank(calls)
                out.backward(cp.shard_sequence(dout, 2))
            rows.append(
                {
                    "variant": variant,
                    "K/V heads": kv_heads,
                    "forward": int(forward),
                    "total": int(sent.bytes_sent + cpv.bytes_per_rank(calls)),
                    "messages": len(sent.messages) or len(calls.calls),
                }
            )
    return rows


def traffic_formula(row: dict, seq_len: int = 32, heads: int = 8, cp_size: int = 4) -> dict:
    """:func:`labsupport.estimate.context_parallel.bytes_per_rank` for a row of
    :func:`traffic` (one sequence, head dimension 8, float32)."""
    return est.bytes_per_rank(row["variant"], 1, seq_len, heads, row["K/V heads"], 8, cp_size)


# --------------------------------------------------------------------------- the memory


def activations_per_rank() -> list[dict]:
    """The bytes autograd saves in the GPT's blocks for one sequence of 32 tokens, per
    rank, with the sequence over cp = 1, 2 and 4 ranks (groups of the 4 ranks; the
    others wait), measured with a saved-tensor hook."""
    rank, rows = dist.get_rank(), []
    idx, targets = random_tokens(1, CONFIG["block_size"], CONFIG["vocab_size"], seed=7)
    for size in (1, 2, 4):
        group = dist.new_group(list(range(size)))
        if rank >= size:
            continue
        model = cpm.ContextParallelGPT(tiny_gpt(0, **CONFIG).to(device()), group)
        mine = [cp.shard_sequence(t.to(device()), 1, group) for t in (idx, targets)]
        saved = SavedBytes(exclude=model)
        handles = saved.watch(model.gpt.h)
        model(*mine)[1].backward()
        for handle in handles:
            handle.remove()
        rows.append({"cp": size, "rank": rank, "tokens": mine[0].size(1), "bytes": saved.nbytes})
    return rows

"""Blockwise attention: attention computed one block of keys at a time, exactly.

A query's attention over all keys can be computed over blocks of keys separately and the
results merged, if each block's result keeps the log-sum-exp of its scores: the online
softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"), which
FlashAttention (Dao et al. 2022) runs over tiles in a GPU's SRAM and ring attention (Liu
et al. 2023) over chunks of the sequence on different devices.

* :func:`attention_block`: ``softmax(q·kᵀ·scale)·v`` over one block, with each query's
  log-sum-exp ``lse = max + log(sum)``;
* :func:`merge_attention`: two blocks' ``(out, lse)`` merged into the result over both;
* :func:`attention_block_backward`: one block's gradients from the *final* ``lse``
  (FlashAttention-2's backward, Dao 2023, algorithm 2);
* :func:`forward_step` and :func:`backward_step`: every block between one rank's chunks
  of queries and another rank's chunks of keys (a causal mask decides which blocks
  exist), as :mod:`labsupport.parallel.context_parallel` runs them at each step;
* :func:`count_work`: the score blocks computed, counted as they run.

Grouped-query attention (fewer K/V heads than query heads) is supported as
``torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)`` does it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch


def _relation(q_chunk: int, k_chunk: int, causal: bool):
    """How queries of one chunk see keys of another: all, causally (the same chunk), none."""
    if not causal or k_chunk < q_chunk:
        return "full"
    return "diagonal" if k_chunk == q_chunk else None


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: each K/V head serves ``heads / h_kv`` query heads
    (``repeat_interleave``, as ``scaled_dot_product_attention(enable_gqa=True)``)."""
    return t if t.size(-3) == heads else t.repeat_interleave(heads // t.size(-3), dim=-3)


def _scores(q, k, scale: float, diagonal: bool):
    s = (q @ _repeat_kv(k, q.size(-3)).transpose(-2, -1)) * scale
    if diagonal:  # the same chunk of queries and keys: key j hidden from query i < j
        n, m = s.shape[-2:]
        future = torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def attention_block(q, k, v, scale: float, diagonal: bool = False):
    """``softmax(q·kᵀ·scale)·v`` over this block's keys alone, and ``lse``: ``(out, lse)``.

    ``q`` is ``(batch, heads, n, d)``, ``k`` and ``v`` ``(batch, kv_heads, m, d)``.
    ``lse`` is each query's log-sum-exp of its scores, ``row_max + log(row_sum)``: the
    running maximum and sum of the online softmax (Milakov & Gimelshein 2018) in one
    number, all that merging needs.
    """
    s = _scores(q, k, scale, diagonal)
    row_max = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - row_max)
    row_sum = p.sum(dim=-1, keepdim=True)
    out = (p @ _repeat_kv(v, q.size(-3))) / row_sum
    return out, (row_max + row_sum.log()).squeeze(-1)


def merge_attention(out, lse, block_out, block_lse):
    """The online softmax: two attention results over disjoint sets of keys, merged
    into the result over their union, exactly. Each is weighted by its share of the
    union's softmax denominator, ``exp(lse - new_lse)``."""
    new_lse = torch.logaddexp(lse, block_lse)
    out = (lse - new_lse).exp().unsqueeze(-1) * out
    out = out + (block_lse - new_lse).exp().unsqueeze(-1) * block_out
    return out, new_lse


def attention_block_backward(dout, q, k, v, delta, lse, scale: float, diagonal: bool):
    """One block's ``(dq, dk, dv)`` from the final output's ``lse`` and
    ``delta = rowsum(dout ∘ out)`` (FlashAttention-2's backward, Dao 2023):
    ``P = exp(S - lse)``, ``dV = Pᵀ·dO``, ``dS = P ∘ (dO·Vᵀ - delta)``,
    ``dQ = dS·K·scale``, ``dK = dSᵀ·Q·scale``; grouped K/V heads sum their queries'."""
    heads, kv_heads = q.size(-3), k.size(-3)
    p = torch.exp(_scores(q, k, scale, diagonal) - lse.unsqueeze(-1))
    ds = p * (dout @ _repeat_kv(v, heads).transpose(-2, -1) - delta.unsqueeze(-1))
    dq = (ds @ _repeat_kv(k, heads)) * scale
    dk, dv = (ds.transpose(-2, -1) @ q) * scale, p.transpose(-2, -1) @ dout
    if kv_heads != heads:
        dk, dv = (t.unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3) for t in (dk, dv))
    return dq, dk, dv


# --------------------------------------------------------------------------- work


@dataclass(eq=False)
class Work:
    """The score blocks this rank computed, one ``(pass, queries, keys, kind, query
    chunk, key chunk)`` each, ``kind`` ``"full"`` or ``"diagonal"`` (masked causally),
    and ``seconds``: the CPU time the computing thread spent in them, per pass."""

    blocks: list = field(default_factory=list)
    seconds: dict = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0})

    def scores(self, pass_: str = "forward") -> int:
        """Query-key scores computed in ``pass_`` (``"forward"`` or ``"backward"``)."""
        return sum(n * m for p, n, m, *_ in self.blocks if p == pass_)


_work: list[Work] = []


@contextlib.contextmanager
def count_work():
    """Count the attention blocks this rank computes: ``with count_work() as work:``."""
    work = Work()
    _work.append(work)
    try:
        yield work
    finally:
        _work.remove(work)


def _record_work(pass_: str, c: int, diagonal: bool, chunks: tuple, start: float) -> None:
    spent = time.thread_time() - start
    for work in _work:
        work.blocks.append((pass_, c, c, "diagonal" if diagonal else "full", *chunks))
        work.seconds[pass_] += spent


# --------------------------------------------------------------------------- steps


def block_pairs(mine, theirs, c: int, causal: bool):
    """``(query rows, key rows, diagonal, (query chunk, key chunk))`` of each block
    between the chunks of queries ``mine`` and of keys ``theirs`` (chunk indices in the
    sequence, ``c`` tokens each); blocks a causal mask hides entirely are left out."""
    for i, a in enumerate(mine):
        for j, b in enumerate(theirs):
            kind = _relation(a, b, causal)
            if kind is not None:
                rows, cols = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                yield rows, cols, kind == "diagonal", (a, b)


def forward_step(q, kv, mine, theirs, causal, state, merge=merge_attention):
    """Merge the blocks of the queries ``q`` (chunks ``mine``) with the keys and values
    ``kv`` (K and V stacked; chunks ``theirs``) into ``state = [out, lse, merged]``,
    where ``merged[i]`` says whether local chunk ``i`` holds a result already."""
    out, lse, merged = state
    scale, c = q.size(-1) ** -0.5, q.size(-2) // len(mine)
    for rows, cols, diagonal, chunks in block_pairs(mine, theirs, c, causal):
        k, v, start = kv[0][..., cols, :], kv[1][..., cols, :], time.thread_time()
        o, s = attention_block(q[..., rows, :], k, v, scale, diagonal)
        _record_work("forward", c, diagonal, chunks, start)
        if merged[rows.start // c]:
            o, s = merge(out[..., rows, :], lse[..., rows], o, s)
        out[..., rows, :], lse[..., rows] = o, s
        merged[rows.start // c] = True


def backward_step(dout, q, kv, stats, mine, theirs, causal, dq):
    """Add to ``dq`` the gradient of the queries (chunks ``mine``) through the keys and
    values ``kv`` (chunks ``theirs``); return the gradient of ``kv`` from these queries.
    ``stats`` is ``(delta, lse)`` of the final output."""
    delta, lse = stats
    scale, c = q.size(-1) ** -0.5, q.size(-2) // len(mine)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    for rows, cols, diagonal, chunks in block_pairs(mine, theirs, c, causal):
        args = (dout[..., rows, :], q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :])
        start = time.thread_time()
        g = attention_block_backward(*args, delta[..., rows], lse[..., rows], scale, diagonal)
        _record_work("backward", c, diagonal, chunks, start)
        dq[..., rows, :] += g[0]
        dkv[0][..., cols, :] += g[1]
        dkv[1][..., cols, :] += g[2]
    return dkv

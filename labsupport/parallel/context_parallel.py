"""Context parallelism: self-attention over a sequence split across ranks, ring attention.

Each of ``cp`` ranks holds a part of every sequence: its queries, keys and values. A
query needs every key of the sequence (every earlier one, under a causal mask), so the
keys and values must visit the ranks that hold the queries.

* :class:`Layout`: which chunks of the sequence each rank holds, contiguous or
  **zig-zag** (rank ``r`` holds chunks ``r`` and ``2·cp-1-r`` of ``2·cp``: Llama 3,
  Grattafiori et al. 2024, section 3.3.2; Megatron-LM's ``get_batch_on_this_cp_rank``);
  :func:`shard_sequence` and :func:`gather_sequence` cut and reassemble a tensor.
* :func:`ring_attention` (Liu et al. 2023, "Ring Attention with Blockwise Transformers
  for Near-Infinite Context"): the K/V chunks travel around the ring while each rank
  merges its output block by block with the online softmax
  (:mod:`labsupport.parallel.blockwise_attention`). The next chunk's transfer is posted
  before this chunk's computation, so the two overlap. The backward pass sends the K/V
  chunks around again, and their gradients follow them home, each hop adding the next
  rank's share (``cp - 1`` hops, like a ring reduce-scatter). Blocks a causal mask hides
  entirely are skipped, as Megatron-Core and PyTorch's ``context_parallel`` do; the
  gradients travel in float32, as PyTorch's ring does.

Messages go through :mod:`labsupport.comm.p2p`, counted; the all-gather and Ulysses
variants are in :mod:`labsupport.parallel.context_parallel_variants`, the course GPT with
context parallelism in :mod:`labsupport.parallel.context_parallel_model`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from labsupport.comm import p2p, traced
from labsupport.parallel.blockwise_attention import (
    backward_step,
    block_pairs,
    forward_step,
    merge_attention,
)

# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """Which chunks of a sequence each rank holds: ``chunks[r]``, in the order rank ``r``
    stores them. The sequence is cut into ``n_chunks`` chunks of equal length."""

    chunks: tuple

    def __post_init__(self):
        held = sorted(c for mine in self.chunks for c in mine)
        if held != list(range(len(held))) or len({len(m) for m in self.chunks}) != 1:
            raise ValueError(
                f"a layout gives every rank as many chunks, and each chunk to one rank; "
                f"got {[list(m) for m in self.chunks]}"
            )

    @classmethod
    def contiguous(cls, cp: int) -> Layout:
        """Rank ``r`` holds the ``r``-th of ``cp`` consecutive pieces."""
        return cls(tuple((r,) for r in range(cp)))

    @classmethod
    def zigzag(cls, cp: int) -> Layout:
        """``2·cp`` chunks; rank ``r`` holds chunks ``r`` and ``2·cp - 1 - r``."""
        return cls(tuple((r, 2 * cp - 1 - r) for r in range(cp)))

    @property
    def cp(self) -> int:
        return len(self.chunks)

    @property
    def n_chunks(self) -> int:
        return self.cp * len(self.chunks[0])

    def chunk_size(self, seq_len: int) -> int:
        if seq_len % self.n_chunks:
            raise ValueError(
                f"a sequence of {seq_len} tokens does not split into {self.n_chunks} equal "
                f"chunks ({self.cp} ranks, {len(self.chunks[0])} chunks each); use a length "
                f"that is a multiple of {self.n_chunks}"
            )
        return seq_len // self.n_chunks

    def positions(self, rank: int, seq_len: int) -> torch.Tensor:
        """The positions in the sequence of the tokens rank ``rank`` holds, in its order."""
        c = self.chunk_size(seq_len)
        return torch.cat([torch.arange(i * c, (i + 1) * c) for i in self.chunks[rank]])


def make_layout(layout, cp: int) -> Layout:
    """``"zigzag"``, ``"contiguous"`` or a :class:`Layout` of ``cp`` ranks."""
    if isinstance(layout, Layout):
        if layout.cp != cp:
            raise ValueError(f"the layout is for {layout.cp} ranks, the group has {cp}")
        return layout
    if layout not in ("zigzag", "contiguous"):
        raise ValueError(f"layout must be 'zigzag', 'contiguous' or a Layout, got {layout!r}")
    return Layout.zigzag(cp) if layout == "zigzag" else Layout.contiguous(cp)


def shard_sequence(x: torch.Tensor, dim: int, group=None, layout="zigzag") -> torch.Tensor:
    """This rank's tokens of a whole sequence ``x`` (the sequence along ``dim``)."""
    g = p2p.Group(group)
    lay = make_layout(layout, g.size)
    index = lay.positions(g.me, x.size(dim)).to(x.device)
    return x.index_select(dim, index).contiguous()


def gather_sequence(x: torch.Tensor, dim: int, group=None, layout="zigzag") -> torch.Tensor:
    """The whole sequence, in order, from every rank's tokens ``x`` (all-gathered)."""
    g = p2p.Group(group)
    lay = make_layout(layout, g.size)
    whole = traced.all_gather(x.contiguous(), dim, group)
    seq_len = whole.size(dim)
    order = torch.cat([lay.positions(r, seq_len) for r in range(g.size)])
    return whole.index_select(dim, torch.argsort(order).to(x.device))


# --------------------------------------------------------------------------- the ring


def ring_schedule(lay: Layout, causal: bool = True) -> list:
    """What the ring computes: ``steps[step][rank]`` is ``(src, blocks)``, the rank whose
    K/V this rank holds at that step and the ``(query chunk, key chunk, kind)`` blocks
    it computes with them, ``kind`` ``"full"`` or ``"diagonal"`` (the steps
    :func:`ring_attention` runs; a figure draws them)."""
    steps = []
    for step in range(lay.cp):
        row = []
        for rank in range(lay.cp):
            src = (rank - step) % lay.cp
            found = block_pairs(lay.chunks[rank], lay.chunks[src], 1, causal)
            row.append((src, [(a, b, "diagonal" if d else "full") for *_, d, (a, b) in found]))
        steps.append(row)
    return steps


def start_exchange(g: p2p.Group, sends=(), recvs=()):
    """:func:`labsupport.comm.p2p.exchange_many` without the wait: the sends and
    receives are posted as one batch (counted), and the caller waits for the returned
    requests once it has computed, so that the messages travel meanwhile."""
    ops = []
    for tensor, dst in sends:
        p2p._record(tensor, dst)
        ops.append(dist.P2POp(dist.isend, tensor, group=g.group, group_peer=dst))
    for tensor, src in recvs:
        ops.append(dist.P2POp(dist.irecv, tensor, group=g.group, group_peer=src))
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def check_shapes(q, k, v, lay: Layout) -> None:
    """The sizes context-parallel attention needs, with an error that names them."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[:1] + q.shape[2:] != k.shape[:1] + k.shape[2:]:
        raise ValueError(
            "q, k and v must be (batch, heads, tokens, head_dim) with the same batch, tokens "
            f"and head_dim; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.size(1) % k.size(1):
        raise ValueError(f"{q.size(1)} query heads do not share {k.size(1)} K/V heads evenly")
    if q.size(2) % len(lay.chunks[0]):
        raise ValueError(
            f"this rank holds {q.size(2)} tokens, which do not split into its "
            f"{len(lay.chunks[0])} chunks: shard the sequence with shard_sequence"
        )


def empty_result(q):
    """Zeros for the output, laid out (batch, tokens, heads, head_dim) in memory as
    FlashAttention returns it (so the model's transpose back to (batch, tokens, width)
    copies nothing), and ``-inf`` for its log-sum-exp; both float32."""
    b, h, n, d = q.shape
    out = torch.zeros(b, n, h, d, dtype=torch.float32, device=q.device).transpose(1, 2)
    return out, torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=q.device)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, lay, merge, on_step):
        g = p2p.Group(group)
        kv, (out, lse) = torch.stack([k, v]), empty_result(q)
        state = [out, lse, [False] * len(lay.chunks[g.me])]
        for step in range(g.size):
            src, pending = (g.me - step) % g.size, []
            if step < g.size - 1:  # post the next K/V's transfer, then compute on this one
                nxt = torch.empty_like(kv)
                pending = start_exchange(
                    g, [(kv, (g.me + 1) % g.size)], [(nxt, (g.me - 1) % g.size)]
                )
            forward_step(q, kv, lay.chunks[g.me], lay.chunks[src], causal, state, merge)
            if on_step is not None:
                on_step(step, src, out, lse)
            if pending:
                _wait(pending)
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.lay = group, causal, lay
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        g, lay, causal = p2p.Group(ctx.group), ctx.lay, ctx.causal
        dout = dout.float()
        delta = (dout * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, own, travelling, arriving = torch.stack([k, v]), None, None, []
        nxt_rank, prev_rank = (g.me + 1) % g.size, (g.me - 1) % g.size
        for step in range(g.size):
            src, pending = (g.me - step) % g.size, []
            if step < g.size - 1:
                nxt = torch.empty_like(kv)
                pending = start_exchange(g, [(kv, nxt_rank)], [(nxt, prev_rank)])
            dkv = backward_step(
                dout, q, kv, (delta, lse), lay.chunks[g.me], lay.chunks[src], causal, dq
            )
            if step == 0:
                own = dkv  # this rank's own K/V: its gradient stays here
            else:  # add to the gradient that followed this K/V from rank to rank
                _wait(arriving)
                dkv = dkv if travelling is None else dkv + travelling
                travelling = torch.empty_like(dkv)
                arriving = start_exchange(g, [(dkv, nxt_rank)], [(travelling, prev_rank)])
            if pending:
                _wait(pending)
                kv = nxt
        _wait(arriving)
        dkv = own if travelling is None else own + travelling
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), *[None] * 5


def ring_attention(
    q, k, v, group=None, causal: bool = True, layout="zigzag", merge=merge_attention, on_step=None
):
    """Exact attention over the whole sequence from this rank's part of it (run on every
    rank of ``group``): ``q``, ``k``, ``v`` are ``(batch, heads, tokens, head_dim)``
    holding this rank's tokens in ``layout`` (:func:`shard_sequence`); returns this
    rank's tokens of ``softmax(Q·Kᵀ/√d)·V``, with a causal mask if ``causal``. ``merge``
    combines two blocks' ``(out, lse)``; ``on_step(step, src, out, lse)`` is called
    after each step of the ring, ``src`` the rank whose K/V it used (a lab shows them)."""
    g = p2p.Group(group)
    lay = make_layout(layout, g.size)
    check_shapes(q, k, v, lay)
    return _RingAttention.apply(q, k, v, group, causal, lay, merge, on_step)

"""Context parallelism two more ways: all-gather the keys and values, or trade the
sequence for the heads (Ulysses).

* :func:`allgather_attention`: Llama 3's choice (Grattafiori et al. 2024, section 3.3.2):
  all-gather K and V, then attend with this rank's queries. With grouped-query attention
  K and V are much smaller than Q, so the all-gather is cheap, and any mask is easy. As
  Megatron-Core does, each rank keeps only its own K/V chunk after the forward pass and
  gathers them again in the backward pass, whose K/V gradients a reduce-scatter returns
  to their owners.
* :func:`ulysses_attention`: DeepSpeed-Ulysses (Jacobs et al. 2023): an all-to-all turns
  Q, K and V from sequence-split (all heads, ``s/cp`` tokens) into head-split
  (``h/cp`` heads, all tokens); each rank runs ordinary attention on its heads
  (``scaled_dot_product_attention``), and a second all-to-all turns the output back.
  ``cp`` must divide the number of heads, K/V heads included.
* :func:`all_to_all`: the collective Ulysses needs, recorded in
  :mod:`labsupport.comm.traced`'s trace as ``"all_to_all"`` with the bytes this rank
  sends to the others (``(N-1)/N`` of its tensor: its own piece stays);
  :func:`bytes_per_rank` counts it with the other collectives.

The ring is :func:`labsupport.parallel.context_parallel.ring_attention`; all three take
the same arguments and give the same result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport.comm import p2p, traced
from labsupport.parallel.blockwise_attention import backward_step, forward_step
from labsupport.parallel.context_parallel import check_shapes, empty_result, make_layout

# --------------------------------------------------------------------------- all-gather K/V


class _AllGatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, lay):
        g, n = p2p.Group(group), k.size(2)
        kv = traced.all_gather(torch.stack([k, v]), 3, group)  # every rank's, in rank order
        out, lse = empty_result(q)
        state = [out, lse, [False] * len(lay.chunks[g.me])]
        for src in range(g.size):
            theirs = kv[..., src * n : (src + 1) * n, :]
            forward_step(q, theirs, lay.chunks[g.me], lay.chunks[src], causal, state)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)  # this rank's K/V only
        ctx.group, ctx.causal, ctx.lay = group, causal, lay
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        g, lay, n = p2p.Group(ctx.group), ctx.lay, k.size(2)
        kv = traced.all_gather(torch.stack([k, v]), 3, ctx.group)  # gathered again
        dout = dout.float()
        stats = ((dout * out).sum(-1), lse)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.empty(kv.shape, dtype=torch.float32, device=q.device)
        for src in range(g.size):
            cols = slice(src * n, (src + 1) * n)
            mine, theirs = lay.chunks[g.me], lay.chunks[src]
            dkv[..., cols, :] = backward_step(
                dout, q, kv[..., cols, :], stats, mine, theirs, ctx.causal, dq
            )
        dkv = traced.reduce_scatter(dkv, 3, ctx.group)  # each K/V's gradient to its rank
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def allgather_attention(q, k, v, group=None, causal: bool = True, layout="zigzag"):
    """:func:`~labsupport.parallel.context_parallel.ring_attention`'s result, with K and
    V all-gathered instead of passed around a ring."""
    lay = make_layout(layout, p2p.Group(group).size)
    check_shapes(q, k, v, lay)
    return _AllGatherKV.apply(q, k, v, group, causal, lay)


# --------------------------------------------------------------------------- Ulysses


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None) -> torch.Tensor:
    """Cut ``x`` into one piece per rank along ``scatter_dim``, send piece ``j`` to rank
    ``j``, and concatenate the pieces received, in rank order, along ``gather_dim``
    (DeepSpeed's ``_SeqAllToAll``; ``dist.all_to_all_single`` underneath)."""
    world = dist.get_world_size(group)
    if x.size(scatter_dim) % world:
        raise ValueError(
            f"all-to-all over {world} ranks cuts dim {scatter_dim} of size "
            f"{x.size(scatter_dim)}: it must be a multiple of {world}"
        )
    send = torch.stack(x.chunk(world, scatter_dim)).contiguous()
    received = torch.empty_like(send)
    sent = send.numel() * send.element_size() * (world - 1) // world  # its own piece stays
    traced._record("all_to_all", sent, group)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """:func:`all_to_all` forward; the reverse all-to-all backward."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def ulysses_attention(q, k, v, group=None, causal: bool = True, layout="zigzag"):
    """:func:`~labsupport.parallel.context_parallel.ring_attention`'s result, by
    DeepSpeed-Ulysses: all-to-all to ``heads / cp`` heads of the whole sequence, local
    attention, all-to-all back. The gathered sequence comes in the ranks' layout order;
    under a causal mask it is put in order for the attention, and back after."""
    g = p2p.Group(group)
    lay = make_layout(layout, g.size)
    check_shapes(q, k, v, lay)
    if q.size(1) % g.size or k.size(1) % g.size:
        raise ValueError(
            f"Ulysses splits the heads over the ranks: {q.size(1)} query heads and "
            f"{k.size(1)} K/V heads over {g.size} ranks; use a number of ranks that divides "
            "both, or ring or all-gather attention"
        )
    qh, kh, vh = (_AllToAll.apply(t, 1, 2, group) for t in (q, k, v))
    order = torch.cat([lay.positions(r, qh.size(2)) for r in range(g.size)]).to(q.device)
    shuffled = causal and bool((order.diff() < 0).any())
    if shuffled:  # zig-zag: the causal mask needs the tokens in order
        qh, kh, vh = (t.index_select(2, torch.argsort(order)) for t in (qh, kh, vh))
    out = F.scaled_dot_product_attention(
        qh, kh, vh, is_causal=causal, enable_gqa=kh.size(1) != qh.size(1)
    )
    if shuffled:
        out = out.index_select(2, order)
    return _AllToAll.apply(out, 2, 1, group)


def bytes_per_rank(trace: traced.Trace) -> float:
    """:func:`labsupport.comm.traced.bytes_per_rank`, all-to-alls included: an
    all-to-all is recorded with the bytes this rank sends to the others."""
    others = traced.Trace([c for c in trace.calls if c[0] != "all_to_all"])
    sent = sum(size for name, size, _ in trace.calls if name == "all_to_all")
    return traced.bytes_per_rank(others) + sent

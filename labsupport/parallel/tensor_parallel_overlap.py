"""Tensor parallelism's communication hidden behind its own matrix products: the
all-gather that sequence parallelism puts before a column-parallel layer, cut into the
steps of its ring, each step's shard multiplied while the next one travels.

Wang et al. 2023 ("Overlap Communication with Dependent Computation via Decomposition
in Large Deep Learning Models", ASPLOS) decompose a collective and the matrix product
that consumes it into per-shard steps (XLA's *collective matmul*); PyTorch calls it
*async tensor parallelism* and fuses it on GPUs with symmetric memory
(``torch.distributed._symmetric_memory.fused_all_gather_matmul``, used by torchtitan).

:func:`all_gather_matmul` computes ``AllGather(X) Wᵀ`` along the sequence (dim 1), as
:func:`~labsupport.parallel.tensor_parallel.gather_from_sequence_parallel_region` then a
:class:`~labsupport.parallel.tensor_parallel.ColumnParallelLinear` would: in ``t``
steps, rank ``r`` multiplies the shard it holds (first its own) while it sends that
shard on to rank ``r + 1`` and receives the next from ``r - 1``, the ring all-gather of
chapter 8. The same bytes go over the wire; they go while the rank computes. The
backward pass reduce-scatters the input's gradient, as the un-overlapped layer does.
``matmul`` is the product of one shard, ``F.linear`` by default (a lab passes one that
also waits, as a GPU kernel takes time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from labsupport.comm import traced
from labsupport.comm.p2p import Group, post_many


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, matmul):
        g = Group(group)
        shards, outputs = {g.me: x.detach().contiguous()}, {}
        held = g.me  # whose shard this rank holds now
        for step in range(g.size):
            arriving = (held - 1) % g.size
            requests = []
            if step < g.size - 1:  # pass the held shard on, receive the next one
                shards[arriving] = torch.empty_like(x)
                sends = [(shards[held], (g.me + 1) % g.size)]
                requests = post_many(g, sends, [(shards[arriving], (g.me - 1) % g.size)])
            outputs[held] = matmul(shards[held], weight)  # while the messages travel
            for request in requests:
                request.wait()
            held = arriving
        gathered = torch.cat([shards[r] for r in range(g.size)], dim=1)
        ctx.save_for_backward(gathered, weight)
        ctx.group = group
        return torch.cat([outputs[r] for r in range(g.size)], dim=1)

    @staticmethod
    def backward(ctx, grad):
        gathered, weight = ctx.saved_tensors
        grad_x = traced.reduce_scatter(grad @ weight, 1, ctx.group)
        grad_w = grad.flatten(0, 1).T @ gathered.flatten(0, 1)
        return grad_x, grad_w, None, None


def all_gather_matmul(x, weight, group=None, matmul=F.linear):
    """``AllGather(x, dim=1) @ weight.T``, each shard's product computed while the next
    shard travels around the ring; differentiable in ``x`` and ``weight``."""
    return _AllGatherMatmul.apply(x, weight, group, matmul)


def all_gather_then_matmul(x, weight, group=None, matmul=F.linear):
    """The same product, un-overlapped: the whole all-gather, then the shards' products
    (the same ``matmul`` per shard, so the two take the same compute)."""
    gathered = traced.all_gather(x.contiguous(), 1, group)
    return torch.cat([matmul(shard, weight) for shard in gathered.split(x.size(1), 1)], dim=1)

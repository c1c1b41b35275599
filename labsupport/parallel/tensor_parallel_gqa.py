"""Grouped-query attention (Ainslie et al. 2023, "GQA"), dense and tensor-parallel.

``n_heads`` query heads share ``n_kv_heads`` key-value heads: query head ``j`` reads
key-value head ``j // (n_heads / n_kv_heads)``. Llama 3 405B has 128 query heads and 8
key-value heads; its K and V, what attention keeps per token (and caches at inference),
are 16 times smaller than with one key-value head per query head.

Tensor parallelism splits attention by heads (:mod:`labsupport.parallel.tensor_parallel`):
rank ``r`` of ``t`` holds query heads ``r·n_heads/t`` onward. Each needs its group's
key-value head, so:

* ``t <= n_kv_heads``: each rank holds ``n_kv_heads / t`` key-value heads of its own;
* ``t > n_kv_heads``: there are fewer key-value heads than ranks, and each is
  *replicated* on the ``t / n_kv_heads`` ranks whose query heads read it: those ranks
  hold the same K and V projection weights, compute the same K and V, and each gets a
  part of their gradient, which :func:`all_reduce_replicated_kv_grads` sums over them
  (as Megatron sums the gradients of weights that sequence parallelism replicates).

The dense :class:`GroupedQueryAttention` is a plain module (it matches torch's
``scaled_dot_product_attention(..., enable_gqa=True)``); :class:`ParallelGroupedQueryAttention`
takes one and keeps this rank's slices of its weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport.comm import traced
from labsupport.parallel.tensor_parallel import (
    _divide,
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)


class GroupedQueryAttention(nn.Module):
    """Causal self-attention with ``n_heads`` query heads and ``n_kv_heads`` key-value
    heads of ``dim / n_heads`` each (no bias, as Llama's)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = _divide(dim, n_heads, "dim over the query heads")
        _divide(n_heads, n_kv_heads, "n_heads over the key-value heads")
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.wo(attend(x, self.wq, self.wk, self.wv, self.head_dim))


def attend(x, wq, wk, wv, head_dim: int):
    """Causal attention of the query heads of ``wq`` on the key-value heads of ``wk`` and
    ``wv``, each group of query heads on its key-value head; heads concatenated."""
    b, s, _ = x.shape
    q, k, v = (w(x).view(b, s, -1, head_dim).transpose(1, 2) for w in (wq, wk, wv))
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(b, s, -1)


class ParallelGroupedQueryAttention(nn.Module):
    """This rank's query heads of ``dense`` (a :class:`GroupedQueryAttention`) and the
    key-value heads they read, replicated when ``t > n_kv_heads``; the output projection
    row-parallel. The input passes *f*, the output *g*: two all-reduces per pass, as for
    multi-head attention. After the backward pass, call
    :func:`all_reduce_replicated_kv_grads`."""

    def __init__(self, dense: GroupedQueryAttention, group=None):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.head_dim = group, dense.head_dim
        heads = _divide(dense.n_heads, t, "n_heads")
        if t <= dense.n_kv_heads:
            kv = _divide(dense.n_kv_heads, t, "n_kv_heads")
            first_kv, self.replicas = r * kv, 1
        else:
            self.replicas = _divide(t, dense.n_kv_heads, "the ranks over the key-value heads")
            first_kv, kv = r // self.replicas, 1
        rows = slice(r * heads * self.head_dim, (r + 1) * heads * self.head_dim)
        kv_rows = slice(first_kv * self.head_dim, (first_kv + kv) * self.head_dim)
        self.wq = _slice(dense.wq.weight[rows])
        self.wk, self.wv = _slice(dense.wk.weight[kv_rows]), _slice(dense.wv.weight[kv_rows])
        self.wo = _slice(dense.wo.weight[:, rows])
        # the ranks that hold the same key-value heads: one group per head
        self.kv_group = None
        if self.replicas > 1:
            for head in range(dense.n_kv_heads):
                ranks = list(range(head * self.replicas, (head + 1) * self.replicas))
                made = dist.new_group([_global(group, q) for q in ranks])
                if r in ranks:
                    self.kv_group = made

    def forward(self, x):
        x = copy_to_tensor_model_parallel_region(x, self.group)
        y = attend(x, self.wq, self.wk, self.wv, self.head_dim)
        return reduce_from_tensor_model_parallel_region(self.wo(y), self.group)

    def kv_bytes(self, b: int, s: int, element_bytes: int) -> int:
        """Bytes of K and V this rank computes (and keeps) for ``b`` sequences of ``s``."""
        return 2 * b * s * self.wk.out_features * element_bytes


def all_reduce_replicated_kv_grads(attention: ParallelGroupedQueryAttention) -> None:
    """Sum the K and V projections' gradients over the ranks that replicate them: each
    computed the part that its own query heads sent back."""
    if attention.kv_group is not None:
        for w in (attention.wk.weight, attention.wv.weight):
            traced.all_reduce(w.grad, attention.kv_group)


def _slice(rows: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(rows.size(1), rows.size(0), bias=False)
    layer.weight = nn.Parameter(rows.detach().clone())
    return layer


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)

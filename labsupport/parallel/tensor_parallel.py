"""Tensor parallelism, Megatron-LM's way: layers whose weights are split over ``t`` ranks.

Shoeybi et al. 2019 ("Megatron-LM") and Korthikanti et al. 2022 (sequence parallelism);
names from ``megatron/core/tensor_parallel/layers.py`` and ``mappings.py``.

* The conjugate operators, as autograd functions named by what they do:
  :func:`copy_to_tensor_model_parallel_region` (*f*: identity forward, all-reduce
  backward), :func:`reduce_from_tensor_model_parallel_region` (*g*: all-reduce forward,
  identity backward), and for sequence parallelism
  :func:`gather_from_sequence_parallel_region` (all-gather forward, reduce-scatter
  backward) and :func:`reduce_scatter_to_sequence_parallel_region` (the reverse); for a
  whole output or input, :func:`gather_from_tensor_model_parallel_region` (all-gather the
  last dimension forward, keep this rank's slice backward) and
  :func:`scatter_to_tensor_model_parallel_region` (the reverse).
* :class:`ColumnParallelLinear` (``Y_i = X A_i``: each rank a slice of the output
  features; ``gather_output``) and :class:`RowParallelLinear` (``Y = Σ_i X_i A_i``: each
  rank a slice of the input features, summed by *g*; ``input_is_parallel``).
* :class:`VocabParallelEmbedding` and :func:`vocab_parallel_cross_entropy`: the
  vocabulary split over the ranks, padded to a multiple of ``t``.

Blocks and the whole GPT built from these layers are in
:mod:`labsupport.parallel.tensor_parallel_model` (``ParallelBlock``, ``ParallelGPT``).

Collectives go through :mod:`labsupport.comm.traced`, so a lab can count them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport.comm import traced

# --------------------------------------------------------------------------- mappings


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return traced.all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return traced.all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _own_slice(x, group):
    """This rank's slice of the last dimension."""
    return x.chunk(dist.get_world_size(group), dim=-1)[dist.get_rank(group)].contiguous()


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return traced.all_gather(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return traced.all_gather(grad, grad.dim() - 1, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return traced.all_gather(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return traced.reduce_scatter(grad, 1, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return traced.reduce_scatter(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return traced.all_gather(grad, 1, ctx.group), None


def copy_to_tensor_model_parallel_region(x, group=None):
    """*f*: identity forward; all-reduce of the gradient backward."""
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x, group=None):
    """*g*: all-reduce forward; identity backward."""
    return _ReduceFromRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x, group=None):
    """All-gather the last dimension forward; keep this rank's slice of the gradient
    backward (the gathered tensor is replicated, so each rank's gradient is whole)."""
    return _GatherFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x, group=None):
    """Keep this rank's slice of the last dimension forward; all-gather the gradient
    backward (every rank then holds the whole input's gradient)."""
    return _ScatterToRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group=None):
    """Sequence parallelism's *g*: all-gather the sequence (dim 1) forward,
    reduce-scatter backward."""
    return _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    """Sequence parallelism's *ḡ*: reduce-scatter along the sequence forward, all-gather
    backward."""
    return _ReduceScatterToSequence.apply(x, group)


# --------------------------------------------------------------------------- layers


def _divide(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(
            f"{what} = {size} does not divide over {parts} tensor-parallel ranks; choose "
            f"{what} as a multiple of {parts}, or another tensor-parallel size"
        )
    return size // parts


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A``'s output features split: rank ``i`` holds ``A_i`` and
    computes ``Y_i``; ``gather_output`` all-gathers ``Y`` (and slices its gradient back).
    Its input passes *f* (or, with ``sequence_parallel``, the sequence all-gather)."""

    def __init__(
        self,
        in_features,
        out_features,
        bias=True,
        gather_output=False,
        sequence_parallel=False,
        group=None,
    ):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel = sequence_parallel
        local = _divide(out_features, dist.get_world_size(group), "out_features")
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.zeros(local)) if bias else None

    def forward(self, x):
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tensor_model_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A``'s input features split: rank ``i`` computes ``X_i A_i``,
    *g* sums them (or, with ``sequence_parallel``, reduce-scatters along the sequence);
    the bias is added once, after. ``input_is_parallel=False`` splits a whole ``X`` first
    (and all-gathers its gradient)."""

    def __init__(
        self,
        in_features,
        out_features,
        bias=True,
        input_is_parallel=True,
        sequence_parallel=False,
        group=None,
    ):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = sequence_parallel
        local = _divide(in_features, dist.get_world_size(group), "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary, padded to a multiple of ``t``) are split:
    each rank looks up the ids in its range, zeros elsewhere, and *g* sums the ranks."""

    def __init__(self, vocab_size: int, dim: int, group=None):
        super().__init__()
        self.group = group
        t, rank = dist.get_world_size(group), dist.get_rank(group)
        self.padded = math.ceil(vocab_size / t) * t
        local = self.padded // t
        self.start, self.end = rank * local, (rank + 1) * local
        self.weight = nn.Parameter(torch.empty(local, dim))

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's ``_VocabParallelCrossEntropy``: softmax over logits split by vocabulary,
    with three all-reduces of one number per token (max, sum of exponentials, target)."""

    @staticmethod
    def forward(ctx, logits, targets, start, group):
        local_max = traced.all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - local_max.unsqueeze(-1)
        inside = (targets >= start) & (targets < start + logits.size(-1))
        index = (targets - start).masked_fill(~inside, 0)
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        target_logit = traced.all_reduce(target_logit.masked_fill(~inside, 0.0), group)
        exp = shifted.exp()
        sum_exp = traced.all_reduce(exp.sum(dim=-1), group)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), inside, index)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, inside, index = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, index.unsqueeze(-1), -inside.unsqueeze(-1).to(g.dtype))
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits, targets, start: int, group=None):
    """Per-token cross-entropy of logits split by vocabulary (this rank's columns begin at
    vocabulary id ``start``), without gathering the logits."""
    return _VocabParallelCrossEntropy.apply(logits, targets, start, group)

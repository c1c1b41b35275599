"""Lab 12, what a tensor-parallel block keeps for the backward pass, measured against
Korthikanti et al.'s formula.

* :class:`MeasuredBlock`: the course's :class:`~labsupport.parallel.tensor_parallel_model.
  ParallelBlock` with its attention written out (as the dense GPT's ``attention="math"``),
  so that every tensor the formula counts is one autograd saves; with ``regather``, its
  column-parallel layers keep only their sequence shard and all-gather it again in the
  backward pass, as Megatron-LM does under sequence parallelism (:class:`GatheredLinear`);
* :func:`saved_bytes`: the bytes one such block saves on this rank, for each tensor-parallel
  size, with and without sequence parallelism (run on 4 ranks).

What tensor parallelism costs per layer on NVLink and InfiniBand, modelled, is
:func:`labsupport.estimate.tensor_parallel.layer_costs`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport.comm import traced
from labsupport.estimate.memory import activation_memory
from labsupport.measure.memory import saved_tensors
from labsupport.models import tiny_gpt
from labsupport.parallel.tensor_parallel import ColumnParallelLinear
from labsupport.parallel.tensor_parallel_model import ParallelBlock

#: The block the memory is measured on: attention written out, dropout on (its masks are
#: part of the formula), 4 heads so that 1, 2 and 4 ranks each get whole heads.
MEMORY_GPT = {
    "vocab_size": 64,
    "block_size": 32,
    "n_layer": 1,
    "n_head": 4,
    "n_embd": 32,
    "dropout": 0.1,
    "attention": "math",
}
BATCH = 2


class GatheredLinear(torch.autograd.Function):
    """``Y = all_gather(X_shard) A_iᵀ + b``, keeping only ``X_shard`` for the backward
    pass, which all-gathers it again (Megatron-LM's ``LinearWithGradAccumulationAnd
    AsyncCommunication`` under sequence parallelism; Korthikanti et al. 2022, 4.2.2)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(traced.all_gather(x, 1, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        total = traced.all_gather(x, 1, ctx.group)  # the extra all-gather
        grad_input = traced.reduce_scatter(grad @ weight, 1, ctx.group)
        grad_weight = grad.flatten(0, -2).T @ total.flatten(0, -2)
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


class _RegatheringColumn(ColumnParallelLinear):
    def forward(self, x):
        return GatheredLinear.apply(x, self.weight, self.bias, self.group)


class MeasuredBlock(ParallelBlock):
    """A :class:`ParallelBlock` whose attention is written out (scores, softmax,
    dropout, as the dense GPT's ``attention="math"``); with ``regather``, its
    column-parallel layers save only their input's sequence shard."""

    def __init__(self, block, config, group=None, sequence_parallel=False, regather=False):
        super().__init__(block, config, group, sequence_parallel)
        future = torch.ones(config.block_size, config.block_size, dtype=torch.bool).triu(1)
        self.register_buffer("future", future, persistent=False)
        if regather and sequence_parallel:
            for name in ("c_attn", "c_fc"):
                old = getattr(self, name)
                new = _RegatheringColumn(
                    old.weight.shape[1],
                    old.weight.shape[0] * dist.get_world_size(group),
                    bias=old.bias is not None,
                    sequence_parallel=True,
                    group=group,
                )
                new.load_state_dict(old.state_dict())
                setattr(self, name, new)

    def _attention(self, x):
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        b, s, local = q.shape
        q, k, v = (z.view(b, s, self.heads, local // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        probs = F.softmax(scores.masked_fill(self.future[:s, :s], float("-inf")), dim=-1)
        with self.rank_rng(probs):  # a different mask for each rank's heads
            probs = F.dropout(probs, self.config.dropout, self.training)
        return (probs @ v).transpose(1, 2).reshape(b, s, local)


def saved_bytes(sizes=(1, 2, 4), regather: bool = False) -> list[dict]:
    """Bytes one :class:`MeasuredBlock` saves for the backward pass on this rank, for each
    tensor-parallel size in ``sizes`` (groups of consecutive ranks), without and with
    sequence parallelism (run on every rank of a world whose size ``sizes`` divide)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gpt = tiny_gpt(0, **MEMORY_GPT)
    config, dense = gpt.config, gpt.h[0]
    rows = []
    for t in sizes:
        groups = [dist.new_group(list(range(g, g + t))) for g in range(0, world, t)]
        group = groups[rank // t]  # every rank made every group, as new_group requires
        for sp in (False, True):
            block = MeasuredBlock(dense, config, group, sp, regather).train()
            s = config.block_size // t if sp else config.block_size
            x = torch.randn(BATCH, s, config.n_embd, requires_grad=True)
            with saved_tensors(exclude=block) as saved:
                block(x)
            rows.append({"t": t, "sequence_parallel": sp, "bytes": saved.nbytes, "rank": rank})
    return rows


def formula_bytes(t: int, sequence_parallel: bool) -> int:
    """Korthikanti et al.'s bytes for :data:`MEMORY_GPT`'s block in fp32 on a CPU (4-byte
    values and dropout masks), plus what their count leaves out as small: each layer
    norm's mean and reciprocal standard deviation, one value each per token."""
    c = MEMORY_GPT
    s, h, a = c["block_size"], c["n_embd"], c["n_head"]
    values = activation_memory(
        s,
        BATCH,
        h,
        a,
        1,
        bytes_per_value=4,
        mask_bytes=4,
        tensor_parallel=t,
        sequence_parallel=sequence_parallel,
    )
    tokens = BATCH * (s // t if sequence_parallel else s)
    return int(values) + 2 * 2 * tokens * 4

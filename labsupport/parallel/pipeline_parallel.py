"""Pipeline parallelism: the course GPT cut into stages, one executor for every schedule.

:func:`stage_modules` cuts a :class:`labsupport.models.GPT` into ``p * v`` stages of
consecutive blocks (the first also embeds, the last also computes the loss); rank ``r``
holds the chunks ``r, r + p, ...`` (one with ``v = 1``). :func:`run` executes a schedule
of :mod:`labsupport.parallel.schedules` on this rank: forward and backward of each
micro-batch through its chunks, activations sent to the next stage and gradients back,
every consecutive run of messages posted as one batch (:func:`labsupport.comm.p2p.
exchange_many`), every action timestamped.

The loss of each micro-batch is divided by the number of micro-batches before its
backward, once, so that the accumulated gradients are those of the mean loss over the
whole batch: the same gradients as one process running the whole batch (the scaling
production frameworks keep getting wrong, e.g. Megatron-LM issue #1000's kind).

A GPT whose output layer shares the token embedding (weight tying) has that matrix on
the first stage and a copy on the last: after the backward pass, :func:`run` all-reduces
their two gradients over the group of those two ranks, as Megatron's "embedding group"
does, so both copies take the same step.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from labsupport.comm.p2p import Group, exchange_many
from labsupport.launch.runtime import device
from labsupport.parallel import schedules


class Stage(nn.Module):
    """Consecutive blocks of a GPT; the first stage embeds, the last applies the head."""

    def __init__(self, gpt, blocks: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.blocks = nn.ModuleList(gpt.h[i] for i in blocks)
        self.wte = gpt.wte if first else None
        self.wpe = gpt.wpe if first else None
        self.drop = gpt.drop if first else None
        self.ln_f = gpt.ln_f if last else None
        self.lm_head = gpt.lm_head if last else None
        self.gpt = [gpt]  # a list, so that it is not registered as a submodule

    def forward(self, x, targets=None):
        gpt = self.gpt[0]
        if self.first:
            x = gpt.embed(x)
        for block in self.blocks:
            x = gpt.run_block(block, x)
        if self.last:
            return gpt.head(x, targets)[1]
        return x


def partition(layers: int, stages: int) -> list[range]:
    """Blocks of each stage: as even as possible, the first stages one more when uneven."""
    if stages > layers:
        raise ValueError(
            f"{stages} pipeline stages for {layers} transformer blocks: every stage needs at "
            "least one block; use fewer stages (p * v) or a deeper model"
        )
    sizes = [len(part) for part in torch.arange(layers).tensor_split(stages)]
    bounds, start = [], 0
    for size in sizes:
        bounds.append(range(start, start + size))
        start += size
    return bounds


def stage_modules(gpt, p: int, rank: int, v: int = 1) -> dict[int, Stage]:
    """This rank's chunks of ``gpt`` (a :class:`labsupport.models.GPT`, or a
    tensor-parallel one), cut in place: chunk ``c`` is stage ``c * p + rank``. A tied
    output weight is untied (the last stage gets a copy), :func:`run` keeps them equal."""
    if gpt.lm_head.weight is gpt.wte.weight:
        gpt.lm_head.weight = nn.Parameter(gpt.wte.weight.detach().clone())
        gpt.tied = True
    parts = partition(len(gpt.h), p * v)
    n = p * v
    return {
        c: Stage(gpt, parts[c * p + rank], c * p + rank == 0, c * p + rank == n - 1)
        for c in range(v)
    }


def run(
    chunks: dict[int, Stage],
    schedule: list[schedules.Action],
    inputs: list,
    targets: list,
    activation_shape: tuple,
    group=None,
    v: int = 1,
    embedding_group=None,
) -> dict:
    """Execute this rank's ``schedule`` on its ``chunks``; gradients accumulate in them.

    ``inputs[k]`` and ``targets[k]`` are micro-batch ``k``'s token ids and targets (only
    the first and the last stage read them). ``activation_shape`` is what a stage sends
    (micro-batch, sequence, width). Returns the micro-batches' losses (on the last stage),
    every action with its start and end time, and the most micro-batches whose
    activations this rank held at once. ``embedding_group`` is the group of the first
    and the last stage's ranks, for a tied embedding; it is made here when the pipeline
    is the whole world (in a mesh, :mod:`labsupport.parallel.parallel_state` makes it).
    """
    g = Group(group)
    rank, m = g.me, len(inputs)
    dtype = next(iter(chunks.values())).blocks[0].ln_1.weight.dtype
    held: dict = {}  # (k, c) -> (stage input, stage output or loss)
    received: dict = {}  # ("act" | "grad", k, c) -> tensor
    losses, events, peak, start = {}, [], 0, time.perf_counter()
    for batch in schedules.batches(schedule):
        begin = time.perf_counter() - start
        a = batch[0]
        if a.kind == "forward":
            stage = chunks[a.chunk]
            x = inputs[a.microbatch].to(device()) if stage.first else received.pop(("act", *a[1:]))
            if stage.last:
                out = stage(x, targets[a.microbatch].to(device())) / m  # scaled once
                losses[a.microbatch] = out.item() * m
            else:
                out = stage(x)
            held[a.microbatch, a.chunk] = (x, out)
            peak = max(peak, len(held))
        elif a.kind == "backward":
            x, out = held.pop((a.microbatch, a.chunk))
            if chunks[a.chunk].last:
                out.backward()
            else:
                out.backward(received.pop(("grad", *a[1:])))
            if not chunks[a.chunk].first:
                received["input_grad", *a[1:]] = x.grad
            del x, out  # else they keep this micro-batch's graph alive into the next forward
        else:
            _communicate(g, batch, held, received, activation_shape, dtype, v)
        events.append((a, begin, time.perf_counter() - start))
    _all_reduce_tied(chunks, g, embedding_group)
    return {"losses": losses, "events": events, "peak_microbatches": peak, "rank": rank}


def _communicate(g, batch, held, received, shape, dtype, v) -> None:
    sends, recvs = [], []
    for a in batch:
        other, _ = schedules.peer(a, g.size, g.me)
        key = a[1:]
        if a.kind == "send_act":
            sends.append((held[key][1].detach(), other))
        elif a.kind == "send_grad":
            sends.append((received.pop(("input_grad", *key)).contiguous(), other))
        else:
            buf = torch.empty(shape, dtype=dtype, device=device())
            if a.kind == "recv_act":
                buf.requires_grad_(True)
            received["act" if a.kind == "recv_act" else "grad", *key] = buf
            recvs.append((buf if a.kind == "recv_grad" else buf.data, other))
    exchange_many(g, sends, recvs)


def _all_reduce_tied(chunks: dict[int, Stage], g: Group, embedding_group) -> None:
    """Sum the gradients of the token embedding (first stage) and of its copy in the
    output layer (last stage): the gradient of the one tied matrix."""
    gpt = next(iter(chunks.values())).gpt[0]
    if not getattr(gpt, "tied", False):
        return
    mine = [s.wte.weight for s in chunks.values() if s.first]
    mine += [s.lm_head.weight for s in chunks.values() if s.last]
    if g.size == 1:  # one stage holds both copies
        total = sum(w.grad for w in mine)
        for w in mine:
            w.grad = total.clone()
        return
    world = g.group is None or g.group is dist.group.WORLD
    if embedding_group is None and world:  # every rank takes part in making it
        embedding_group = _world_embedding_group(g.size)
    if not mine:  # a middle stage: no copy of the embedding here
        return
    if embedding_group is None:
        raise ValueError(
            "a tied embedding in a pipeline that is not the whole world needs "
            "embedding_group= (the group of its first and last stages' ranks)"
        )
    for w in mine:  # the first or the last stage (with v > 1 both may be here)
        dist.all_reduce(w.grad, group=embedding_group)


_groups: dict = {}


def _world_embedding_group(p: int):
    """The group of ranks 0 and ``p - 1``, made once (every rank must call new_group)."""
    if p not in _groups:
        _groups[p] = dist.new_group([0, p - 1])
    return _groups[p]

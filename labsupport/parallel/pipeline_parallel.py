"""Pipeline parallelism: the course GPT cut into stages, one executor for every schedule.

:func:`stage_modules` cuts a :class:`labsupport.models.GPT` (or the tensor-parallel
:class:`~labsupport.parallel.tensor_parallel_model.ParallelGPT`) into ``p * v`` stages of
consecutive blocks; rank ``r`` holds the chunks ``r, r + p, ...`` (one with ``v = 1``).
A :class:`Stage` owns exactly the modules it runs, as picotron's ``PipelineParallel``
does (``picotron/pipeline_parallel/pipeline_parallel.py``): the first stage the
embeddings, the last the final LayerNorm and the output layer, ``nn.Identity()`` where a
stage has none of them, so that its forward reads top to bottom. The caller's model is
left as it was.

:func:`run` executes a schedule of :mod:`labsupport.parallel.schedules` on this rank:
forward and backward of each micro-batch through its chunks, activations sent to the
next stage and gradients back, every consecutive run of messages posted as one batch
(:func:`labsupport.comm.p2p.exchange_many`), every action timestamped. The last stage
returns logits, and :func:`run` turns them into the micro-batch's loss with ``loss_fn``,
as ``torch.distributed.pipelining``'s schedules do. Each loss is divided by the number of
micro-batches before its backward, once, so that the accumulated gradients are those of
the mean loss over the whole batch: the same gradients as one process running the whole
batch (the scaling production frameworks keep getting wrong, e.g. Megatron-LM issue
#1000's kind).

A GPT whose output layer shares the token embedding (weight tying) has that matrix on
the first stage and a copy on the last: after the backward pass, :func:`run` all-reduces
their two gradients over the group of those two ranks, Megatron's "embedding group", so
both copies take the same step. The group comes from the mesh
(:meth:`~labsupport.parallel.parallel_state.Mesh.process_groups`) or from the caller.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from labsupport.comm.flat import even_spans
from labsupport.comm.p2p import Group, post_many
from labsupport.launch.runtime import device
from labsupport.models import GPT
from labsupport.parallel import schedules, split_backward


class Embedding(nn.Module):
    """The first stage's input layer, made of the model's own modules: token plus
    position embeddings, then dropout (:meth:`labsupport.models.GPT.embed`)."""

    def __init__(self, gpt):
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop

    def forward(self, idx):
        t = idx.size(1)
        if t > self.wpe.num_embeddings:
            raise ValueError(f"a sequence of {t} tokens is longer than block_size")
        return self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))


class Stage(nn.Module):
    """The blocks ``blocks`` of a GPT and nothing else; the ``first`` stage also embeds,
    the ``last`` also applies the final LayerNorm and the output layer (it returns logits).

    Its modules are the model's, so training the stage trains them; with a tied output
    layer, the last stage takes a copy of the matrix instead (``tied``: this stage holds
    one of the two copies). The dense GPT's ``recompute="full"`` reruns each block's
    forward in the backward pass, as :meth:`labsupport.models.GPT.run_block` does.
    """

    def __init__(self, gpt, blocks: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.tied = gpt.lm_head.weight is gpt.wte.weight and first != last
        self.recompute = isinstance(gpt, GPT) and gpt.config.recompute == "full"
        self.embedding = Embedding(gpt) if first else nn.Identity()
        self.h = nn.ModuleDict({str(i): gpt.h[i] for i in blocks})  # the model's numbering
        self.ln_f, self.lm_head = nn.Identity(), nn.Identity()
        if last:  # tied: a copy of the matrix that the first stage's embedding holds
            self.ln_f = gpt.ln_f
            self.lm_head = _own_copy(gpt.lm_head) if self.tied else gpt.lm_head

    def forward(self, x):
        x = self.embedding(x)  # the first stage: token ids to vectors
        for block in self.h.values():
            if self.recompute and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=True)
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))  # the last stage: logits


def _own_copy(module: nn.Module) -> nn.Module:
    """``module`` with parameters of its own; a process group it holds is shared, not
    copied (a group cannot be)."""
    memo = {id(v): v for v in vars(module).values() if isinstance(v, dist.ProcessGroup)}
    return copy.deepcopy(module, memo)


def partition(layers: int, stages: int) -> list[range]:
    """Blocks of each stage: as even as possible, the first stages one more when uneven."""
    if stages > layers:
        raise ValueError(
            f"{stages} pipeline stages for {layers} transformer blocks: every stage needs at "
            "least one block; use fewer stages (p * v) or a deeper model"
        )
    return [range(s.start, s.stop) for s in even_spans(layers, stages)]


def stage_modules(gpt, p: int, rank: int, v: int = 1, style: str = "loop") -> dict[int, Stage]:
    """This rank's chunks of ``gpt`` (a :class:`labsupport.models.GPT`, or a
    tensor-parallel one): chunk ``c`` is stage ``c * p + rank`` of ``p * v``, or with
    ``style="v"`` (two chunks) stages ``rank`` and ``2p - 1 - rank``
    (:func:`~labsupport.parallel.schedules.stage_of`)."""
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is not one of the {p} pipeline ranks")
    if style == "v" and v != 2:
        raise ValueError(f"a V places two chunks on each rank, got v={v}")
    n = p * v
    parts = partition(len(gpt.h), n)
    stages = [schedules.stage_of(p, rank, c, style) for c in range(v)]
    return {c: Stage(gpt, parts[s], s == 0, s == n - 1) for c, s in enumerate(stages)}


def cross_entropy(logits, targets):
    """The GPT's loss: the mean cross-entropy over every position
    (:meth:`labsupport.models.GPT.head`)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def run(
    chunks: dict[int, Stage],
    schedule: list[schedules.Action],
    inputs: list,
    targets: list,
    activation_shape: tuple,
    group=None,
    embedding_group=None,
    loss_fn=cross_entropy,
    style: str = "loop",
) -> dict:
    """Execute this rank's ``schedule`` on its ``chunks``; gradients accumulate in them.

    ``inputs[k]`` and ``targets[k]`` are micro-batch ``k``'s token ids and targets (only
    the first and the last stage read them); ``loss_fn(logits, targets)`` gives its loss.
    ``activation_shape`` is what a stage sends (micro-batch, sequence, width); ``style``
    how the chunks sit on the ranks, as :func:`stage_modules` placed them. Returns the
    micro-batches' losses (on the last stage), every action with its start and end time,
    and the most micro-batches whose activations this rank held at once (from a forward
    to its backward, or to its W when the backward is split). A tied embedding needs
    ``embedding_group``, the group of the first and the last stage's ranks, on those two.
    """
    g = Group(group)
    if embedding_group is None and sum(s.tied for s in chunks.values()) == 1:
        raise ValueError(
            "the model ties its output layer to its embedding: pass embedding_group=, the "
            "group of the first and the last stage's ranks (Mesh.process_groups()"
            '["embedding"], or dist.new_group([first, last]) called on every rank)'
        )
    m = len(inputs)
    dtype = next(next(iter(chunks.values())).parameters()).dtype
    on_me = {schedules.stage_of(g.size, g.me, c, style): c for c in chunks}  # stage -> chunk
    mine = {c: s for s, c in on_me.items()}
    held: dict = {}  # (k, c) -> (stage input, stage output or loss)
    received: dict = {}  # ("act" | "grad" | "input_grad", k, c) -> tensor
    waits, sending, split = {}, [], {}  # receives' requests; sends in flight; B's for W
    losses, events, peak, start = {}, [], 0, time.perf_counter()
    for batch in schedules.batches(schedule):
        a = batch[0]
        k, c = key = a[1:]
        if a.kind in schedules.COMM:
            begin = time.perf_counter() - start
            _communicate(g, batch, held, received, waits, sending, activation_shape, dtype, style)
            events.append((a, begin, time.perf_counter() - start))
            continue
        stage, before, after = chunks[c], on_me.get(mine[c] - 1), on_me.get(mine[c] + 1)
        for request in waits.pop(("act" if a.kind == "forward" else "grad", *key), []):
            request.wait()  # the message this computation reads
        begin = time.perf_counter() - start
        if a.kind == "forward":
            if stage.first:
                x = inputs[k].to(device())
            elif before is not None:  # the V's turn: the previous stage is on this rank
                x = held[k, before][1].detach().requires_grad_()
            else:
                x = received.pop(("act", *key))
            out = stage(x)
            if stage.last:
                out = loss_fn(out, targets[k].to(device())) / m  # scaled once
                losses[k] = out.item() * m
            held[key] = (x, out)
            peak = max(peak, len(held))
        elif a.kind == "backward_weight":
            split_backward.backward_weight(split.pop(key))
            del held[key]
        else:  # a full backward, or its B
            x, out = held[key] if a.kind == "backward_input" else held.pop(key)
            grad = (
                None
                if stage.last
                else received.pop(("input_grad", k, after) if after is not None else ("grad", *key))
            )
            if a.kind == "backward_input":
                split[key] = split_backward.backward_input(out, grad, x, list(stage.parameters()))
            else:
                out.backward(grad)
            if not stage.first:
                received["input_grad", *key] = x.grad
            del x, out  # else they keep this micro-batch's graph alive into the next forward
        events.append((a, begin, time.perf_counter() - start))
    for request, _ in sending:
        request.wait()
    all_reduce_tied(chunks, embedding_group)
    return {"losses": losses, "events": events, "peak_microbatches": peak, "rank": g.me}


def _communicate(g, batch, held, received, waits, sending, shape, dtype, style) -> None:
    """Post a batch of messages; a receive's request waits in ``waits`` for the
    computation that reads it, a send's in ``sending`` for the end of the step."""
    sends, recvs, keys = [], [], []
    for a in batch:
        other, _ = schedules.peer(a, g.size, g.me, style)
        key = a[1:]
        if a.kind == "send_act":
            sends.append((held[key][1].detach(), other))
        elif a.kind == "send_grad":
            sends.append((received.pop(("input_grad", *key)).contiguous(), other))
        else:
            buf = torch.empty(shape, dtype=dtype, device=device())
            if a.kind == "recv_act":
                buf.requires_grad_(True)
            keys.append(("act" if a.kind == "recv_act" else "grad", *key))
            received[keys[-1]] = buf
            recvs.append((buf if a.kind == "recv_grad" else buf.data, other))
    requests = post_many(g, sends, recvs)
    if len(requests) == len(sends) + len(recvs):  # one request per message (gloo)
        sending += zip(requests[: len(sends)], sends, strict=True)
        waits.update((k, [r]) for k, r in zip(keys, requests[len(sends) :], strict=True))
    else:  # one request for the whole batch (NCCL)
        sending += [(r, sends) for r in requests]
        waits.update((k, requests) for k in keys)


def all_reduce_tied(chunks: dict[int, Stage], embedding_group) -> None:
    """Sum the gradients of the token embedding (first stage) and of its copy in the
    output layer (last stage): the gradient of the one tied matrix. A V puts the first
    and the last stage on rank 0: the two are added there, with no message."""
    tied = [
        s.embedding.wte.weight if s.first else s.lm_head.weight for s in chunks.values() if s.tied
    ]
    if len(tied) == 2:
        total = tied[0].grad + tied[1].grad
        tied[0].grad, tied[1].grad = total, total.clone()
    elif tied:
        dist.all_reduce(tied[0].grad, group=embedding_group)

"""Lab 11, the model a pipeline lab on a laptop runs: the course GPT, whose blocks can
wait as if each rank had its own accelerator.

:class:`Wait`, hooked on every block of the lab's GPT by :func:`build`, makes the block
also *wait* a fixed time in the forward and the backward pass. On a machine with a GPU
per rank, each stage computes on its own device; on a 2-core laptop, 4 ranks share 2
cores and slow each other down whenever more than two compute at once. The wait stands
in for a kernel the rank waits for, so that a timeline shows the schedule rather than
the laptop. The activations the blocks keep are counted by
:class:`labsupport.measure.memory.SavedBytes`.
"""

from __future__ import annotations

import functools
import time

import torch

from labsupport.measure.memory import saved_tensors
from labsupport.models import GPT, random_tokens, tiny_gpt

#: The lab's GPT: 8 blocks (2 per stage on 4 ranks, 1 per chunk when interleaved with
#: v = 2), attention written out so that what autograd keeps is plain to count, and no
#: dropout, so that every schedule gives exactly the gradients of one process.
LAB_GPT = {
    "vocab_size": 64,
    "block_size": 16,
    "n_layer": 8,
    "n_head": 2,
    "n_embd": 32,
    "attention": "math",
}
MICRO_BATCH = 2  # sequences per micro-batch


class Wait(torch.autograd.Function):
    """The identity, which also waits ``forward_s`` seconds in the forward pass and
    ``backward_s`` in the backward pass, as a rank waits for its own accelerator.
    :meth:`hook` passes a block's output through it, wherever the block runs (in its
    model, or in a pipeline stage that holds it)."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None

    @staticmethod
    def hook(forward_s: float, backward_s: float):
        """A forward hook (``module.register_forward_hook``) that makes the module wait."""
        return lambda _module, _args, output: Wait.apply(output, forward_s, backward_s)

    @staticmethod
    def weight_hook(backward_s: float):
        """A tensor hook (``weight.register_hook``) that waits when the weight's gradient
        is computed: in the backward pass, or in its W."""
        return lambda _grad: time.sleep(backward_s)


def build(forward_s: float = 0.0, backward_s: float = 0.0, seed: int = 0) -> GPT:
    """The lab's GPT (:data:`LAB_GPT`), the same weights on every rank for a ``seed``;
    each block also waits ``forward_s`` seconds in the forward pass and ``backward_s`` in
    the backward pass (:class:`Wait`), half of it for its input's gradient, half for its
    weights'."""
    model = tiny_gpt(seed, **LAB_GPT)
    if forward_s or backward_s:
        for block in model.h:
            block.register_forward_hook(Wait.hook(forward_s, backward_s / 2))
            block.mlp.c_fc.weight.register_hook(Wait.weight_hook(backward_s / 2))
    return model


def micro_batches(m: int, seed: int = 1) -> tuple[list, list]:
    """``m`` micro-batches of :data:`MICRO_BATCH` random sequences, and their targets."""
    c = LAB_GPT
    idx, targets = random_tokens(m * MICRO_BATCH, c["block_size"], c["vocab_size"], seed)
    return list(idx.split(MICRO_BATCH)), list(targets.split(MICRO_BATCH))


@functools.cache
def reference_gradients(m: int) -> dict:
    """The gradients of one process running the whole batch (the mean loss over all its
    sequences), by parameter name; the tied output weight is the token embedding's.
    Computed once per ``m`` (read them, do not change them)."""
    model = build()
    idx, targets = micro_batches(m)
    model(torch.cat(idx), torch.cat(targets))[1].backward()
    return {n: q.grad for n, q in model.named_parameters()}


def warm_up(model: GPT, shape: tuple) -> None:
    """One forward and backward through a block, gradients dropped: a process's first
    backward pass given an output gradient imports modules (about a second), which
    would otherwise land in the step being timed."""
    y = model.h[0](torch.zeros(shape, device=next(model.parameters()).device))
    y.backward(torch.ones_like(y))
    model.zero_grad(set_to_none=True)


def activation_bytes_per_block() -> int:
    """Bytes one block keeps for the backward pass of one micro-batch, measured."""
    model = build()
    x = torch.zeros(MICRO_BATCH, LAB_GPT["block_size"], LAB_GPT["n_embd"], requires_grad=True)
    with saved_tensors(exclude=model) as saved:
        model.h[0](x)
    return saved.nbytes

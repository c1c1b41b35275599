"""Lab 11, the model a pipeline lab on a laptop runs: the course GPT, whose blocks can
wait as if each rank had its own accelerator, and a count of the activations it keeps.

* :class:`LabGPT`, the course GPT whose blocks also *wait* a fixed time in the forward
  and the backward pass. On a machine with a GPU per rank, each stage computes on its
  own device; on a 2-core laptop, 4 ranks share 2 cores and slow each other down
  whenever more than two compute at once. The wait stands in for a kernel the rank
  waits for, so that a timeline shows the schedule rather than the laptop;
* :class:`HeldActivations`: the bytes autograd keeps for the backward pass that are
  alive now, and their peak, counted in every block.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch
from torch import nn

from labsupport.models import GPT, GPTConfig, random_tokens

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


class _Wait(torch.autograd.Function):
    """The identity, which also waits ``forward_s`` seconds in the forward pass and
    ``backward_s`` in the backward pass, as a rank waits for its own accelerator."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class HeldActivations:
    """The bytes autograd keeps for the backward pass that are alive now, and the peak.

    Every tensor an operation saves passes the pack hook of :meth:`saving`; its storage
    is counted once (a view and its base share one) until it is freed, which happens
    when the backward pass of its micro-batch has used it. The parameters and buffers
    of ``exclude`` are the model's state, not activations, and are left out.
    """

    def __init__(self, exclude: nn.Module):
        self.exclude = {_key(t) for t in (*exclude.parameters(), *exclude.buffers())}
        self.live = self.peak = 0
        self._alive: set = set()

    @contextlib.contextmanager
    def saving(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield self

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _key(tensor)
        if key not in self.exclude and key not in self._alive:
            storage = tensor.untyped_storage()
            self._alive.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, storage.nbytes())
        return tensor

    def _free(self, key, nbytes: int) -> None:
        self.live -= nbytes
        self._alive.discard(key)


def _key(tensor: torch.Tensor):
    return tensor.device, tensor.untyped_storage().data_ptr()


class LabGPT(GPT):
    """The course GPT whose every block also waits ``forward_s`` seconds in the forward
    pass and ``backward_s`` in the backward pass, and, while :attr:`held` is set, counts
    the activations its blocks keep (:class:`HeldActivations`)."""

    def __init__(self, config: GPTConfig, forward_s: float = 0.0, backward_s: float = 0.0):
        super().__init__(config)
        self.forward_s, self.backward_s = forward_s, backward_s
        self.held: HeldActivations | None = None

    def run_block(self, block, x):
        counting = self.held.saving() if self.held is not None else contextlib.nullcontext()
        with counting:
            y = super().run_block(block, x)
        if self.forward_s or self.backward_s:
            y = _Wait.apply(y, self.forward_s, self.backward_s)
        return y


def build(forward_s: float = 0.0, backward_s: float = 0.0, seed: int = 0) -> LabGPT:
    """The lab's GPT (:data:`LAB_GPT`), the same weights on every rank for a ``seed``."""
    torch.manual_seed(seed)
    return LabGPT(GPTConfig(**LAB_GPT), forward_s, backward_s)


def micro_batches(m: int, seed: int = 1) -> tuple[list, list]:
    """``m`` micro-batches of :data:`MICRO_BATCH` random sequences, and their targets."""
    c = LAB_GPT
    idx, targets = random_tokens(m * MICRO_BATCH, c["block_size"], c["vocab_size"], seed)
    return list(idx.split(MICRO_BATCH)), list(targets.split(MICRO_BATCH))


def reference_gradients(m: int) -> dict:
    """The gradients of one process running the whole batch (the mean loss over all its
    sequences), by parameter name; the tied output weight is the token embedding's."""
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
    model.held = held = HeldActivations(exclude=model)
    x = torch.zeros(MICRO_BATCH, LAB_GPT["block_size"], LAB_GPT["n_embd"], requires_grad=True)
    model.run_block(model.h[0], x)
    return held.peak

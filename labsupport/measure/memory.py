"""Memory, measured from the tensors themselves: what a model holds, what autograd keeps.

* :func:`count_parameters` and :func:`storage_bytes`: a model's size, a tied weight once;
* :func:`model_state_bytes`: weights, gradients and optimizer state, part by part;
* :func:`saved_tensors`: the bytes autograd saves for the backward pass;
* :class:`LiveMemory`: the bytes alive, and their peak, over a forward and backward pass.

These read the storages of real tensors rather than compute from shapes, so that the
labs can hold each formula of :mod:`labsupport.estimate.memory` against a measurement.
They work on any device; on a GPU, ``torch.cuda.max_memory_allocated`` gives the
allocator's own view, which adds its rounding and caching to what :class:`LiveMemory`
counts.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    """The number of parameters of ``module``; a weight shared by two layers counts once.

    ``module.parameters()`` already yields a shared (tied) parameter only once, which is
    what makes GPT-2's tied embedding and output layer count as one matrix.
    """
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def _key(t: torch.Tensor):
    """What identifies a tensor's memory: its storage (a view and its base share one)."""
    return id(t) if t.is_meta else (t.device, t.untyped_storage().data_ptr())


def storage_bytes(tensors) -> int:
    """Bytes of memory the storages of ``tensors`` (or a module's parameters) occupy.

    Measured from each tensor's storage, not computed from its shape and dtype; a storage
    shared by several tensors (tied weights, views) is counted once.
    """
    if isinstance(tensors, nn.Module):
        tensors = list(tensors.parameters())
    seen = {}
    for t in tensors:
        seen.setdefault(_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes of weights, gradients and Adam's state, read from the tensors themselves.

    Call after at least one ``optimizer.step()`` (Adam creates its state lazily). Adam's
    per-parameter ``step`` counters are reported apart: one scalar per parameter tensor.
    """
    params = list(model.parameters())
    state = [optimizer.state[p] for p in params]
    return {
        "weights": sum(p.nbytes for p in params),
        "gradients": sum(p.grad.nbytes for p in params if p.grad is not None),
        "momentum": sum(s["exp_avg"].nbytes for s in state),
        "variance": sum(s["exp_avg_sq"].nbytes for s in state),
        "step counters": sum(s["step"].nbytes for s in state),
    }


class SavedBytes:
    """What :func:`saved_tensors` counted: ``nbytes`` of distinct storages saved."""

    def __init__(self, exclude: set):
        self.exclude = exclude
        self.storages: dict = {}

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _key(tensor)
        if key not in self.exclude:
            self.storages[key] = tensor.untyped_storage().nbytes()
        return tensor


@contextlib.contextmanager
def saved_tensors(exclude: nn.Module | None = None):
    """Count the bytes autograd saves for the backward pass inside the ``with`` block.

    Every tensor an operation saves for backward passes through a
    ``torch.autograd.graph.saved_tensors_hooks`` pack hook; this one adds up the
    storages it sees (a view and its base count once), leaving out the parameters and
    buffers of ``exclude`` (the model's own state is not an activation).
    """
    state = [*exclude.parameters(), *exclude.buffers()] if exclude is not None else []
    counter = SavedBytes({_key(t) for t in state})
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda tensor: tensor):
        yield counter


class LiveMemory(TorchDispatchMode):
    """Counts the bytes of tensors that ops create and that are still alive; keeps the peak.

    A device-independent stand-in for ``torch.cuda.max_memory_allocated``: every op's
    new output storage is added when created and subtracted when freed (a
    ``weakref.finalize``). Views and in-place results share an input's storage and are
    not counted again. Use as ``with LiveMemory() as tracker: ...``.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if key in inputs or key in self._seen or size == 0:
                continue
            self._seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, size)
        return out

    def _free(self, key, size):
        self.live -= size
        self._seen.discard(key)

"""Memory, measured from the tensors themselves: what a model holds, what autograd keeps.

* :func:`count_parameters` and :func:`storage_bytes`: a model's size, a tied weight once;
* :func:`model_state_bytes`: weights, gradients and optimizer state, part by part;
* :func:`saved_tensors` and :class:`SavedBytes`: the bytes autograd saves for the backward
  pass, and how many of them are alive at once (a pipeline's held activations);
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
    """The bytes autograd saves for the backward pass while it counts: ``nbytes``, every
    storage saved; ``live``, those not freed yet; ``peak``, the most alive at once.

    Every tensor an operation saves passes the pack hook of
    ``torch.autograd.graph.saved_tensors_hooks``; its storage is counted once (a view and
    its base share one) until it is freed, which happens once the backward pass has used
    it and its graph is gone. The parameters and buffers of ``exclude`` are the model's
    state, not activations, and are left out. Count inside ``with counter.saving():``,
    or in the forward pass of some modules only (:meth:`watch`).
    """

    def __init__(self, exclude: nn.Module | None = None):
        state = [*exclude.parameters(), *exclude.buffers()] if exclude is not None else []
        self.exclude = {_key(t) for t in state}
        self.nbytes = self.live = self.peak = 0
        self._alive: set = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def saving(self):
        """A context manager: count what autograd saves inside it (enter it any number
        of times; the counts add up)."""
        return self._hooks

    def watch(self, modules) -> list:
        """Count what each of ``modules`` saves in its forward pass: forward hooks enter
        :meth:`saving` before it and leave after it, however it is called (by its model,
        a pipeline stage, a checkpoint). Returns the hooks' handles (``.remove()``)."""
        handles = []
        for module in modules:
            handles.append(module.register_forward_pre_hook(lambda *_: self._hooks.__enter__()))
            handles.append(
                module.register_forward_hook(
                    lambda *_: self._hooks.__exit__(None, None, None), always_call=True
                )
            )
        return handles

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _key(tensor)
        if key not in self.exclude and key not in self._alive:
            storage = tensor.untyped_storage()
            size = storage.nbytes()
            self._alive.add(key)
            self.nbytes += size
            self.live += size
            self.peak = max(self.peak, self.live)
            if not tensor.is_meta:  # a meta tensor has no memory to free
                weakref.finalize(storage, self._free, key, size)
        return tensor

    def _free(self, key, size: int) -> None:
        self.live -= size
        self._alive.discard(key)


@contextlib.contextmanager
def saved_tensors(exclude: nn.Module | None = None):
    """Count the bytes autograd saves for the backward pass inside the ``with`` block:
    ``with saved_tensors(exclude=model) as saved: ...``, then ``saved.nbytes``
    (a :class:`SavedBytes`, leaving out the parameters and buffers of ``exclude``)."""
    counter = SavedBytes(exclude)
    with counter.saving():
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

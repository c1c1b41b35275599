"""Two points of the backward pass that a sharded data-parallel step hooks on: the end of
a module's backward (:class:`AfterBackward`, FSDP2's ``RegisterPostBackwardFunction``),
and the first gradient that reaches a module's outputs (:func:`on_first_grad`, where
ZeRO-3 gathers the module's weights back). :mod:`labsupport.parallel.zero` uses both.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class AfterBackward(torch.autograd.Function):
    """The identity on a unit's inputs; its backward runs once autograd has computed
    their gradients, that is once the unit's backward is over (FSDP2's
    ``RegisterPostBackwardFunction``, ``torch/distributed/fsdp/_fully_shard/
    _fsdp_param_group.py``: autograd runs a parameter's gradient accumulation as soon as
    it can, before any other ready node)."""

    @staticmethod
    def forward(ctx, callback, *inputs):
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)

    @staticmethod
    def wrap(args, callback):
        """A forward pre-hook: the unit's inputs that need a gradient, through this."""
        flat, spec = tree_flatten(args)
        where = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
        if not where or not torch.is_grad_enabled():
            return None
        through = AfterBackward.apply(callback, *(flat[i] for i in where))
        for i, t in zip(where, through, strict=True):
            flat[i] = t
        return tree_unflatten(flat, spec)


def on_first_grad(output, fn) -> None:
    """Call ``fn`` once, when the backward pass reaches the first of ``output``'s tensors."""
    called = []

    def hook(grad):
        if not called:
            called.append(True)
            fn()
        return grad

    for t in tree_flatten(output)[0]:
        if torch.is_tensor(t) and t.requires_grad:
            t.register_hook(hook)

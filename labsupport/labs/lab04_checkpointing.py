"""Lab 4, section 3: activation checkpointing on :class:`labsupport.models.MLPStack`,
measured (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost",
arXiv:1604.06174).

The bytes the forward saves (:func:`saved_bytes`) and the peak of a training step
(:func:`step_memory`) are held against :func:`labsupport.estimate.memory.checkpoint_saved_bytes`
and :func:`~labsupport.estimate.memory.checkpoint_peak_bytes`; what the recomputation costs
is counted in FLOPs (:func:`recompute_flops`) and timed (:func:`recompute_ratio`).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

from labsupport.measure.flops import count_flops
from labsupport.measure.memory import LiveMemory, saved_tensors
from labsupport.measure.timing import side_by_side
from labsupport.models import MLPStack


def saved_bytes(stack: MLPStack, x, segment: int | None = None) -> int:
    """Bytes of activations the forward of ``stack`` saves for backward, parameters not
    counted (:func:`labsupport.measure.memory.saved_tensors`)."""
    with saved_tensors(exclude=stack) as saved:
        stack(x, segment)
    return saved.nbytes


def step_memory(stack: MLPStack, x, segment: int | None = None) -> dict:
    """Bytes alive after the forward and at the peak of forward + backward.

    The gradients' buffers are allocated before (as in a training loop after the first
    step), so what the tracker sees is activations and backward's temporary gradients.
    """
    for p in stack.parameters():
        p.grad = torch.zeros_like(p)
    x = x.detach().requires_grad_()
    with LiveMemory() as tracker:
        out = stack(x, segment)
        after_forward = tracker.live
        out.sum().backward()
    return {"after_forward": after_forward, "peak": tracker.peak}


def training_step(stack: MLPStack, x, segment: int | None = None) -> None:
    """One forward and backward of ``stack`` on ``x``, checkpointing every ``segment``
    blocks (``None``: no checkpointing); the gradients start from nothing."""
    for p in stack.parameters():
        p.grad = None
    stack(x, segment).sum().backward()


def recompute_flops(stack: MLPStack, x, segment: int = 1, early_stop: bool = True) -> dict:
    """FLOPs of a plain training step and of a checkpointed one, counted while they run
    (:func:`labsupport.measure.flops.count_flops`): the recomputed forwards show up.

    ``early_stop`` is PyTorch's default: the non-reentrant checkpoint stops recomputing a
    segment as soon as backward has every tensor it needs. ``early_stop=False``
    (:func:`torch.utils.checkpoint.set_checkpoint_early_stop`) recomputes each segment
    whole, as the reentrant implementation always does.
    """
    with set_checkpoint_early_stop(early_stop):
        return {
            "plain": count_flops(training_step, stack, x),
            "checkpointed": count_flops(training_step, stack, x, segment),
        }


def recompute_ratio(stack: MLPStack, x, segment: int = 1, rounds: int = 9) -> dict:
    """Time of a checkpointed training step over a plain one, timed side by side
    (:func:`labsupport.measure.timing.side_by_side`)."""

    def step(segment):
        training_step(stack, x, segment)

    t = side_by_side(
        {"plain": lambda: step(None), "checkpointed": lambda: step(segment)}, rounds=rounds
    )
    return {
        "plain": t["plain"],
        "checkpointed": t["checkpointed"],
        "ratio": t["ratio"]["checkpointed"],
    }


#: The textbook's cost of recomputation (Chen et al. 2016): backward costs about twice the
#: forward, so fwd+bwd = 3 forwards, and recomputing every forward adds one. PyTorch's
#: non-reentrant checkpoint stops a segment's recomputation once backward has every tensor
#: it needs (its default, ``early_stop=True``), which saves an :class:`MLPStack` segment's
#: last matmul: 4/3 - 1/(6·segment) in FLOPs; without early stopping it is 4/3.
RECOMPUTE_PREDICTION = 4 / 3

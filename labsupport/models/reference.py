"""The run every parallel one is checked against: one process, each step's whole batch.

A parallel strategy is right when its ranks together do what this loop does alone: the
same loss at every step, the same weights at the end. It is nanoGPT's ``train.py`` loop
(forward, loss, backward, optimizer step) with nothing split; the labs and the unit
tests run it on the global batch that the ranks share out.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn.functional as F
from torch import nn


def gpt_loss(model: nn.Module, idx, targets):
    """The loss a :class:`~labsupport.models.GPT` computes itself: the mean cross-entropy."""
    return model(idx, targets)[1]


def mse_loss(model: nn.Module, x, y):
    """The mean-squared error of a regression model's outputs for ``x`` against ``y``."""
    return F.mse_loss(model(x), y)


def train_one_process(
    model: nn.Module, optimizer, batches: Iterable, loss_fn=gpt_loss
) -> list[float]:
    """One optimizer step of ``model`` per ``(inputs, targets)`` of ``batches``, each
    moved to the model's device: gradients zeroed, ``loss_fn(model, inputs, targets)``,
    backward, ``optimizer.step()``. Returns each step's loss, taken before its step."""
    device = next(model.parameters()).device
    losses = []
    for inputs, targets in batches:
        optimizer.zero_grad()
        loss = loss_fn(model, inputs.to(device), targets.to(device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses

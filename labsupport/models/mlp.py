"""Small fully connected models: an MLP, and a stack of residual MLP blocks.

:class:`MLP` is the plain classifier of chapter 2's parameter counts. :class:`MLPStack`
is chapter 4's model for activation checkpointing (Chen et al. 2016, "Training Deep
Nets with Sublinear Memory Cost", arXiv:1604.06174): ``layers`` residual blocks
``x + fc2(gelu(fc1(x)))``, hidden width ``4d`` like a transformer's MLP, which
checkpoints every ``segment`` blocks when asked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class MLP(nn.Sequential):
    """Fully connected layers of the given ``sizes`` with ReLU in between.

    ``MLP([784, 256, 10])`` is ``Linear(784, 256), ReLU(), Linear(256, 10)``.
    """

    def __init__(self, sizes: list[int]):
        layers = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            if i:
                layers.append(nn.ReLU())
            layers.append(nn.Linear(fan_in, fan_out))
        super().__init__(*layers)


class ResidualBlock(nn.Module):
    """``x + fc2(gelu(fc1(x)))``, hidden width ``4d``: it saves ``9·b·d`` numbers for
    backward (fc1's input ``b·d``, GELU's input ``4bd``, fc2's input ``4bd``)."""

    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class MLPStack(nn.Module):
    """``layers`` residual blocks of width ``d``; weights drawn from ``seed``."""

    def __init__(self, layers: int = 16, d: int = 64, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(ResidualBlock(d) for _ in range(layers))

    def forward(self, x, segment: int | None = None):
        """Run the blocks; with ``segment=c``, checkpoint every run of ``c`` blocks.

        A checkpointed segment keeps only its input; backward re-runs its forward to
        get the rest (``use_reentrant=False``, the implementation PyTorch recommends).
        """
        if segment is None:
            return self._run(x, 0, len(self.blocks))
        for start in range(0, len(self.blocks), segment):
            x = checkpoint(self._run, x, start, start + segment, use_reentrant=False)
        return x

    def _run(self, x, start: int, stop: int):
        for block in self.blocks[start:stop]:
            x = block(x)
        return x

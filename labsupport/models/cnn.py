"""A small convolutional network, built locally (LeCun et al. 1998, LeNet's layout)."""

from __future__ import annotations

from torch import nn


class SmallCNN(nn.Sequential):
    """A LeNet-style CNN for ``image_size`` x ``image_size`` images.

    Two blocks of ``Conv2d(kernel, padding=kernel // 2)``, ``ReLU`` and ``MaxPool2d(2)``,
    then a linear classifier on the flattened feature map (``image_size // 4`` squared
    positions of ``channels[-1]`` features).
    """

    def __init__(self, in_channels=1, channels=(16, 32), kernel=5, image_size=28, classes=10):
        c1, c2 = channels
        side = image_size // 4
        super().__init__(
            nn.Conv2d(in_channels, c1, kernel, padding=kernel // 2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, kernel, padding=kernel // 2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(c2 * side * side, classes),
        )

"""d2l §12.5's LeNet variant used for the from-scratch multi-device experiments."""

from __future__ import annotations

from torch import nn


def lenet(num_classes: int = 10) -> nn.Sequential:
    """LeNet for 1x28x28 inputs: conv 20@3x3, conv 50@5x5 with average pooling, then 800->128->10."""
    return nn.Sequential(
        nn.Conv2d(1, 20, 3), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(20, 50, 5), nn.ReLU(), nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(50 * 4 * 4, 128), nn.ReLU(),
        nn.Linear(128, num_classes),
    )

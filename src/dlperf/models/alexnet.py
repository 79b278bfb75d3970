"""AlexNet-S (ImageNet-sized) and AlexNet-R (CIFAR-10-sized), as in Shi et al.'s public scripts."""

from __future__ import annotations

from torch import nn


def alexnet_s(num_classes: int = 1000) -> nn.Sequential:
    """AlexNet on 3x224x224 without LRN or dropout, so every framework computes the same thing."""
    return nn.Sequential(
        nn.Conv2d(3, 96, 11, stride=4, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(96, 256, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(256, 384, 3, padding=1), nn.ReLU(),
        nn.Conv2d(384, 384, 3, padding=1), nn.ReLU(),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Flatten(),
        nn.Linear(256 * 6 * 6, 4096), nn.ReLU(),
        nn.Linear(4096, 4096), nn.ReLU(),
        nn.Linear(4096, num_classes),
    )


def alexnet_r(num_classes: int = 10) -> nn.Sequential:
    """cuda-convnet's CIFAR-10 network; pooling rounds down, so 32 -> 15 -> 7 -> 3."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 5, padding=2), nn.MaxPool2d(3, 2), nn.ReLU(),
        nn.Conv2d(32, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.AvgPool2d(3, 2),
        nn.Flatten(),
        nn.Linear(64 * 3 * 3, num_classes),
    )

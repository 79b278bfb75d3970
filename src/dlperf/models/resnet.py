"""Residual networks: ResNet-50 (ImageNet), ResNet-56 (CIFAR-10) and d2l §12.6's ResNet-18."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4), with a projection shortcut when the shape changes."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1):
        super().__init__()
        out_ch = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(in_ch, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, out_ch, 1, bias=False), nn.BatchNorm2d(out_ch),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


def resnet50(num_classes: int = 1000) -> nn.Sequential:
    """ResNet-50 v1 with stages of [3, 4, 6, 3] bottlenecks (25,557,032 parameters)."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
        nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1),
    ]
    in_ch = 64
    for i, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
        for b in range(blocks):
            layers.append(Bottleneck(in_ch, width, stride=2 if (b == 0 and i > 0) else 1))
            in_ch = width * Bottleneck.expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, num_classes)]
    return nn.Sequential(*layers)


class CifarBasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus an option-A shortcut (subsample, zero-pad the new channels).

    As in the reference script, convolutions keep their bias and no ReLU follows the addition.
    """

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1), nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_ch, out_ch, 3, padding=1), nn.BatchNorm2d(out_ch),
        )
        self.stride = stride
        self.pad = out_ch - in_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        if self.stride != 1:
            shortcut = shortcut[:, :, ::self.stride, ::self.stride]
        if self.pad:
            shortcut = F.pad(shortcut, (0, 0, 0, 0, 0, self.pad))
        return self.body(x) + shortcut


def resnet56(num_classes: int = 10) -> nn.Sequential:
    """ResNet-56 for CIFAR-10: 3 stages of 9 basic blocks at 16/32/64 channels (855,050 parameters)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True)]
    in_ch = 16
    for i, width in enumerate((16, 32, 64)):
        for b in range(9):
            layers.append(CifarBasicBlock(in_ch, width, stride=2 if (b == 0 and i > 0) else 1))
            in_ch = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, num_classes)]
    return nn.Sequential(*layers)


class Residual(nn.Module):
    """d2l's residual block: two 3x3 convs with BN, an optional 1x1 projection, ReLU after the add."""

    def __init__(self, in_ch: int, out_ch: int, use_1x1conv: bool = False, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.conv3 = nn.Conv2d(in_ch, out_ch, 1, stride=stride) if use_1x1conv else None
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.bn2 = nn.BatchNorm2d(out_ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        if self.conv3 is not None:
            x = self.conv3(x)
        return F.relu(y + x)


def resnet18(num_classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """d2l §12.6's ResNet-18 for 28x28 images: 3x3 stem, no max-pool, global average pooling."""
    layers: list[nn.Module] = [nn.Conv2d(in_channels, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU()]
    in_ch = 64
    for i, width in enumerate((64, 128, 256, 512)):
        for b in range(2):
            downsample = b == 0 and i > 0
            layers.append(Residual(in_ch, width, use_1x1conv=downsample, stride=2 if downsample else 1))
            in_ch = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, num_classes)]
    return nn.Sequential(*layers)

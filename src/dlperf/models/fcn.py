"""Fully connected networks: Shi et al.'s FCN-S and FCN-R, and d2l's §12.1 MLP."""

from __future__ import annotations

from torch import nn


def fully_connected(sizes: list[int], activation: type[nn.Module]) -> nn.Sequential:
    """Linear layers through ``sizes`` with ``activation`` after every layer but the last."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)


def fcn_s() -> nn.Sequential:
    """FCN-S: 26752 -> 3 x 2048 (sigmoid) -> 26752, the synthetic speech-sized network."""
    return fully_connected([26752, 2048, 2048, 2048, 26752], nn.Sigmoid)


def fcn_r() -> nn.Sequential:
    """FCN-R: MNIST 784 -> 2048 -> 4096 -> 1024 (sigmoid) -> 10."""
    return nn.Sequential(nn.Flatten(), *fully_connected([784, 2048, 4096, 1024, 10], nn.Sigmoid))


def mlp() -> nn.Sequential:
    """d2l §12.1's network: 512 -> 256 -> 128 -> 2 with ReLU."""
    return fully_connected([512, 256, 128, 2], nn.ReLU)

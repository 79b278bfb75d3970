"""What tests of training steps share: a plain reference step, and a model no graph can replay."""

from __future__ import annotations

import torch
from torch import nn


def reference_step(model, loss_fn, optimizer, x, y):
    """The training step written out here, not the library's: what every faster step is checked against."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


class Branchy(nn.Module):
    """Data-dependent control flow: no graph can replay it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(x) if x.mean() > 0 else -self.fc(x)


def branchy_batch(g: torch.Generator):
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)

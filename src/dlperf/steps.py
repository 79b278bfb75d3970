"""The plain training step: zero the gradients, forward, loss, backward, update.

It lives here, below both :mod:`dlperf.bench` and :mod:`dlperf.hybrid`, because both build on it:
the benchmark's ``eager`` mode is this step, the forward-only hybrid step
(:func:`dlperf.hybrid.bench_mode.make_step`) is this step around a hybridized model, and the captured
training step falls back to it where a model cannot be captured. Neither package has to import the other
for it.

>>> import torch
>>> from torch import nn
>>> net = nn.Linear(3, 2)
>>> step = eager_step(net, nn.functional.cross_entropy, torch.optim.SGD(net.parameters(), lr=0.1))
>>> step(torch.randn(4, 3), torch.tensor([0, 1, 0, 1])).dim()
0
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["MakeStep", "StepFn", "eager_step"]

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""One full training step on a batch: ``step(x, y) -> loss``."""
MakeStep = Callable[..., StepFn]
"""``make_step(model, loss_fn, optimizer, example_x, example_y) -> StepFn``."""


def eager_step(model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
               example_x: torch.Tensor | None = None, example_y: torch.Tensor | None = None) -> StepFn:
    """Plain PyTorch: the reference every other mode is checked against; the model is called on ``x`` as
    :func:`dlperf.batch.call_model` calls it (a tuple is its positional inputs)."""
    from .batch import call_model

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(call_model(model, x), y)
        loss.backward()
        optimizer.step()
        return loss

    return step

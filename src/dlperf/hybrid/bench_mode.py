"""The training step behind ``dlperf bench --mode hybrid``.

>>> import torch
>>> from dlperf.models import get_spec
>>> spec = get_spec("lenet")
>>> net = spec.build()
>>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
>>> x, y = spec.input.make_batch(8)
>>> step = make_step(net, spec.loss, opt, x, y)
>>> loss = step(x, y)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..steps import StepFn, eager_step
from .hybridize import HybridModule, hybridize


def make_step(model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              optimizer: torch.optim.Optimizer, example_x: torch.Tensor, example_y: torch.Tensor,
              *, backend: str = "auto") -> StepFn:
    """One training step (zero grads, forward, loss, backward, update) through a hybridized model.

    Numerically the eager step: the forward replays the captured graph with autograd recording,
    so gradients and the optimizer update are eager's. A model that cannot be captured runs
    eagerly, with a :class:`~dlperf.hybrid.HybridizeWarning` saying why (raised here, at capture,
    not in the first timed step). ``example_y`` is accepted for symmetry with the other modes.
    """
    del example_y  # the loss is not captured: it is one or two ops on a small tensor
    net: HybridModule = hybridize(model, backend=backend)
    net.capture(example_x)

    step = eager_step(net, loss_fn, optimizer)  # the same step; only the forward is replayed
    step.hybrid_module = net  # type: ignore[attr-defined]  # for reports: repr says what runs
    return step

"""The training steps behind ``dlperf bench``'s hybrid variants.

``make_captured_step`` is what ``--mode hybrid`` times, and ``--mode auto`` as its ``hybrid`` candidate: the
whole training step (forward, loss, backward, update) captured once by :func:`~dlperf.hybrid.train_step` and
replayed, or the eager step where the model cannot be captured, with the reason in ``eager_reason``.
``make_step`` replays only the forward, with autograd recording through it: the hybridize benchmark
(``benchmarks/bench_hybridize.py``) sets it beside the captured step.

>>> import torch
>>> from dlperf.models import get_spec
>>> spec = get_spec("lenet")
>>> net = spec.build()
>>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
>>> x, y = spec.input.make_batch(8)
>>> step = make_captured_step(net, spec.loss, opt, x, y, backend="graph")
>>> loss = step(x, y)
>>> step.runs_on
'graph'
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..steps import StepFn, eager_step
from .hybridize import HybridModule, hybridize
from .train_step import TrainStep, make_train_step


def make_captured_step(model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       optimizer: torch.optim.Optimizer, example_x, example_y, *,
                       backend: str = "auto") -> TrainStep:
    """One training step captured whole on the example batch, before the first timed step.

    Numerically the eager step (weights, buffers and optimizer state; see :mod:`.train_step`). ``runs_on``
    names what steps the model; a model that cannot be captured runs eagerly, with a
    :class:`~dlperf.hybrid.HybridizeWarning` here and the reason in ``eager_reason``. Capturing on the
    example changes nothing: its step is undone on the model and the optimizer.
    """
    return make_train_step(model, loss_fn, optimizer, example_x, example_y, backend=backend)


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

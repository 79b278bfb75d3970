"""Execution modes for the benchmarked training step: how forward/backward/update are run.

A mode is a function ``make_step(model, loss_fn, optimizer, example_x, example_y)`` returning a
callable ``step(x, y) -> loss`` that performs one full training step. Modes register themselves;
those with heavy imports are named by ``"module:function"`` and imported on first use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..registry import Registry
from ..steps import MakeStep, StepFn, eager_step


def compiled_step(model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                  example_x: torch.Tensor | None = None, example_y: torch.Tensor | None = None) -> StepFn:
    """torch.compile of forward and loss; compilation happens during the warm-up steps."""
    compiled = torch.compile(lambda x, y: loss_fn(model(x), y))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = compiled(x, y)
        loss.backward()
        optimizer.step()
        return loss

    return step


_MODES: Registry[MakeStep] = Registry("mode")
_MODES.register("eager", eager_step)
_MODES.register("compile", compiled_step)
# the whole step captured and replayed (dlperf.hybrid.train_step), eager where it cannot be captured
_MODES.register("hybrid", "dlperf.hybrid.bench_mode:make_captured_step")
_MODES.register("auto", "dlperf.bench.auto:make_step")


def mode_names() -> list[str]:
    return list(_MODES.names())


def register_mode(name: str, make_step: MakeStep | str, *, replace: bool = False) -> None:
    _MODES.register(name, make_step, replace=replace)


def get_mode(name: str) -> MakeStep:
    """The step builder for ``name``; an unknown name lists the valid ones."""
    return _MODES.get(name)

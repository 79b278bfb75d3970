"""Execution modes for the benchmarked training step: how forward/backward/update are run.

A mode is a function ``make_step(model, loss_fn, optimizer, example_x, example_y)`` returning a
callable ``step(x, y) -> loss`` that performs one full training step. Modes register themselves;
those with heavy imports are named by ``"module:function"`` and imported on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import nn

from ..errors import unknown_choice

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MakeStep = Callable[..., StepFn]


def eager_step(model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
               example_x: torch.Tensor | None = None, example_y: torch.Tensor | None = None) -> StepFn:
    """Plain PyTorch: the reference every other mode is checked against."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return step


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


_MODES: dict[str, MakeStep | str] = {
    "eager": eager_step,
    "compile": compiled_step,
    "hybrid": "dlperf.hybrid.bench_mode:make_step",
    "auto": "dlperf.bench.auto:make_step",
}


def mode_names() -> list[str]:
    return list(_MODES)


def register_mode(name: str, make_step: MakeStep | str) -> None:
    _MODES[name] = make_step


def get_mode(name: str) -> MakeStep:
    """The step builder for ``name``; an unknown name lists the valid ones."""
    try:
        entry = _MODES[name]
    except KeyError:
        raise unknown_choice("mode", name, _MODES) from None
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
        _MODES[name] = entry
    return entry

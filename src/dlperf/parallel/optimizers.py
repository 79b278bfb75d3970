"""Optimizers by name: the registry the Trainer, the parameter servers and ``dlperf train`` share.

>>> from torch import nn
>>> type(make_optimizer("sgd", nn.Linear(2, 2).parameters(), {"lr": 0.1})).__name__
'SGD'
>>> make_optimizer("lion", [])
Traceback (most recent call last):
  ...
dlperf.errors.UsageError: unknown optimizer 'lion'; valid choices: sgd, adam, adamw
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..registry import Registry

__all__ = ["OPTIMIZERS", "OptimizerLike", "make_optimizer", "optimizer_name"]

OPTIMIZERS: Registry[Callable[..., torch.optim.Optimizer]] = Registry("optimizer", normalize=str.lower)
OPTIMIZERS.register("sgd", torch.optim.SGD)
OPTIMIZERS.register("adam", torch.optim.Adam)
OPTIMIZERS.register("adamw", torch.optim.AdamW)

OptimizerLike = str | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def make_optimizer(optimizer: OptimizerLike, params: Iterable[nn.Parameter],
                   optimizer_params: dict[str, Any] | None = None) -> torch.optim.Optimizer:
    """Build an optimizer from a name (``sgd``, ``adam``, ``adamw``) or a factory ``params -> optimizer``.

    Named SGD updates all parameters with one multi-tensor (``foreach``) call unless the parameters
    say otherwise: on CPU PyTorch's default loops over the tensors in Python, which costs LeNet's
    update 55 us instead of 37 us, and the update runs on the critical path between two steps.
    """
    if callable(optimizer):
        return optimizer(params)
    cls = OPTIMIZERS.get(str(optimizer))
    kwargs = dict(optimizer_params or {})
    if cls is torch.optim.SGD and "foreach" not in kwargs and not kwargs.get("fused") \
            and not kwargs.get("differentiable"):
        kwargs["foreach"] = True
    return cls(params, **kwargs)


def optimizer_name(opt: torch.optim.Optimizer) -> str:
    """The name an engine operation running ``opt.step`` carries (``sgd``, ``adam``)."""
    return type(opt).__name__.lower()

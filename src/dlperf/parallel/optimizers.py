"""Optimizers and learning-rate schedules by name: the registries the Trainer, the parameter servers and
``dlperf train`` share.

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
from typing import Any, cast

import torch
from torch import nn

from ..registry import Registry

__all__ = ["OPTIMIZERS", "OptimizerLike", "make_optimizer", "optimizer_name", "SCHEDULES", "ScheduleLike",
           "make_schedule", "WARMUP_SHARE"]

OPTIMIZERS: Registry[Callable[..., torch.optim.Optimizer]] = Registry("optimizer", normalize=str.lower)
OPTIMIZERS.register("sgd", torch.optim.SGD)
OPTIMIZERS.register("adam", torch.optim.Adam)
OPTIMIZERS.register("adamw", torch.optim.AdamW)

OptimizerLike = str | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def make_optimizer(optimizer: OptimizerLike, params: Iterable[nn.Parameter],
                   optimizer_params: dict[str, Any] | None = None) -> torch.optim.Optimizer:
    """Build an optimizer from a name (``sgd``, ``adam``, ``adamw``), a ``torch.optim.Optimizer`` class (given
    ``optimizer_params``), or a factory ``params -> optimizer``.

    Named SGD updates all parameters with one multi-tensor (``foreach``) call unless the parameters
    say otherwise: on CPU PyTorch's default loops over the tensors in Python, which costs LeNet's
    update 55 us instead of 37 us, and the update runs on the critical path between two steps.
    """
    factory: Any = optimizer
    if isinstance(factory, type) and issubclass(factory, torch.optim.Optimizer):
        return cast(torch.optim.Optimizer, factory(params, **dict(optimizer_params or {})))
    if callable(factory):
        return cast(torch.optim.Optimizer, factory(params))
    cls = OPTIMIZERS.get(str(optimizer))
    kwargs = dict(optimizer_params or {})
    if cls is torch.optim.SGD and "foreach" not in kwargs and not kwargs.get("fused") \
            and not kwargs.get("differentiable"):
        kwargs["foreach"] = True
    return cls(params, **kwargs)


def optimizer_name(opt: torch.optim.Optimizer) -> str:
    """The name an engine operation running ``opt.step`` carries (``sgd``, ``adam``)."""
    return type(opt).__name__.lower()


Scheduler = torch.optim.lr_scheduler.LRScheduler
ScheduleLike = str | Callable[[torch.optim.Optimizer], Any] | None

WARMUP_SHARE = 0.1
"""The share of the run the ``warmup`` schedule ramps the learning rate over, linearly from a tenth of it."""


def _constant(opt: torch.optim.Optimizer, total: int) -> Scheduler:
    return torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0)


def _step(opt: torch.optim.Optimizer, total: int) -> Scheduler:
    # the classic ResNet recipe: a tenth of the rate at half the run, a hundredth at three quarters
    return torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[max(1, total // 2), max(2, total * 3 // 4)],
                                                gamma=0.1)


def _cosine(opt: torch.optim.Optimizer, total: int) -> Scheduler:
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, total))


def _warmup(opt: torch.optim.Optimizer, total: int) -> Scheduler:
    return torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, end_factor=1.0,
                                             total_iters=max(1, round(WARMUP_SHARE * total)))


SCHEDULES: Registry[Callable[[torch.optim.Optimizer, int], Scheduler]] = Registry("learning-rate schedule",
                                                                                   normalize=str.lower)
SCHEDULES.register("constant", _constant)
SCHEDULES.register("step", _step)
SCHEDULES.register("cosine", _cosine)
SCHEDULES.register("warmup", _warmup)


def make_schedule(schedule: ScheduleLike, optimizer: torch.optim.Optimizer, total_steps: int | None) -> Any:
    """The scheduler for ``optimizer``: a name (``constant``, ``step``, ``cosine`` to zero over the run, ``warmup``
    from a tenth of the rate over its first tenth) over ``total_steps`` updates, or a factory ``optimizer ->
    scheduler``; None: none.

    >>> opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> sched = make_schedule("cosine", opt, total_steps=4)
    >>> rates = []
    >>> for _ in range(3):
    ...     opt.step(); sched.step(); rates.append(round(opt.param_groups[0]["lr"], 3))
    >>> rates
    [0.854, 0.5, 0.146]
    """
    if schedule is None:
        return None
    if callable(schedule):
        return schedule(optimizer)
    from ..errors import UsageError

    if total_steps is None:
        raise UsageError(f"lr_schedule={schedule!r} needs the run's length in updates: give schedule_steps")
    return SCHEDULES.get(schedule)(optimizer, total_steps)

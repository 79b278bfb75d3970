"""Gluon's Trainer calls: the caller-driven ``step``, its two halves and the learning rate (MXNet's semantics).

``step(batch_size)`` updates from gradients the caller's own backward left on the replicas;
``allreduce_grads()`` then ``update(batch_size)`` is the same in two halves, with room between them to
change the summed gradients (clip them); ``optimizer``, ``learning_rate`` and
``set_learning_rate`` reach every optimizer that updates the weights, each replica's or the store's.
Where dlperf differs from MXNet here, see docs/mxnet-differences.md.
"""

from __future__ import annotations

import warnings

import torch

from ...errors import UsageError
from ...optimizer_group import OptimizerGroup
from ..strategies import Strategy

__all__ = ["GluonCalls"]


class GluonCalls:
    """What :class:`~dlperf.parallel.Trainer` adds for Gluon's calls (a base class of it, not used alone)."""

    strategy: Strategy
    _optimizer_group: OptimizerGroup | None = None
    _warned_momentum = False

    def _check_open(self) -> None:
        raise NotImplementedError

    def _after_update(self) -> None:
        raise NotImplementedError

    def step(self, batch_size: int) -> None:
        """Aggregate gradients the caller computed on the replicas, divide by ``batch_size``, update.

        The caller's losses are sums over examples (as in Gluon's ``Trainer.step``); across processes
        ``batch_size`` counts the examples of every process.
        """
        self._check_open()
        if batch_size < 1:
            raise UsageError(f"batch_size must be >= 1, got {batch_size}")
        self.strategy.finish(1.0 / batch_size)
        self._after_update()

    def allreduce_grads(self) -> None:
        """Sum the gradients the caller computed on the replicas, so that every replica holds the sum.

        Gluon's first half of :meth:`step`: change the summed gradients (clip them, say) and then call
        :meth:`update`. Not with ``update_on_kvstore=True``, where the store sums and updates in one go.

        >>> import torch
        >>> from torch import nn
        >>> from dlperf.devices import cpu
        >>> from dlperf.parallel import Trainer
        >>> with Trainer(nn.Linear(2, 1), [cpu(0), cpu(1)], "sgd", {"lr": 0.1}) as trainer:
        ...     trainer.zero_grad()
        ...     for i, replica in enumerate(trainer.replicas):
        ...         (i * replica(torch.ones(1, 2))).sum().backward()
        ...     trainer.allreduce_grads()
        ...     [r.bias.grad.item() for r in trainer.replicas]
        ...     trainer.update(batch_size=1)
        [1.0, 1.0]
        """
        self._check_open()
        self.strategy.reduce_gradients()

    def update(self, batch_size: int) -> None:
        """Update the weights with the gradients :meth:`allreduce_grads` summed, divided by ``batch_size``."""
        self._check_open()
        if batch_size < 1:
            raise UsageError(f"batch_size must be >= 1, got {batch_size}")
        self.strategy.update(1.0 / batch_size)
        self._after_update()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizers that update the weights (each replica's, or the store's) as one, for a scheduler.

        ``torch.optim.lr_scheduler.StepLR(trainer.optimizer, ...)`` changes the rate of every replica's
        optimizer, or of the store's with ``update_on_kvstore=True``, as a Gluon scheduler changes its
        Trainer's; stepping it after each :meth:`train_step` or :meth:`step` is the usual loop. With
        parameter servers the optimizer runs on the servers and this raises.
        """
        if self._optimizer_group is None:
            self.strategy.update_optimizers()  # raises where the optimizer runs elsewhere (parameter servers)
            # the members are asked for on every access: a plan that rebuilds the replicas brings new ones
            self._optimizer_group = OptimizerGroup(lambda: self.strategy.update_optimizers(),
                                                   "the trainer's optimizers")
        return self._optimizer_group

    @property
    def learning_rate(self) -> float:
        """The current learning rate (Gluon's ``trainer.learning_rate``)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def set_learning_rate(self, lr: float) -> None:
        """Set every optimizer's learning rate (Gluon's ``trainer.set_learning_rate``).

        A momentum SGD keeps PyTorch's formula: its velocity is a sum of gradients that the new rate
        scales as a whole, where MXNet's velocity holds past steps at the rate they were taken (see
        docs/mxnet-differences.md); this warns once per trainer when that makes a difference.
        """
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0:
            raise UsageError(f"lr={lr!r}: expected a number >= 0")
        groups = self.optimizer.param_groups
        if not self._warned_momentum and any(g.get("momentum") and g["lr"] != lr for g in groups) and \
                any(isinstance(o, torch.optim.SGD) for o in self._group_members()):
            self._warned_momentum = True
            warnings.warn("set_learning_rate on SGD with momentum: PyTorch scales the whole velocity (past steps "
                          "too) by the new rate, MXNet only the steps after the change; results differ from "
                          "MXNet's from here on (docs/mxnet-differences.md)", UserWarning, stacklevel=2)
        for g in groups:
            g["lr"] = lr

    def _group_members(self) -> list[torch.optim.Optimizer]:
        return self.strategy.update_optimizers()


"""The protocol of a gradient synchronization strategy: one class per way to keep replicas identical.

A :class:`~dlperf.parallel.Trainer` runs each replica's forward and backward as an engine operation;
its strategy decides everything about the gradients. The Trainer calls, per step:

1. :meth:`Strategy.begin_step` in the caller's thread, before the replicas' operations are pushed;
2. :meth:`Strategy.zero_grad` and, after backward, :meth:`Strategy.after_backward` inside replica
   ``i``'s operation (a bucketed strategy's buckets call :meth:`Strategy.on_bucket` from backward's
   hooks as they fill);
3. :meth:`Strategy.wait_replicas` for the replicas' operations, then :meth:`Strategy.end_step`
   (and :meth:`Strategy.abort_step` first when the step failed);
4. :meth:`Strategy.finish` with the gradients' scale: whatever of the update is not done yet.

:meth:`Strategy.finish` without :meth:`Strategy.begin_step` is the caller-driven step
(:meth:`~dlperf.parallel.Trainer.step`): the gradients are reduced from scratch. Each implementation
registers itself in :data:`STRATEGIES` under its :attr:`Strategy.name`; the factory
(:func:`~dlperf.parallel.strategies.factory.choose_strategy`) picks one from the options.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from ...engine import Op, Var
from ...errors import UsageError
from ...kvstore import KVStore
from ...registry import Registry
from ..communication.buckets import GradientBuckets
from ..communication.process_group import ProcessAxis
from .context import StepContext

__all__ = ["Strategy", "ReplicaOptimizers", "STRATEGIES", "register_strategy", "StrategyOptions"]


@dataclass(frozen=True)
class StrategyOptions:
    """What a strategy is chosen against: the store, this process's devices, the processes."""

    kvstore: str | KVStore | None = None
    update_on_kvstore: bool = False
    devices: int = 1
    processes: int = 1
    gpus: bool = False

    @property
    def distributed(self) -> bool:
        """Whether the store spans processes (its class says so: a ``dist_*`` type)."""
        from ..communication.servers import is_dist_kvstore

        return self.kvstore is not None and is_dist_kvstore(self.kvstore)

STRATEGIES: Registry[type[Strategy]] = Registry("gradient synchronization strategy")
"""Every strategy by name; a miss lists what exists."""

S = TypeVar("S", bound="type[Strategy]")


def register_strategy(cls: S) -> S:
    """Class decorator: make ``cls`` available in :data:`STRATEGIES` under ``cls.name``."""
    STRATEGIES.register(cls.name, cls)
    return cls


class Strategy(ABC):
    """One way to synchronize gradients and update the replicas; see the module docstring for the calls."""

    name: ClassVar[str] = ""
    """The registry name (``one-device``, ``allreduce``, ...)."""
    state_key: ClassVar[str] = "optimizer"
    """The key :meth:`state_dict` keeps the update's state under: ``"optimizer"`` or ``"kvstore"``."""
    costs: ClassVar[tuple[str, ...]] = ()
    """The names of its cost formulas in :data:`dlperf.probe.projection.COSTS` (the planner and ``dlperf scale``
    price it by them): its own name, or its name and a variant (``allreduce-ring``)."""
    planned: ClassVar[bool] = False
    """Whether the planner measures it for plans of several replicas where it can run (see :meth:`unusable`)."""

    @classmethod
    def unusable(cls, options: StrategyOptions) -> str | None:
        """Why a trainer with these options cannot synchronize with this strategy (None: it can), in a few
        words that follow its name: ``"needs a kvstore"``."""
        return None

    def __init__(self, kvstore: str | KVStore | None = None) -> None:
        self.kvstore_option = kvstore
        self._ctx: StepContext | None = None
        self._params: list[list[torch.Tensor]] | None = None

    @property
    def ctx(self) -> StepContext:
        """The context given to :meth:`attach`."""
        if self._ctx is None:
            raise RuntimeError(f"the {self.name!r} strategy is not attached to a trainer yet")
        return self._ctx

    def join(self, axis: ProcessAxis | None) -> ProcessAxis | None:
        """The processes the trainer spans, given those it joined (before any replica exists)."""
        return axis

    def attach(self, ctx: StepContext) -> None:
        """Take the trainer's replicas and engine: build optimizers, buckets or store keys."""
        self._ctx = ctx

    def zero_grad(self, i: int) -> None:
        """Clear replica ``i``'s gradients (inside its operation, before its backward)."""
        # listed once: walking the module's tree every step costs tens of microseconds on a small model
        if self._params is None:
            self._params = [list(r.parameters()) for r in self.ctx.replicas]
        for p in self._params[i]:
            p.grad = None

    def begin_step(self) -> None:  # noqa: B027 (most strategies prepare nothing)
        """A step starts: the next backward on every replica belongs to it."""

    def on_bucket(self, b: int) -> list[Var]:
        """Push gradient bucket ``b``'s reduction; the variables it leaves written (bucketed strategies)."""
        raise RuntimeError(f"the {self.name!r} strategy has no gradient buckets")

    def after_backward(self, i: int) -> None:  # noqa: B027
        """Replica ``i``'s backward ended (inside its operation)."""

    def wait_replicas(self, ops: Sequence[Op]) -> list[Any]:
        """Wait for the replicas' operations (and what they pushed); their results."""
        return self.ctx.wait_ops(ops)

    def abort_step(self) -> None:  # noqa: B027
        """The step failed: wait for whatever it pushed, so nothing writes after the caller saw the error."""

    def end_step(self) -> None:  # noqa: B027
        """The replicas' operations are over (after success or failure)."""

    @abstractmethod
    def finish(self, scale: float) -> None:
        """Complete the update with the gradients multiplied by ``scale`` (all of it without a begun step)."""

    def reduce_gradients(self) -> None:
        """Sum the replicas' gradients so that each holds the sum, without updating (Gluon's ``allreduce_grads``)."""
        raise UsageError(f"the {self.name!r} strategy updates the weights where it sums the gradients, so the sum "
                         "cannot be split from the update; create the trainer with update_on_kvstore=False to "
                         "call allreduce_grads() and update(), or call step()")

    def update(self, scale: float) -> None:
        """Update with the gradients :meth:`reduce_gradients` summed, multiplied by ``scale`` (Gluon's ``update``)."""
        raise UsageError(f"the {self.name!r} strategy updates the weights where it sums the gradients; create the "
                         "trainer with update_on_kvstore=False to call allreduce_grads() and update(), or call "
                         "step()")

    def update_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers that update the weights in this process (for learning-rate schedules)."""
        raise UsageError(f"the {self.name!r} strategy has no optimizer in this process")

    @contextmanager
    def restoring(self) -> Iterator[None]:
        """The trainer restores a checkpoint: the replicas' loads inside are not a change of weights to act on."""
        yield

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The update's state for a checkpoint: ``{"optimizer": ...}`` or ``{"kvstore": ...}``."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave (the trainer's whole state dict is passed)."""

    def close(self) -> None:  # noqa: B027
        """Detach from the replicas (the engine is closed by the trainer)."""


class ReplicaOptimizers(Strategy):
    """A strategy whose replicas each run their own optimizer on identical (reduced) gradients."""

    def __init__(self, kvstore: str | KVStore | None = None) -> None:
        super().__init__(kvstore)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.buckets: GradientBuckets | None = None
        self._in_step = False
        self._reduced = False  # reduce_gradients ran since the last update

    def attach(self, ctx: StepContext) -> None:
        super().attach(ctx)
        self.optimizers = [ctx.make_optimizer(r.parameters()) for r in ctx.replicas]

    def zero_grad(self, i: int) -> None:
        if self.buckets is None:
            super().zero_grad(i)
            return
        self.buckets.bind(i)
        self.buckets.zero_(i)

    def begin_step(self) -> None:
        self._in_step = True
        if self.buckets is not None:
            self.buckets.arm()

    def after_backward(self, i: int) -> None:
        if self.buckets is not None:
            self.buckets.replica_done()

    def abort_step(self) -> None:
        self._in_step = False
        if self.buckets is not None:  # no reduction still running may write into buffers the next step zeroes
            self.buckets.drain()

    def end_step(self) -> None:
        if self.buckets is not None:
            self.buckets.disarm()

    def reduce_gradients(self) -> None:
        buckets = self.buckets
        if buckets is not None:
            if not self._in_step:
                buckets.allreduce_all()
            self._in_step = False
            try:
                buckets.wait()
            except BaseException:
                self.ctx.renew_failed_vars()
                raise
        self._reduced = True

    def update(self, scale: float) -> None:
        if not self._reduced and self.buckets is not None:
            raise UsageError("update() after backward needs the replicas' gradients summed first: call "
                             "allreduce_grads() before update(), or step(batch_size), which does both")
        self.finish(scale)

    def update_optimizers(self) -> list[torch.optim.Optimizer]:
        return self.optimizers

    def finish(self, scale: float) -> None:
        """Sum the replicas' gradients (unless the begun step's buckets did), scale them, step every optimizer."""
        ctx, buckets = self.ctx, self.buckets
        reduced, self._in_step, self._reduced = self._in_step or self._reduced, False, False
        if buckets is not None and not reduced:
            buckets.allreduce_all()
        if buckets is not None and (scale != 1.0 or ctx.update_waits):
            buckets.wait()
            if scale != 1.0:
                buckets.scale_(scale)
        elif buckets is None and scale != 1.0:
            for p in ctx.replicas[0].parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        if ctx.clip_grad_norm is not None:
            ctx.clip_(self._grads_by_replica())
        if ctx.check_finite:
            # reduced: every replica holds the same sums
            grads = ctx.replica_grads() if buckets is None else [row[0] for row in buckets.flats]
            ctx.raise_if_nonfinite("gradient", grads)
        ctx.step_optimizers(self.optimizers, tuple(buckets.done_vars()) if buckets is not None else ())

    def _grads_by_replica(self) -> list[list[torch.Tensor]]:
        """Each replica's summed gradients: its bucket buffers, else its parameters' ``.grad``."""
        if self.buckets is not None:
            return [[row[i] for row in self.buckets.flats] for i in range(self.ctx.k)]
        return [[p.grad for p in r.parameters() if p.grad is not None] for r in self.ctx.replicas]

    def state_dict(self) -> dict[str, Any]:
        # deep copy: an optimizer's state_dict holds its live buffers (momentum), which later steps change
        return {"optimizer": copy.deepcopy(self.optimizers[0].state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "optimizer" not in state:
            raise UsageError(f"the state holds no 'optimizer' (keys: {sorted(state)}); the {self.name!r} strategy "
                             "keeps one optimizer per replica: resume with the settings that wrote it")
        for opt in self.optimizers:
            # one copy per replica: load_state_dict keeps tensors that are already on the right
            # device, and two optimizers sharing a momentum buffer would update it twice per step
            opt.load_state_dict(copy.deepcopy(state["optimizer"]))

    def close(self) -> None:
        if self.buckets is not None:
            self.buckets.close()

"""TrainerConfig: how a :class:`~dlperf.parallel.Trainer` trains, checked when it is made.

>>> TrainerConfig(optimizer="sgd", optimizer_params={"lr": 0.1}, kvstore="local").kvstore
'local'
>>> TrainerConfig(buffers="shared")
Traceback (most recent call last):
  ...
dlperf.errors.UsageError: unknown buffer mode 'shared'; valid choices: per-device, broadcast
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import UsageError, unknown_choice
from ...kvstore import KVStore
from ...losses import resolve_loss
from ..allreduce import DEFAULT_ALGORITHM, AllreduceAlgorithm, get_algorithm
from ..optimizers import OPTIMIZERS, SCHEDULES, OptimizerLike, ScheduleLike, make_optimizer
from ..planning.plan import Plan, parse_plan
from ..planning.records import PlannerOptions
from ..strategies import STRATEGIES, Strategy, strategy_class
from ..strategies.factory import check_update_on_kvstore

__all__ = ["TrainerConfig", "BUFFER_MODES", "MEMORY_FORMATS", "LossLike"]

BUFFER_MODES = ("per-device", "broadcast")
MEMORY_FORMATS = ("auto", "contiguous", "channels_last")

LossLike = str | Callable[..., torch.Tensor] | None


@dataclass
class TrainerConfig:
    """How a :class:`Trainer` trains; every field is checked when the config is made.

    Across processes: the first process's weights are copied to the others when the trainer starts;
    a batch with fewer examples than the devices of all processes together is refused in every
    process alike (so no process waits for another); a parameter that gets no gradient in some
    process contributes zeros there, as in one process. Gradient summation across processes needs
    CPU devices (gloo on host memory). With a distributed store (d2l 12.7) the processes push their
    gradients to the parameter servers, which sum them, run the optimizer and answer the pulls with
    the new weights: the job's last ``num_servers`` ranks (``dlperf launch --num-servers``; they run
    :func:`~dlperf.parallel.communication.servers.serve_kvstore`, not a Trainer), or with none every process hosts
    one for its share of the weights. The Trainer then spans the worker ranks only.
    """

    optimizer: OptimizerLike = "sgd"
    """A name from :data:`OPTIMIZERS` or a factory ``params -> torch.optim.Optimizer`` (one per replica)."""
    optimizer_params: dict[str, Any] | None = None
    """Keyword arguments for a named optimizer, e.g. ``{"lr": 0.1}``."""
    loss: LossLike = None
    """What each step minimises, averaged over the examples it sees (:mod:`dlperf.losses`): a name (``ce``,
    ``mse``, ``l1``, ``smooth-l1``, ``bce``), a ``torch.nn`` loss or ``fn(outputs, targets)``; None: the model's
    own (``outputs["loss"]``), else cross-entropy where the targets are class labels."""
    lr_schedule: ScheduleLike = None
    """A learning-rate schedule stepped after every update: ``constant``, ``step``, ``cosine``, ``warmup``
    (:data:`~dlperf.parallel.optimizers.SCHEDULES`, over ``schedule_steps`` updates) or a factory
    ``optimizer -> scheduler``; None: none."""
    schedule_steps: int | None = None
    """The updates a named schedule spans (``dlperf train`` sets it to the run's)."""
    accumulate: int = 1
    """Micro-batches whose gradients are summed before one synchronization and update (DDP's ``no_sync``): each
    ``train_step`` takes one, every ``accumulate``-th updates (and :meth:`~Trainer.flush` updates on the rest)."""
    clip_grad_norm: float | None = None
    """Scale the summed gradients down to this total 2-norm before each update (None: never)."""
    strategy: str | type[Strategy] | Strategy | None = None
    """How gradients are synchronized: a registered name (:data:`~dlperf.parallel.strategies.STRATEGIES`:
    ``one-device``, ``allreduce``, ``processes``, ``kvstore``, ``update-on-kvstore``, ``parameter-servers``),
    ``pkg.module:Class`` or a class of yours, or an instance; None: inferred from the devices, processes and
    kvstore."""
    algorithm: str | AllreduceAlgorithm = DEFAULT_ALGORITHM
    """The allreduce algorithm for gradients (ignored when a kvstore aggregates)."""
    kvstore: str | KVStore | None = None
    """``None``, ``"local"``, ``"device"``, a KVStore, or across processes ``"dist_sync"``/``"dist_device_sync"``."""
    update_on_kvstore: bool | None = None
    """``True``: the store runs the optimizer and the replicas pull the new weights; ``False``: the store sums and
    every replica updates itself; ``None``: ``False`` with a local store, ``True`` with a distributed one (whose
    servers always run the optimizer: ``False`` is refused there). MXNet's ``None`` means ``True`` for every store
    (see docs/mxnet-differences.md)."""
    bucket_bytes: int | None = None
    """Gradient bucket size (default: 1 MiB, or larger so the model's gradients form at most 16 buckets)."""
    buffers: str = "per-device"
    """``"per-device"`` BatchNorm statistics, or ``"broadcast"`` the first replica's after every step."""
    threads: Sequence[int] | None = None
    """Intra-op threads per device worker, all equal (default: the cores split evenly)."""
    memory_format: str = "auto"
    """4-D activations' layout; ``"auto"``: channels-last for 2-D convolutions on CPU devices (oneDNN and
    PyTorch's pooling then skip layout reorders: LeNet, batch 128, one core: 71 -> 46 ms per step)."""
    check_finite: bool = False
    """Before each update, raise :class:`NonFiniteError` if the loss or gradients are not finite (one host
    read per step, so off by default)."""
    trace: str | Path | None = None
    """Record the engine's timeline and write it here (Chrome trace JSON) when the trainer closes."""
    processes: Any = "auto"
    """``"auto"``: with the job's other processes when started as one of several (``WORLD_SIZE`` > 1);
    ``None``: this process alone; or a ``torch.distributed`` process group to span."""
    plan: Any = None
    """``None``: train as the options say; ``"auto"``: measure the plans valid here on the first batch and
    train on the fastest (:mod:`dlperf.parallel.planning.planner`); a
    :class:`~dlperf.parallel.planning.plan.Plan` or its
    name (``"1x2,channels-last"``) to pin one. A plan overrides threads, layout, algorithm, buckets, store."""
    planner: PlannerOptions | None = None
    """How ``plan="auto"`` plans (budget, rounds, mixed precision allowed, cache); None: the defaults."""

    def __post_init__(self) -> None:
        if self.memory_format not in MEMORY_FORMATS:
            raise unknown_choice("memory format", self.memory_format, MEMORY_FORMATS)
        if self.buffers not in BUFFER_MODES:
            raise unknown_choice("buffer mode", self.buffers, BUFFER_MODES)
        self.algorithm = get_algorithm(self.algorithm)
        check_update_on_kvstore(self.kvstore, self.update_on_kvstore)
        if self.bucket_bytes is not None and (isinstance(self.bucket_bytes, bool) or
                                              not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1):
            raise UsageError(f"bucket_bytes={self.bucket_bytes!r}: expected an integer >= 1 (or None)")
        if not isinstance(self.optimizer, str) and not callable(self.optimizer):
            raise UsageError(f"optimizer={self.optimizer!r}: expected a name ({', '.join(OPTIMIZERS)}) or a factory "
                             "params -> torch.optim.Optimizer")
        if isinstance(self.optimizer, str):
            OPTIMIZERS.get(self.optimizer)  # a miss lists the names
        if isinstance(self.plan, str) and self.plan != "auto":
            self.plan = parse_plan(self.plan)  # one line naming the bad part
        elif self.plan is not None and self.plan != "auto" and not isinstance(self.plan, Plan):
            raise UsageError(f"plan={self.plan!r}: expected None, 'auto', a Plan or a plan name such as '1x2'")
        resolve_loss(self.loss)  # a bad name or value is one line now, not at the first step
        if isinstance(self.strategy, str) and ":" in self.strategy:
            self.strategy = strategy_class(self.strategy)  # the class: a process it is sent to imports its module
        elif isinstance(self.strategy, str) or isinstance(self.strategy, type):
            strategy_class(self.strategy)  # a miss lists what exists
        elif self.strategy is not None and not isinstance(self.strategy, Strategy):
            raise UsageError(f"strategy={self.strategy!r}: expected a strategy name ({', '.join(STRATEGIES.names())}), "
                             "a Strategy, or None")
        self._check_update_options()
        if self.planner is not None and not isinstance(self.planner, PlannerOptions):
            raise UsageError(f"planner={self.planner!r}: expected a PlannerOptions (or None)")

    def _check_update_options(self) -> None:
        accumulate = self.accumulate
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or not 1 <= accumulate <= 4096:
            raise UsageError(f"accumulate={self.accumulate!r}: expected an integer from 1 to 4096")
        clip = self.clip_grad_norm
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 < clip < 1e30):
            raise UsageError(f"clip_grad_norm={clip!r}: expected a positive number (or None)")
        steps = self.schedule_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise UsageError(f"schedule_steps={steps!r}: expected an integer >= 1 (or None)")
        if isinstance(self.lr_schedule, str):
            SCHEDULES.get(self.lr_schedule)  # a miss lists the names
        elif self.lr_schedule is not None and not callable(self.lr_schedule):
            raise UsageError(f"lr_schedule={self.lr_schedule!r}: expected a name ({', '.join(SCHEDULES.names())}), a "
                             "factory optimizer -> scheduler, or None")

    def new_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """One optimizer over ``params`` as configured."""
        return make_optimizer(self.optimizer, params, dict(self.optimizer_params or {}))

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

from ..batch import describe
from ..errors import UsageError, unknown_choice
from ..kvstore import KVStore
from .allreduce import DEFAULT_ALGORITHM, AllreduceAlgorithm, get_algorithm
from .optimizers import OPTIMIZERS, OptimizerLike, make_optimizer
from .plan import Plan, parse_plan
from .planner import PlannerOptions

__all__ = ["TrainerConfig", "BUFFER_MODES", "MEMORY_FORMATS", "Loss", "check_update_on_kvstore"]

BUFFER_MODES = ("per-device", "broadcast")
MEMORY_FORMATS = ("auto", "contiguous", "channels_last")

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_update_on_kvstore(kvstore: str | KVStore | None, update_on_kvstore: bool | None) -> None:
    """Refuse an ``update_on_kvstore`` the store cannot honour: the rule a config and the strategy factory apply.

    A stated value is honoured or refused, never replaced: ``True`` needs a store, and ``False`` cannot
    be had with a distributed store, whose servers run the optimizer (``None`` lets the store decide).
    """
    if update_on_kvstore is not None and not isinstance(update_on_kvstore, bool):
        raise UsageError(f"update_on_kvstore={update_on_kvstore!r}: expected True, False or None (the store decides)")
    if update_on_kvstore and kvstore is None:
        raise UsageError("update_on_kvstore=True needs a kvstore, e.g. kvstore='local'")
    if update_on_kvstore is False and kvstore is not None:
        from .servers import is_dist_kvstore

        if is_dist_kvstore(kvstore):
            name = kvstore if isinstance(kvstore, str) else kvstore.type
            raise UsageError(f"update_on_kvstore=False with kvstore={name!r}: its parameter servers run the "
                             "optimizer and serve the updated weights; leave update_on_kvstore out (or True), or "
                             "drop the kvstore to sum gradients across processes by allreduce")


def default_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over the examples: the loss when a config gives none."""
    if not isinstance(out, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise UsageError(f"the default loss (cross-entropy) takes a tensor of scores and a tensor of labels, got "
                         f"{describe(out)} and {describe(y)}; pass loss=fn(output, target) for other structures")
    return nn.functional.cross_entropy(out, y)


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
    :func:`~dlperf.parallel.servers.serve_kvstore`, not a Trainer), or with none every process hosts
    one for its share of the weights. The Trainer then spans the worker ranks only.
    """

    optimizer: OptimizerLike = "sgd"
    """A name from :data:`OPTIMIZERS` or a factory ``params -> torch.optim.Optimizer`` (one per replica)."""
    optimizer_params: dict[str, Any] | None = None
    """Keyword arguments for a named optimizer, e.g. ``{"lr": 0.1}``."""
    loss: Loss | None = None
    """``loss(output, target)`` averaged over the examples it sees (cross-entropy by default)."""
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
    train on the fastest (:mod:`dlperf.parallel.planner`); a :class:`~dlperf.parallel.plan.Plan` or its
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
        if self.planner is not None and not isinstance(self.planner, PlannerOptions):
            raise UsageError(f"planner={self.planner!r}: expected a PlannerOptions (or None)")

    def new_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """One optimizer over ``params`` as configured."""
        return make_optimizer(self.optimizer, params, dict(self.optimizer_params or {}))

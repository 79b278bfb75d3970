"""Gradient synchronization strategies: one class per way to keep a Trainer's replicas identical.

=====================  ============================================================================
``one-device``         one device, one process: the replica updates itself in its own operation
``allreduce``          several devices, one process: buckets allreduced on the lanes during backward
``processes``          across processes: buckets summed locally, then across (shared memory, gloo or
                       both, hierarchically)
``kvstore``            through a local KVStore that sums each bucket (aggregation only)
``update-on-kvstore``  through a local KVStore that runs the optimizer
``parameter-servers``  a distributed KVStore whose servers sum, update and serve the weights
=====================  ============================================================================

A user names one (``Trainer(strategy=...)``, ``dlperf train --strategy``, a plan's ``strategy-NAME``), or
:func:`choose_strategy` infers it from the options (the rule written once); :data:`STRATEGIES` holds them by name
and a miss lists what exists. A new strategy is one module: a :class:`Strategy` subclass with a ``name``,
decorated with :func:`register_strategy` (and, for the planner and ``dlperf scale`` to price it, a cost formula
registered under that name in :data:`dlperf.probe.projection.COSTS`).
"""

from __future__ import annotations

from . import (  # noqa: F401 (register)
    across_processes,
    kvstore_aggregate,
    kvstore_update,
    local_allreduce,
    one_device,
    parameter_servers,
)
from .context import NonFiniteError, StepContext
from .factory import choose_strategy, create_strategy, strategy_class
from .strategy import STRATEGIES, ReplicaOptimizers, Strategy, StrategyOptions, register_strategy

__all__ = ["Strategy", "StrategyOptions", "ReplicaOptimizers", "StepContext", "NonFiniteError", "STRATEGIES",
           "register_strategy", "choose_strategy", "create_strategy", "strategy_class"]

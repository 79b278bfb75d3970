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

:func:`choose_strategy` picks one from the options (the rule written once); :data:`STRATEGIES` holds
them by name and a miss lists what exists.
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
from .factory import choose_strategy, create_strategy
from .strategy import STRATEGIES, ReplicaOptimizers, Strategy, register_strategy

__all__ = ["Strategy", "ReplicaOptimizers", "StepContext", "NonFiniteError", "STRATEGIES", "register_strategy",
           "choose_strategy", "create_strategy"]

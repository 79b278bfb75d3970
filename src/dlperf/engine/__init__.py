"""Asynchronous dependency engine: push work with read/write sets; per-device workers run it.

The frontend (Python) pushes operations and returns at once; each device has its own worker
threads that run whatever is ready, so independent work on ``cpu(0)``, ``cpu(1)`` and each GPU
(compute and copy streams) overlaps. See :mod:`dlperf.engine.engine` for the API,
:mod:`dlperf.engine.array` for the array frontend, :mod:`dlperf.engine.trace` for timelines, and
:mod:`dlperf.engine.external` for how torch code outside the engine (optimizers, ``state_dict``,
eager module calls) waits for engine work on parameters. :func:`waitall` waits for every open
engine, the default one and those made with :func:`create_engine`. A long-lived loop beside the
engine's work (a watchdog, a reader) runs on a :class:`ServiceThread`, the thread the engine's own
workers run on: daemon, named ``dlperf-...``, its target's exception raised by ``join``.

Example:
    >>> from dlperf.engine import create_engine, array as dnp
    >>> with create_engine() as eng:
    ...     x = dnp.ones((1, 2), engine=eng)
    ...     (x * x + 2).tolist()
    [[3.0, 3.0]]
"""

from __future__ import annotations

from .._threads import ServiceThread
from . import array
from .arguments import EngineArgumentError
from .array import Array
from .engine import (
    ENGINE_ENV,
    Engine,
    EngineClosedError,
    EngineConfig,
    EngineDeadlockError,
    EngineUsageError,
    EngineWorkerError,
    create_engine,
    default_engine,
    engine_kinds,
    register_engine,
    waitall,
)
from .external import wait_for
from .inflight import InFlight, bounded
from .trace import Trace, load_trace, summarize
from .var import Op, Var, wait_ops

__all__ = ["wait_ops",
    "ENGINE_ENV",
    "Array",
    "Engine",
    "EngineArgumentError",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadlockError",
    "EngineUsageError",
    "EngineWorkerError",
    "InFlight",
    "Op",
    "ServiceThread",
    "Trace",
    "Var",
    "array",
    "bounded",
    "create_engine",
    "default_engine",
    "engine_kinds",
    "load_trace",
    "register_engine",
    "summarize",
    "wait_for",
    "waitall",
]

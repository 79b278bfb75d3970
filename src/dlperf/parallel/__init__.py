"""Data-parallel training across devices (d2l 12.5-12.7).

The axes vary independently: *devices* (logical CPUs here, GPUs when present), *communication* (an
:func:`allreduce` algorithm or a :class:`~dlperf.kvstore.KVStore`), and the *launcher* (threads in one
process, or processes on one or several hosts through torch's elastic agent:
:mod:`dlperf.parallel.launchers`). Primitives first (:func:`split_and_load`, :func:`split_batch`,
:func:`allreduce`, :func:`replicate`), then the :class:`Trainer` that combines them and
:class:`DataParallel`, the module wrapper.
"""

from __future__ import annotations

from .allreduce import DEFAULT_ALGORITHM, AllreduceAlgorithm, algorithm_names, allreduce, get_algorithm
from .allreduce.lanes import EngineLanes, engine_lanes, thread_budget
from .replicas import broadcast_buffers, broadcast_parameters, max_replica_difference, replicate
from .split import check_devices, split_and_load, split_batch, split_data, split_sizes
from .training.data_parallel import DataParallel
from .training.evaluate import evaluate_accuracy
from .training.trainer import Trainer

__all__ = [
    "split_and_load", "split_data", "split_batch", "split_sizes", "check_devices",
    "allreduce", "algorithm_names", "get_algorithm", "AllreduceAlgorithm", "DEFAULT_ALGORITHM",
    "replicate", "broadcast_parameters", "broadcast_buffers", "max_replica_difference",
    "Trainer", "DataParallel", "evaluate_accuracy", "EngineLanes", "engine_lanes", "thread_budget",
]

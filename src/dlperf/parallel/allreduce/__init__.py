"""``allreduce``: sum one tensor per device, leaving the total on every device.

Algorithms register themselves (``naive``, ``cpu``, ``sharded``, ``ring``); all give the same sum up
to float rounding, and each device ends with a bit-identical copy of it. The default is
``sharded``: see :data:`DEFAULT_ALGORITHM` for why. ``auto`` picks one of them per call from the
cost model and the measured links (:func:`choose_algorithm`). Between processes of one host,
:class:`ShmAllreduce` (and :func:`host_allreduce_`, which adds the hosts) sums through shared memory.

>>> import torch
>>> from dlperf.devices import cpu, copy_to
>>> xs = [copy_to(torch.full((5,), float(i + 1)), cpu(i)) for i in range(3)]
>>> [x.tolist() for x in allreduce(xs, algorithm="ring")]
[[6.0, 6.0, 6.0, 6.0, 6.0], [6.0, 6.0, 6.0, 6.0, 6.0], [6.0, 6.0, 6.0, 6.0, 6.0]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import host, naive, ring, sharded  # noqa: F401  (registers the algorithms)
from .auto import AutoAllreduce, choose_algorithm  # registers "auto" after the algorithms it chooses among
from .base import (
    DEFAULT_ALGORITHM,
    AllreduceAlgorithm,
    Phase,
    algorithm_names,
    check_tensors,
    chunk_bounds,
    get_algorithm,
    register_algorithm,
    run_sequential,
)
from .lanes import EngineLanes
from .shm import ShmAllreduce, ShmAllreduceError, ShmUnavailableError, host_allreduce_

__all__ = ["allreduce", "AllreduceAlgorithm", "DEFAULT_ALGORITHM", "algorithm_names", "get_algorithm",
           "register_algorithm", "chunk_bounds", "Phase", "run_schedule", "choose_algorithm",
           "ShmAllreduce", "ShmAllreduceError", "ShmUnavailableError", "host_allreduce_"]


def run_schedule(phases: list[Phase], workers: EngineLanes | None = None) -> None:
    """Run a schedule: in the calling thread, or each task as an engine operation on its device's lane.

    With ``workers`` the phases are ordered by engine variables, not by a blocking barrier, and this
    waits for every task (even after a failure: none may still write a buffer after it returns).
    """
    if workers is None:
        run_sequential(phases)
        return
    workers.wait(workers.push_schedule(phases))


def allreduce(tensors: Sequence[torch.Tensor], algorithm: str | AllreduceAlgorithm = DEFAULT_ALGORITHM,
              workers: EngineLanes | None = None) -> list[torch.Tensor]:
    """Replace every tensor (one per device) by the sum of all of them, in place; return the list.

    ``workers`` (one per device, same order) runs each device's share of the work concurrently;
    without it the calling thread does everything, which on GPUs only queues asynchronous work.
    """
    algo = get_algorithm(algorithm)
    check_tensors(tensors)
    tensors = list(tensors)
    if len(tensors) == 1:
        return tensors
    flats = []
    for t in tensors:
        # reshape gives a view for contiguous tensors, so the algorithm writes straight into them
        flats.append(t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1))
    # auto's best choice depends on whether workers run the schedule: without them nothing runs in parallel
    phases = algo.schedule(flats, workers is not None) if isinstance(algo, AutoAllreduce) else algo.schedule(flats)
    run_schedule(phases, workers)
    for t, f in zip(tensors, flats):
        if f.data_ptr() != t.data_ptr() or not t.is_contiguous():
            t.copy_(f.view(t.shape))
    return tensors

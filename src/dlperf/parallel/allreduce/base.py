"""The allreduce contract, the registry of algorithms, and the executors that run their schedules.

An algorithm does not move data itself: it returns a *schedule*, a list of phases; each phase holds at
most one task per device, and a task writes only memory that no other task of its phase touches. An
executor runs the phases in order, the tasks of one phase either one after another in the calling
thread (GPU work is asynchronous anyway) or concurrently, each on its device's worker thread (logical
CPU devices, where the host cores do the adding and copying).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from ...devices import Device, device_of
from ...errors import UsageError
from ...registry import Registry

__all__ = ["AllreduceAlgorithm", "Phase", "register_algorithm", "get_algorithm", "algorithm_names",
           "chunk_bounds", "fetch", "DEFAULT_ALGORITHM"]

Task = Callable[[], None]
Phase = list  # list[Task | None], indexed by device

# Default: "sharded". With all-to-all links of equal speed (logical CPU devices sharing host memory,
# GPUs behind one PCIe switch) it moves the same bytes per device as the ring, 2(k-1)/k of the data,
# but in two steps instead of 2(k-1), so it pays the per-step latency least; the ring wins only when
# the links themselves form a ring (NVLink rings, d2l 12.7.2).
DEFAULT_ALGORITHM = "sharded"


class AllreduceAlgorithm(ABC):
    """Sums one flat tensor per device in place, so every device ends with the same total."""

    name: str = ""
    summary: str = ""

    @abstractmethod
    def schedule(self, flats: list[torch.Tensor]) -> list[Phase]:
        """Phases of per-device tasks that leave the sum in every tensor of ``flats`` (1-D, k >= 2)."""


_ALGORITHMS: Registry[AllreduceAlgorithm] = Registry("allreduce algorithm", normalize=str.lower)


def register_algorithm(algo: AllreduceAlgorithm, *, replace: bool = False) -> AllreduceAlgorithm:
    _ALGORITHMS.register(algo.name, algo, replace=replace)
    return algo


def algorithm_names() -> list[str]:
    """Registered algorithm names, in registration order."""
    return list(_ALGORITHMS.names())


def get_algorithm(name: str | AllreduceAlgorithm) -> AllreduceAlgorithm:
    """Look an algorithm up by name; a miss lists what exists."""
    if isinstance(name, AllreduceAlgorithm):
        return name
    return _ALGORITHMS.get(str(name))


def chunk_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous near-equal ranges covering ``range(n)``; some are empty when ``n < k``.

    >>> chunk_bounds(5, 3)
    [(0, 2), (2, 4), (4, 5)]
    """
    base, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def fetch(src: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``src`` readable where ``like`` lives: itself in shared host memory, else an async copy."""
    if src.device == like.device:
        return src
    return src.to(like.device, non_blocking=True)


def check_tensors(tensors: Sequence[torch.Tensor]) -> list[Device]:
    """One tensor per distinct device, all of one shape and dtype; else one clear error."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise UsageError("allreduce expects a non-empty list with one tensor per device")
    first = tensors[0]
    devs = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"allreduce item {i} is a {type(t).__name__}, not a torch.Tensor")
        if t.shape != first.shape or t.dtype != first.dtype:
            raise UsageError(f"allreduce needs equal shapes and dtypes; item 0 is {tuple(first.shape)} "
                             f"{first.dtype}, item {i} is {tuple(t.shape)} {t.dtype}")
        d = device_of(t)
        if d in devs:
            raise UsageError(f"allreduce got two tensors on {d}; give exactly one tensor per device")
        devs.append(d)
    return devs


def run_sequential(phases: list[Phase]) -> None:
    for phase in phases:
        for task in phase:
            if task is not None:
                task()

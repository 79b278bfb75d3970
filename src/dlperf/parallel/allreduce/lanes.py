"""Engine lanes: where each device's share of a collective runs as engine operations.

A collective (an allreduce schedule: phases of per-device tasks) is pushed as one engine operation
per task, each on its device's lane, with read/write sets that make every phase wait for the one
before it: lane ``j``'s task writes lane ``j``'s variable and reads every other lane's, so phase
``p + 1`` on lane ``j`` starts once every phase-``p`` task has ended, while different collectives
(different gradient buckets, different shards) interleave freely on the workers.

Communication lanes are separate from compute lanes, so a reduction can run while backward still
computes on the same device. On a GPU that is the engine's copy lane (its own CUDA stream, ordered
by events). A logical CPU device has no copy lane in the engine, so its communication runs on a
logical device numbered after the compute devices (``cpu(k + j)`` for ``cpu(j)``): another engine
worker thread on the same host memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ...devices import Device, cpu, cpu_count
from ...engine import Engine, create_engine
from ...engine.var import Var

__all__ = ["EngineLanes", "comm_lanes", "engine_lanes", "thread_budget"]


def thread_budget(devices: Sequence[Device], cores: int | None = None) -> list[int]:
    """Intra-op threads for each device's engine worker: the cores split evenly among logical CPU devices.

    A GPU worker only launches kernels and copies, so one host thread is enough for it.

    >>> from dlperf.devices import cpu, gpu
    >>> thread_budget([cpu(0), cpu(1)], cores=4), thread_budget([gpu(0)], cores=4)
    ([2, 2], [1])
    """
    cores = cores or cpu_count()
    n_cpu = sum(1 for d in devices if not d.is_gpu)
    share = max(1, cores // n_cpu) if n_cpu else 1
    return [1 if d.is_gpu else share for d in devices]


@contextmanager
def engine_lanes(devices: Sequence[Device], cpu_threads: int | None = None) -> Iterator[EngineLanes]:
    """Lanes on a threaded engine of their own, one per device, closed on exit.

    >>> import torch
    >>> from dlperf.devices import copy_to
    >>> from dlperf.parallel import allreduce
    >>> xs = [copy_to(torch.ones(4), cpu(i)) for i in range(2)]
    >>> with engine_lanes([cpu(0), cpu(1)], cpu_threads=1) as lanes:
    ...     allreduce(xs, "sharded", workers=lanes)[1].tolist()
    [2.0, 2.0, 2.0, 2.0]
    """
    with create_engine("threaded", cpu_threads=cpu_threads) as eng:
        yield EngineLanes(eng, devices)


def comm_lanes(devices: Sequence[Device]) -> tuple[list[Device], str]:
    """Per device, the engine device its communication is pushed to, and the operation kind to push."""
    if any(d.is_gpu for d in devices):
        return list(devices), "copy"
    top = max(d.index for d in devices) + 1
    return [cpu(top + j) for j in range(len(devices))], "compute"


class EngineLanes:
    """Runs collectives on an engine: task ``j`` of every phase on ``lanes[j]``."""

    def __init__(self, engine: Engine, lanes: Sequence[Device], kind: str = "compute") -> None:
        self.engine = engine
        self.lanes = list(lanes)
        self.kind = kind

    def __len__(self) -> int:
        return len(self.lanes)

    def push_schedule(self, phases: list[list], *, priority: int = 0, name: str = "allreduce",
                      on: tuple[Device, str] | None = None) -> list[Var]:
        """Push every task; return one variable per lane, written by that lane's last task.

        ``on``: push every task to that one worker (device, kind) instead, in the same order and
        with the same variables: a small collective there costs no thread wake-up (see
        :meth:`dlperf.engine.Engine.running_on`), only its parallelism across lanes.
        """
        eng = self.engine
        done = [eng.new_var(f"{name} lane {j}") for j in range(len(self.lanes))]
        for p, phase in enumerate(phases, 1):
            for j, task in enumerate(phase):
                if task is None:
                    continue
                # the first phase waits for nothing: its tasks touch only their own inputs
                others = tuple(v for i, v in enumerate(done) if i != j) if p > 1 else ()
                device, kind = (self.lanes[j], self.kind) if on is None else on
                # the schedule's own tasks and variables: the unchecked push (public push checks what
                # callers pass, ~2 us each, and a ring schedule pushes k tasks per phase per bucket)
                eng._push(task, (), others, (done[j],), device, priority, f"{name} phase {p}", kind)
        return done

    def wait(self, done: Sequence[Var]) -> None:
        """Wait for every variable; raise the first error once (each lane after a failure carries it)."""
        first: BaseException | None = None
        for v in done:
            try:
                self.engine.wait_to_read(v)
            except BaseException as exc:  # keep waiting: no task may still write after we return
                if first is None:
                    first = exc
        if first is not None:
            raise first

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

from collections.abc import Sequence

from ..devices import Device, cpu
from ..engine import Engine
from ..engine.var import Var

__all__ = ["EngineLanes", "comm_lanes"]


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

    def push_schedule(self, phases: list[list], *, priority: int = 0, name: str = "allreduce") -> list[Var]:
        """Push every task; return one variable per lane, written by that lane's last task."""
        eng = self.engine
        done = [eng.new_var(f"{name} lane {j}") for j in range(len(self.lanes))]
        for p, phase in enumerate(phases, 1):
            for j, task in enumerate(phase):
                if task is None:
                    continue
                # the first phase waits for nothing: its tasks touch only their own inputs
                others = tuple(v for i, v in enumerate(done) if i != j) if p > 1 else ()
                eng.push(task, reads=others, writes=(done[j],), device=self.lanes[j], priority=priority,
                         name=f"{name} phase {p}", kind=self.kind)
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

"""GPU workers: one CUDA stream per lane, cross-stream order through CUDA events.

Each GPU gets a ``compute`` worker and a ``copy`` worker, each with its own non-default stream,
so a device-to-host copy of ``y[i-1]`` runs on the copy engine while ``y[i]`` is computed (d2l
§12.3.2). An operation on a GPU worker only *launches* kernels: the worker records an event on
its stream after each operation and the operation counts as done for the scheduler at once.
Ordering on the device is enforced by the consumer: a GPU consumer on another stream calls
``stream.wait_event`` (no host thread blocks), a CPU consumer or ``wait_to_read`` calls
``event.synchronize()`` (it needs the values). This avoids a host-side stream synchronisation
after every operation.

Memory safety: the CUDA caching allocator ties a block to the stream that allocated it; a tensor
used on another stream must be marked with ``Tensor.record_stream`` before the host drops it, which
the array frontend does for the CUDA tensors an operation reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .var import Op
from .worker import Worker, WorkerHost

if TYPE_CHECKING:
    from ..devices import Device

__all__ = ["GpuWorker", "current_stream"]


def current_stream(device: Device) -> Any:
    """The stream the engine's current operation on ``device`` runs on (for code inside an op)."""
    return torch.cuda.current_stream(device.torch_device)


class GpuWorker(Worker):
    """Worker of one CUDA device lane with its own stream."""

    can_steal = False  # stealing would run kernels on the waiter's stream, breaking the event chain

    def __init__(self, host: WorkerHost, device: Device, lane: str) -> None:
        super().__init__(host, device, lane)
        self.stream: Any = None

    def setup(self) -> None:
        torch.cuda.set_device(self.device.index)
        # Copy lanes get a higher priority (lower number) so transfers are not starved by compute.
        lo, hi = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]  # a staticmethod the stubs miss
        prio = hi if self.lane == "copy" else lo
        self.stream = torch.cuda.Stream(device=self.device.torch_device, priority=prio)

    def run_op(self, op: Op, where: str) -> None:
        stream = self.stream
        key = id(stream)
        for v in op.reads:  # read after write
            ev = v._wev
            if ev is not None:
                stream.wait_event(ev)
        for v in op.writes:  # write after write and after reads on other streams
            if v._wev is not None:
                stream.wait_event(v._wev)
            if v._revs:
                for k, ev in list(v._revs.items()):
                    if k != key:
                        stream.wait_event(ev)
        with torch.cuda.stream(stream):
            self.host.execute(op, where)
        ev = torch.cuda.Event()
        ev.record(stream)
        for v in op.writes:
            v._wev = ev
            v._revs = None
        for v in op.reads:
            revs = v._revs
            if revs is None:
                v._revs = {key: ev}
            else:
                revs[key] = ev  # one (the newest) event per stream: the list does not grow

"""The naive engine: every push runs to completion in the pushing thread before it returns.

Like Apache MXNet's ``NaiveEngine``: use it (``create_engine("naive")`` or ``DLPERF_ENGINE=naive``)
to debug, since a failing operation's traceback passes through the push that caused it, and as
the sequential oracle the threaded engine is tested against. Errors still follow the common
contract (stored, raised at the wait point that touches them).
"""

from __future__ import annotations

from ..devices import Device
from .engine import Engine, register_engine
from .var import DONE, Op

__all__ = ["NaiveEngine"]


class NaiveEngine(Engine):
    """Synchronous engine.

    >>> with NaiveEngine() as eng:
    ...     v, box = eng.new_var(), []
    ...     op = eng.push(box.append, args=(1,), writes=[v])
    ...     op.done, box
    (True, [1])
    """

    kind = "naive"

    def _submit(self, op: Op, device: Device, kind: str) -> None:
        op.worker = device
        if self._trace is not None:
            self._trace_deps(op, self._ids)
        for v in op.writes:
            v._last_write = op
        self._execute(op, f"{device}/caller")
        if device.is_gpu:  # synchronous means the device finished too
            device.synchronize()
        op.state = DONE

    def _wait_done(self, op: Op) -> None:
        return None

    def _wait_all(self) -> None:
        return None


register_engine("naive", NaiveEngine)

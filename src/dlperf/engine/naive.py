"""The naive engine: every push runs to completion in the pushing thread before it returns.

Like Apache MXNet's ``NaiveEngine``: use it (``create_engine("naive")`` or ``DLPERF_ENGINE=naive``)
to debug, since a failing operation's traceback passes through the push that caused it, and as
the sequential oracle the threaded engine is tested against. Errors still follow the common
contract (stored, raised at the wait point that touches them).

Waits still matter when several threads share the engine: another thread's push may be running
(or held in its open ``bulk()`` block), and a wait for it blocks until it is done. A pushed
function that waits for itself, or threads whose pushed functions wait for each other, raise
:class:`~dlperf.engine.engine.EngineDeadlockError` instead of hanging. ``waitall()`` inside a
pushed function returns at once (everything pushed before it is done); ``close()`` inside one
raises :class:`~dlperf.engine.engine.EngineUsageError`, as on the threaded engine.
"""

from __future__ import annotations

import threading

from ..devices import Device
from .engine import DEADLOCK_FIX, Engine, EngineConfig, EngineDeadlockError, register_engine
from .var import DONE, RUNNING, Op, Var
from .waitgraph import Waiter, find_cycle

RECHECK_S = 0.05  # a thread blocked inside an operation re-checks for a wait cycle this often...
RECHECK_MAX_S = 0.5  # ...doubling the pause up to this

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

    def __init__(self, config: EngineConfig | None = None) -> None:
        super().__init__(config)
        self._cond = threading.Condition()
        self._waiters = 0
        self._blocked: dict[int, Waiter] = {}  # threads waiting inside operations (under _cond)

    def _submit(self, op: Op, device: Device, kind: str) -> None:
        op.worker = device
        if self._trace is not None:
            self._trace_deps(op, self._ids)
        for v in op.writes:
            v._last_write = op
        op.state = RUNNING
        stack = self._running_stack()
        stack.append(op)
        try:
            self._execute(op, f"{device}/caller")
            if device.is_gpu:  # synchronous means the device finished too
                device.synchronize()
        finally:
            stack.pop()
            op.state = DONE
            if self._waiters:
                self._wake_waiters()

    def _wake_waiters(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _wait_done(self, op: Op, var: Var | None = None) -> None:
        # Only another thread's running push, or its open bulk() batch, can be unfinished here.
        if op.state == DONE:
            return
        running = self._running_ops()
        me = Waiter(running, None, op, var) if running else None
        key = threading.get_ident()
        with self._cond:
            self._waiters += 1
            if me is not None:
                self._blocked[key] = me
            pause = RECHECK_S
            try:
                while op.state != DONE:
                    if me is not None:
                        cycle = find_cycle(me, list(self._blocked.values()))
                        if cycle is not None:
                            raise EngineDeadlockError(
                                f"this wait would deadlock, so it was not started: {cycle}. {DEADLOCK_FIX}")
                        self._cond.wait(pause)
                        pause = min(2 * pause, RECHECK_MAX_S)
                    else:
                        self._cond.wait()
            finally:
                self._waiters -= 1
                self._blocked.pop(key, None)

    def _wait_all(self) -> None:
        return None


register_engine("naive", NaiveEngine)

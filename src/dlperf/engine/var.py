"""Variables and operations: the records the dependency engine schedules.

Glossary:

* A **variable** (:class:`Var`) stands for a piece of state (an array, a model's parameters, a
  file). Operations declare which variables they *read* and which they *write*; the engine never
  looks inside a variable.
* An **operation** (:class:`Op`) is a Python callable plus its read and write sets, pushed to one
  device. The handle :meth:`Engine.push` returns is the operation itself.

Ordering rules, per variable, in push order: reads may run concurrently with each other; a write
waits for every earlier read and write; a read waits for every earlier write. Everything else is
free to run in parallel.

Example:
    >>> from dlperf.engine import create_engine
    >>> with create_engine("threaded") as eng:
    ...     v = eng.new_var("counter")
    ...     box = [0]
    ...     for _ in range(3):
    ...         _ = eng.push(lambda: box.__setitem__(0, box[0] + 1), writes=[v])
    ...     eng.wait_to_read(v)
    ...     box[0]
    3
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

__all__ = ["Var", "Op", "wait_ops", "PENDING", "QUEUED", "RUNNING", "DONE"]

# Operation states. Plain ints compared with `is`/`==` keep the scheduler's hot path cheap.
PENDING = 0  # waiting for earlier operations on its variables
QUEUED = 1   # ready, sitting in a worker's queue
RUNNING = 2  # claimed by a worker (or by a thread that waits on it)
DONE = 3     # finished, failed or skipped; its variables are released


class Var:
    """A dependency variable; create one with :meth:`Engine.new_var`.

    All fields except ``name`` belong to the engine and change only under its lock.
    """

    __slots__ = ("name", "_readers", "_writing", "_queue", "_last_write", "_bulk_write", "exc",
                 "_wev", "_revs", "__weakref__")

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        self._readers = 0            # granted reads not yet finished
        self._writing = False        # a granted write has not finished
        self._queue: deque | None = None  # (op, is_write) not yet granted, in push order
        self._last_write: Op | None = None  # the newest pushed write: what wait_to_read waits on
        # A write still collected by some thread's open bulk() block: other threads' reads wait for it.
        self._bulk_write: Op | None = None
        self.exc: BaseException | None = None  # set when a write failed: later users are skipped
        # CUDA events (only used when a GPU worker exists): the last write's event, and the
        # events of reads since that write, so a later writer on another stream waits for them.
        self._wev: Any = None
        self._revs: list | None = None

    def __repr__(self) -> str:
        state = "failed" if self.exc is not None else ("busy" if self._writing or self._readers else "idle")
        return f"Var({self.name or hex(id(self))}, {state})"


class Op:
    """A pushed operation; also the handle :meth:`Engine.push` returns.

    >>> from dlperf.engine import create_engine
    >>> with create_engine("naive") as eng:
    ...     op = eng.push(lambda: 6 * 7)
    ...     op.wait()
    42
    """

    __slots__ = ("fn", "args", "reads", "writes", "worker", "priority", "name", "state",
                 "wait_count", "result", "exc", "engine", "id", "deps", "waited", "__weakref__")

    def __init__(self, engine: Any, fn: Any, args: tuple, reads: tuple, writes: tuple,
                 worker: Any, priority: int, name: str | None) -> None:
        self.engine = engine
        self.fn = fn
        self.args = args
        self.reads = reads
        self.writes = writes
        self.worker = worker
        self.priority = priority
        self.name = name
        self.state = PENDING
        self.wait_count = 1  # one guard count, dropped at the end of push
        self.result: Any = None
        self.exc: BaseException | None = None
        self.id = 0
        self.deps: tuple = ()
        self.waited = False  # a thread blocks until it is done: finishing it must wake the waiters

    @property
    def done(self) -> bool:
        """True once the operation finished, failed or was skipped."""
        return self.state == DONE

    def wait(self) -> Any:
        """Block until this operation is done; return its result or raise its exception."""
        return self.engine.wait_op(self)

    def __repr__(self) -> str:
        states = {PENDING: "pending", QUEUED: "queued", RUNNING: "running", DONE: "done"}
        label = self.name or getattr(self.fn, "__name__", "op")
        return f"Op({label}, {states[self.state]})"


def wait_ops(ops: Iterable[Op]) -> list[Any]:
    """Every operation's result, in order. After a failure the others are still waited for, so none is left
    running and none of their errors is left for the engine to raise later; then the first error is raised."""
    results: list[Any] = []
    first: BaseException | None = None
    for op in ops:
        try:
            results.append(op.wait())
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first
    return results

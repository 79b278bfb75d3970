"""The engine API: push operations with read/write sets, wait for them; a registry of engines.

Two engines implement it (:func:`create_engine` picks one by name, ``DLPERF_ENGINE`` sets the default):
``threaded`` (:class:`~dlperf.engine.threaded.ThreadedEngine`) returns from a push at once and runs ready work on
per-device workers, so independent work on ``cpu(0)``, ``cpu(1)`` and GPUs overlaps; ``naive``
(:class:`~dlperf.engine.naive.NaiveEngine`) runs every push before it returns, for debugging and as the oracle in
tests. Both store an exception raised by a pushed function, skip what depends on what it wrote, and raise it at
the first wait that touches it (at the latest by ``close()``); a wait that could never return raises
:class:`EngineDeadlockError` instead of hanging. The contract in full: docs/design/engine.md.

Example:
    >>> import torch
    >>> from dlperf.engine import create_engine
    >>> with create_engine() as eng:
    ...     a, b = eng.new_var("a"), eng.new_var("b")
    ...     store = {}
    ...     _ = eng.push(lambda: store.__setitem__("a", torch.ones(2)), writes=[a])
    ...     _ = eng.push(lambda: store.__setitem__("b", store["a"] * 3), reads=[a], writes=[b])
    ...     eng.wait_to_read(b)
    ...     store["b"].tolist()
    [3.0, 3.0]
"""

from __future__ import annotations

import atexit
import math
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from time import perf_counter_ns
from typing import Any

from .._threads import cleanup_step
from ..devices import Device, DeviceLike, cpu, require_available
from ..errors import DlperfError, UsageError, unknown_choice
from ..registry import Registry
from .arguments import EngineArgumentError, as_var, as_vars, check_callable, check_count, check_priority
from .batches import AutoBatch, run_auto, run_auto_checked, run_bulk, run_rec
from .var import DONE, Op, Var

__all__ = [
    "ENGINE_ENV",
    "EngineConfig",
    "Engine",
    "EngineClosedError",
    "EngineWorkerError",
    "EngineUsageError",
    "EngineDeadlockError",
    "EngineArgumentError",
    "register_engine",
    "engine_kinds",
    "create_engine",
    "default_engine",
    "waitall",
]

ENGINE_ENV = "DLPERF_ENGINE"
"""Environment variable naming the default engine kind (``threaded`` or ``naive``)."""
AUTO_BULK_DEFAULT = 64  # EngineConfig.auto_bulk's default


class EngineClosedError(DlperfError, RuntimeError):
    """Work was pushed to an engine after :meth:`Engine.close`."""


class EngineWorkerError(DlperfError, RuntimeError):
    """A worker thread of the engine died (its loop failed, not an operation): what it held never finishes.

    Every wait that would block on such an engine, and every later push, raises this instead of hanging;
    :meth:`Engine.close` still stops and joins the other workers, then raises it. The worker's own error is
    the ``__cause__``.
    """


class EngineUsageError(UsageError, RuntimeError):
    """An engine call was made where it cannot work, e.g. ``close()`` inside a pushed function."""


class EngineDeadlockError(EngineUsageError):
    """A wait could never return: it waits, directly or through other waits, for its own operation.

    Raised in the waiting thread (so inside the pushed function that waits) instead of hanging;
    the message names every operation, variable and worker on the cycle.
    """


DEADLOCK_FIX = ("A pushed function must not wait for work that can only run after it: declare what it needs "
                "as reads=/writes= so the engine orders the operations, or wait outside pushed functions")


@dataclass
class EngineConfig:
    """Settings shared by all engine kinds."""

    cpu_threads: int | None = None
    """Intra-op threads per logical CPU device; None: the cores divided among the CPU devices in use."""
    max_queued: int | None = None
    """Per device worker: a push blocks while this many of its operations are unfinished (None: no limit)."""
    trace: bool = False
    """Record every operation (device, worker, start, end, dependencies) from the start."""
    batch_latency_us: float = 50.0
    """A worker running many small ready operations releases their dependents at least this often."""
    auto_bulk: int = AUTO_BULK_DEFAULT
    """Threaded engine, CPU devices: while a device's worker is busy, one thread's consecutive
    elementwise array operations to it (``y = x + 1``, ``-x``, ``a * b``; not matrix products) are
    collected, up to this many, into one engine operation, as :meth:`Engine.bulk` does by hand,
    which roughly halves their cost. A batch is sent at any wait or blocker (in any thread) that
    needs one of its results, at ``waitall``, when its thread pushes to another device, when
    another push uses a result or writes an input of it, at this size, and by the worker itself
    when it runs dry and the batch stopped growing. A push to an idle worker, or to one whose recent
    operations were long, is sent at once: nothing waits longer than it would without batching.
    A failing member fails only its own result and what uses it, as if pushed alone. Consecutive
    independent scalar records of one function (``x + 1``, ``y * 2`` on host tensors that need no
    gradient) run as one multi-tensor ``torch._foreach_*`` call: the same per-tensor operator for
    each, entered from Python once. 0 turns it off; the naive engine, traced engines and
    ``max_queued`` ignore it."""

    def __post_init__(self) -> None:
        for key in ("cpu_threads", "max_queued"):
            if getattr(self, key) is not None:
                check_count("EngineConfig", key, getattr(self, key), also=" or None")
        latency = self.batch_latency_us
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not 0 <= latency < math.inf:
            raise UsageError(f"batch_latency_us={latency!r} is not valid; expected a finite number >= 0")
        if not isinstance(self.trace, bool):
            raise UsageError(f"trace={self.trace!r} is not valid; expected True or False")
        check_count("EngineConfig", "auto_bulk", self.auto_bulk, 0, also=" (0: off)")


class _Bulk:
    """Operations collected by :meth:`Engine.bulk` in one thread, not yet pushed."""

    __slots__ = ("size", "ops", "device", "kind")

    def __init__(self, size: int) -> None:
        self.size = size
        self.ops: list[Op] = []
        self.device: Device = _CPU0  # set by the first push collected
        self.kind = "compute"


class _ThreadState(threading.local):
    """Per-thread engine state. Class attributes are the defaults each thread starts with, so
    reading one never raises AttributeError inside ``getattr`` (that costs ~0.3 us a push)."""

    bulk: _Bulk | None = None
    worker: Any = None                 # the Worker whose thread this is
    running: list[Op] | None = None    # operations this thread runs inline, innermost last
    auto: Any = None                   # the threaded engine's automatic batch of this thread


class Engine:
    """Base class: dependency tracking API shared by every engine kind.

    Subclasses implement :meth:`_submit` (schedule a fully built op), :meth:`_wait_done`,
    :meth:`_wait_all` and :meth:`_shutdown`.
    """

    kind = "base"

    def __init__(self, config: EngineConfig | None = None) -> None:
        if config is not None and not isinstance(config, EngineConfig):
            raise EngineArgumentError(f"{type(self).__name__}: config is {type(config).__name__}; expected an "
                                      "EngineConfig")
        self.config = config or EngineConfig()
        self._errors: list[BaseException] = []
        self._errors_lock = threading.Lock()
        self._local = _ThreadState()
        self._trace: list[tuple] | None = [] if self.config.trace else None
        self._trace_t0 = perf_counter_ns()
        self._ids = iter(range(1, 1 << 62))
        self._closed = False    # refuses pushes: close() ran, or a worker died (see _broken)
        self._finished = False  # close() ran, or the engine was dropped unclosed
        # (worker label, its error) once a worker thread died; pushes and blocking waits then raise
        self._broken: tuple[str, BaseException] | None = None
        _LIVE.add(self)  # for the module-level waitall()

    # ----------------------------------------------------------------- variables and pushes
    def new_var(self, name: str | None = None) -> Var:
        """A fresh variable; deleting it while operations on it are pending is safe.

        >>> from dlperf.engine import create_engine
        >>> create_engine("naive").new_var("w")
        Var(w, idle)
        """
        if name is not None and not isinstance(name, str):
            raise EngineArgumentError(f"new_var: name={name!r:.60} is not a string; expected a label, or None")
        return Var(name)

    def running_on(self) -> tuple[Device, str] | None:
        """The device and kind of the worker whose thread calls this, inside one of its
        operations; None in any other thread (a caller running an operation it waited for too).

        Work pushed there from inside an operation runs right after it, with no thread to wake.
        """
        worker = self._local.worker
        return None if worker is None else (worker.device, worker.lane)

    def push(self, fn: Callable[..., Any], args: tuple | list = (), reads: Iterable[Any] = (),
             writes: Iterable[Any] = (), device: DeviceLike | None = None, priority: int = 0,
             name: str | None = None, kind: str = "compute") -> Op:
        """Schedule ``fn(*args)`` on ``device`` after the operations it depends on; return at once.

        Args:
            args: the positional arguments of ``fn``, a tuple (or list).
            reads: variables ``fn`` only reads (concurrent with other reads); an engine array
                stands for its variable.
            writes: variables ``fn`` modifies (exclusive; a variable in both counts as written).
            device: where ``fn`` runs (default ``cpu(0)``); each device has its own worker(s).
            priority: among ready operations of one worker, higher runs first (default 0).
            kind: ``"compute"`` or ``"copy"``; copies involving a GPU run on its copy stream.

        Returns:
            The :class:`Op` handle; ``op.wait()`` returns ``fn``'s result.

        Raises:
            EngineArgumentError: an argument of the wrong type (the message names it); a bad
                ``device`` or ``kind`` raises :class:`~dlperf.errors.UsageError`.

        >>> from dlperf.engine import create_engine
        >>> with create_engine() as eng:
        ...     eng.push(sum, args=([1, 2, 3],)).wait()
        6
        """
        check_callable("push", "fn", fn, "push(f, args=(x,))")
        if type(args) is not tuple:
            if not isinstance(args, (tuple, list)):
                raise EngineArgumentError(f"push: args={args!r:.60} is not a tuple; expected fn's positional "
                                          "arguments as a tuple, e.g. args=(x,)")
            args = tuple(args)
        if name is not None and not isinstance(name, str):
            raise EngineArgumentError(f"push: name={name!r:.60} is not a string; expected a label for traces, or None")
        return self._push(fn, args, as_vars("push", "reads", reads, self), as_vars("push", "writes", writes, self),
                          device, check_priority("push", priority), name, kind)

    def _push(self, fn: Callable[..., Any], args: tuple, reads: Iterable[Var], writes: Iterable[Var],
              device: DeviceLike | None, priority: int, name: str | None, kind: str = "compute") -> Op:
        """:meth:`push` for callers that build their own arguments (the array frontend, engines)."""
        # The hot path of every engine array operation: each check costs the common case little.
        if kind != "compute" and kind != "copy":
            raise unknown_choice("operation kind", kind, ("compute", "copy"))
        if type(reads) is not tuple:
            reads = tuple(reads)
        if type(writes) is not tuple:
            writes = tuple(writes)
        if writes and (len(writes) > 1 or writes[0] in reads):  # rare: the common case skips this
            writes = tuple(dict.fromkeys(writes))
            reads = tuple(v for v in reads if v not in writes)
        dev = _CPU0 if device is None else device if type(device) is Device else require_available(device)
        if self._closed:
            raise self._refusal()
        op = Op(self, fn, args, reads, writes, None, priority, name)
        loc = self._local
        if loc.auto is not None:
            # This thread's automatic batch goes first, as pushed: a worker runs in push order,
            # and an operation that waits inside for a collected result must not be queued ahead
            # of it (it would wait for work behind itself).
            self._flush_auto()
        bulk = loc.bulk
        if bulk is not None:
            self._add_to_bulk(bulk, op, dev, kind)
            return op
        self._submit(op, dev, kind)
        return op

    def _push_rec(self, rec: tuple, read: Var, read2: Var | None, out: Var, device: Device, name: str) -> None:
        """Push the array operation ``rec[0](rec)``, which reads ``read`` (and ``read2``) and writes ``out``.

        The array frontend's elementwise operations come here; engines that batch them
        automatically (the threaded one) override this with a lean path.
        """
        reads = (read,) if read2 is None else (read, read2)
        self._push(run_rec, (rec,), reads, (out,), device, 0, name, "compute")

    def _submit(self, op: Op, device: Device, kind: str) -> None:
        raise NotImplementedError

    _auto_size = 0
    """Most records one automatic batch collects (engines that batch set it; 0: this one does not)."""

    def _appended(self, batch: AutoBatch, rec: tuple, read: Var, read2: Var | None, name: str) -> None:
        """After the array frontend appended ``rec`` to this thread's automatic batch and filled it
        or raced with its sending (only engines that batch automatically have such batches)."""
        raise NotImplementedError

    # ----------------------------------------------------------------- bulk execution
    @contextmanager
    def bulk(self, size: int = 64) -> Iterator[None]:
        """Collect up to ``size`` pushes of this thread into one engine operation (less overhead).

        Inside the block, pushes to one device are run back to back by one worker call, so their
        per-operation scheduling cost is paid once. A change of device, ``size`` pushes, any wait
        in this thread, or the end of the block sends the collected batch. If one member raises,
        the rest of its batch is skipped and all the batch's written variables carry the error.
        A write collected here already counts as pushed for other threads: their ``wait_to_read``
        of that variable (or ``wait()`` on the operation) waits until the batch is sent and done.

        >>> from dlperf.engine import create_engine
        >>> with create_engine() as eng:
        ...     v, box = eng.new_var(), [0]
        ...     with eng.bulk(100):
        ...         for _ in range(10):
        ...             _ = eng.push(lambda: box.__setitem__(0, box[0] + 1), writes=[v])
        ...     eng.wait_to_read(v)
        ...     box[0]
        10
        """
        check_count("bulk", "size", size)
        outer = self._local.bulk
        if outer is not None:  # nested: the outer batch keeps collecting
            yield
            return
        self._flush_auto()  # what was collected automatically goes first
        self._local.bulk = _Bulk(size)
        try:
            yield
        finally:
            self._flush_bulk()
            self._local.bulk = None

    def _add_to_bulk(self, bulk: _Bulk, op: Op, device: Device, kind: str) -> None:
        if bulk.ops and (device != bulk.device or kind != bulk.kind):
            self._flush_bulk()
        bulk.device, bulk.kind = device, kind
        bulk.ops.append(op)
        for v in op.writes:  # readers in other threads wait for it (see wait_to_read)
            v._bulk_write = op
        if len(bulk.ops) >= bulk.size:
            self._flush_bulk()

    def _flush_auto(self) -> None:
        """Send this thread's automatic batch, if it has one (engines that batch automatically)."""

    def _flush_bulk(self) -> None:
        if self._local.auto is not None:
            self._flush_auto()
        bulk = self._local.bulk
        if bulk is None or not bulk.ops:
            return
        ops, bulk.ops = bulk.ops, []
        written = dict.fromkeys(v for op in ops for v in op.writes)  # a dict: O(1) membership
        reads = tuple(dict.fromkeys(v for op in ops for v in op.reads if v not in written))
        writes = tuple(written)
        parent = Op(self, run_bulk, (ops,), reads, writes, None, 0, f"bulk[{len(ops)}]")
        for op in ops:
            op.worker = parent  # an inner op's "worker" field points at its batch: see wait_op
        try:
            self._submit(parent, bulk.device, bulk.kind)
        except BaseException as exc:  # never sent: whoever waits on a member must not wait forever
            _finish_unrun(parent, exc)
            self._wake_waiters()
            raise
        finally:
            # After _submit set each variable's _last_write: a reader checks _bulk_write first.
            for v in writes:
                held = v._bulk_write
                if held is not None and held.worker is parent:
                    v._bulk_write = None

    # ----------------------------------------------------------------- running (both engines)
    def _execute(self, op: Op, where: str) -> None:
        """Run one operation in the current thread: skip it if an input failed, store its error."""
        for v in op.reads:  # (the hot path of every worker: no helper calls while nothing failed)
            if v.exc is not None:
                if op.fn is run_auto:  # only the records that use the failed input are skipped
                    run_auto_checked(op.args[0], op.args[0].run)
                    return
                self._skip(op, v.exc)
                return
        for v in op.writes:
            if v.exc is not None:
                self._skip(op, v.exc)
                return
        trace = self._trace
        if trace is None:
            try:
                op.result = op.fn(*op.args)
            except BaseException as exc:  # stored, raised at a wait point in the frontend
                self._store_error(op, exc)
            return
        t0 = perf_counter_ns()
        try:
            op.result = op.fn(*op.args)
        except BaseException as exc:
            self._store_error(op, exc)
        trace.append((op.id, op.name or getattr(op.fn, "__name__", "op"), where,
                      t0, perf_counter_ns(), op.deps, op.exc is not None))

    @staticmethod
    def _mark_failed(op: Op, exc: BaseException, *, ran: bool) -> None:
        """Give ``op`` and what it writes the error ``exc``; an unrun bulk's members end with it too."""
        op.exc = exc
        for v in op.writes:
            v.exc = exc
        if op.fn is run_auto:
            for v in op.args[0].sent_outs:
                v.exc = exc
        if not ran and op.fn is run_bulk:
            for inner in op.args[0]:
                inner.exc = exc
                inner.state = DONE

    @classmethod
    def _skip(cls, op: Op, upstream: BaseException) -> None:
        """Skip ``op`` because an input failed: its outputs inherit the original error."""
        cls._mark_failed(op, upstream, ran=False)

    def _store_error(self, op: Op, exc: BaseException) -> None:
        self._mark_failed(op, exc, ran=True)
        self._note_error(exc)

    def _note_error(self, exc: BaseException) -> None:
        """Keep ``exc`` for the next wait point that has no operation of its own to raise it."""
        with self._errors_lock:
            self._errors.append(exc)

    def _fail(self, op: Op, exc: BaseException) -> None:
        """Mark ``op`` failed with ``exc`` without running it (its worker could not start)."""
        self._mark_failed(op, exc, ran=False)
        with self._errors_lock:
            if not any(e is exc for e in self._errors):
                self._errors.append(exc)

    @staticmethod
    def _trace_deps(op: Op, ids: Iterator[int]) -> None:
        # Dependencies recorded for the timeline: the newest earlier writer of each variable.
        op.id = next(ids)
        op.deps = tuple(v._last_write.id for v in (*op.reads, *op.writes)
                        if v._last_write is not None and v._last_write.id)

    # ----------------------------------------------------------------- waiting
    def wait_op(self, op: Op) -> Any:
        """Block until ``op`` is done; return its result or raise its (or an upstream) error.

        An operation still held in another thread's open ``bulk()`` block is waited for until
        that thread sends its batch and the batch has run.
        """
        if type(op) is not Op and not isinstance(op, Op):
            raise EngineArgumentError(f"wait_op: op is {type(op).__name__}; expected the Op handle push() returned")
        if op.state != DONE:
            if op.worker is None:  # in an open bulk() batch; if it is ours, send it first
                self._flush_bulk()
            elif self._local.auto is not None:
                self._flush_auto()
            self._wait_done(op)
        if op.exc is not None:
            self._report(op.exc)
            raise op.exc
        return op.result

    def wait_to_read(self, x: Any) -> None:
        """Block until every pushed write to ``x`` (a :class:`Var` or an engine array) is done.

        Raises the stored error if that write, or anything it depended on, failed. Other work keeps
        running meanwhile. A write another thread holds in its open ``bulk()`` block counts as
        pushed: this waits until that thread sends its batch and the write is done.
        """
        var = x if type(x) is Var else x if isinstance(x, Var) else getattr(x, "_var", None)
        if type(var) is not Var:
            var = as_var("wait_to_read", "x", x)
        loc = self._local
        if loc.bulk is not None:
            self._flush_bulk()
        if loc.auto is not None:
            self._flush_auto()
        held = var._bulk_write  # read before _last_write: a flush sets that first, then clears this
        op = var._last_write
        if op is not None and op.state != DONE:
            self._wait_done(op, var)
        if held is not None and held.state != DONE:
            self._wait_done(held, var)
        self._sync_var(var)
        if var.exc is not None:
            self._report(var.exc)
            raise var.exc

    def wait_to_write(self, var: Any) -> None:
        """Block until no pushed operation reads or writes ``var`` (a :class:`Var` or an engine array)
        any more: then it is safe to modify."""
        var = as_var("wait_to_write", "var", var, self)
        op = self._push(_noop, (), (), (var,), None, 0, "wait_to_write", "compute")
        self._flush_bulk()
        held = var._bulk_write  # a write still in another thread's open bulk() block
        self._wait_done(op, var)
        if held is not None and held.state != DONE:
            self._wait_done(held, var)
        self._sync_var(var)

    def waitall(self) -> None:
        """Block until every pushed operation is done; raise the first error not yet reported."""
        self._flush_bulk()
        self._wait_all()
        with self._errors_lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def _report(self, exc: BaseException) -> None:
        with self._errors_lock:
            self._errors = [e for e in self._errors if e is not exc]

    def _refusal(self) -> Exception:
        """The error a push to this engine raises once it refuses work (closed, or a worker died)."""
        if self._broken is not None:
            return self._worker_error()
        return EngineClosedError(f"this {self.kind} engine is closed; create a new one to push more work")

    def _worker_error(self) -> EngineWorkerError:
        """A fresh error naming the worker that died and why (each raise gets its own traceback)."""
        assert self._broken is not None
        label, exc = self._broken
        error = EngineWorkerError(
            f"engine worker {label} died ({type(exc).__name__}: {exc}); the operations it held will never "
            f"finish, so this {self.kind} engine can run nothing more: close() it (that stops the other "
            "workers) and create a new one")
        error.__cause__ = exc
        return error

    def _wait_done(self, op: Op, var: Var | None = None) -> None:
        """Block until ``op`` (or, for a bulk member, its batch) is done; ``var``: what the caller reads."""
        raise NotImplementedError

    def _wake_waiters(self) -> None:
        """Wake threads blocked in a wait so they look at operation states again."""

    # ----------------------------------------------------------------- what this thread runs
    def _running_stack(self) -> list[Op]:
        """This thread's operations run inline (stolen or synchronous), innermost last."""
        loc = self._local
        stack = loc.running
        if stack is None:
            loc.running = stack = []
        return stack

    def _running_ops(self) -> list[Op]:
        """Every operation this thread is in the middle of running, outermost first (empty: none)."""
        loc = self._local
        ops = list(loc.running or ())
        worker = loc.worker
        if worker is not None and worker.current is not None:
            ops.insert(0, worker.current)
        return ops

    def _refuse_inside_op(self, call: str, consequence: str) -> None:
        running = self._running_ops()
        if running:
            from .waitgraph import describe_op

            raise EngineUsageError(f"{call} was called inside the pushed function of {describe_op(running[-1])}; "
                                   f"{consequence}. Call it from the thread that pushes the work, outside "
                                   "pushed functions")

    def _wait_all(self) -> None:
        raise NotImplementedError

    def _sync_var(self, var: Var) -> None:
        """Make device work on ``var`` visible to the host (GPU engines wait for an event)."""

    # ----------------------------------------------------------------- tracing
    @property
    def tracing(self) -> bool:
        """Whether a timeline is being recorded (work run outside an operation would be missing from it)."""
        return self._trace is not None

    def start_trace(self) -> None:
        """Start recording a timeline of every operation (see :meth:`stop_trace`)."""
        self._trace = []
        self._trace_t0 = perf_counter_ns()

    def stop_trace(self) -> Any:
        """Stop recording and return the :class:`~dlperf.engine.trace.Trace` of what ran."""
        from .trace import Trace

        records, self._trace = self._trace or [], None
        return Trace.from_records(records, self._trace_t0)

    # ----------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Finish pending work, stop and join every worker thread; raise the first unreported error.

        An error that no wait point raised (no ``wait_to_read``, ``Op.wait`` or ``waitall`` touched
        it) is raised here, so a failed operation is never silently dropped; a worker thread that failed
        is raised too (as that error's context, when there is one): the other workers are stopped and
        joined first, and :class:`EngineWorkerError` names it. Leaving a ``with``
        block closes the engine the same way, except that an exception already leaving the block
        wins. Idempotent: a second ``close()`` does nothing.

        >>> from dlperf.engine import create_engine
        >>> eng = create_engine()
        >>> _ = eng.push(lambda: 1 / 0)
        >>> eng.close()
        Traceback (most recent call last):
        ...
        ZeroDivisionError: division by zero
        """
        self._close(raise_errors=True)

    def _close(self, raise_errors: bool) -> None:
        # Refused even when closed already, so the outcome does not depend on a race with the owner.
        self._refuse_inside_op("close()", "closing waits for every operation, including that one, and stops "
                               "the worker running it")
        if self._finished:
            return
        try:
            self._flush_bulk()
        except (EngineClosedError, EngineWorkerError):
            pass
        self._closed = self._finished = True
        try:
            self._shutdown()
        finally:
            # a worker thread that failed to end never drops the operations' errors: the first of those is
            # raised (the worker's error as its context), as it would be without it
            with self._errors_lock:
                errors, self._errors = self._errors, []
            if errors and raise_errors:
                raise errors[0]

    def _shutdown(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (an engine whose worker died refuses work too, but is not closed yet)."""
        return self._finished

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        leaving = exc_info[0] if isinstance(exc_info[0], BaseException) else None
        with cleanup_step("an engine worker", leaving):  # the exception leaving the block wins
            self._close(raise_errors=exc_type is None)

    def _abandon(self) -> None:
        """Called when the engine is garbage-collected unclosed: let its threads end (must not block)."""

    def __del__(self) -> None:  # best effort; explicit close() is the contract
        # Nothing can be pending here (queued operations keep their engine alive), and this may
        # run in any thread, even one holding the engine's lock: signal, never wait or join.
        try:
            if not self._finished:
                self._closed = self._finished = True
                self._abandon()
        except Exception:
            pass


_CPU0 = cpu(0)


def _noop() -> None:
    return None


def _finish_unrun(parent: Op, exc: BaseException) -> None:
    """Mark a batch that was never sent, and its members, done with ``exc``."""
    parent.exc = exc
    parent.state = DONE
    for inner in parent.args[0]:
        inner.exc = exc
        inner.state = DONE


# --------------------------------------------------------------------- registry and default
_ENGINES: Registry[type[Engine]] = Registry("engine")


def register_engine(name: str, cls: type[Engine], *, replace: bool = False) -> None:
    """Make an engine class available to :func:`create_engine` under ``name``."""
    if not isinstance(cls, type) or not issubclass(cls, Engine):
        raise EngineArgumentError(f"register_engine: cls is {cls!r:.60}; expected a subclass of Engine")
    _ENGINES.register(name, cls, replace=replace)


def engine_kinds() -> list[str]:
    """Names :func:`create_engine` accepts."""
    _load_builtin()
    return sorted(_ENGINES.names())


def _load_builtin() -> None:
    # A cycle inside this package that stays: the registry loads the built-in engines on first use,
    # and each, a subclass of Engine, registers itself (as hybrid's backends do).
    from . import naive, threaded  # noqa: F401


def create_engine(kind: str | None = None, config: EngineConfig | None = None, **settings: Any) -> Engine:
    """Create an engine by name (default: ``$DLPERF_ENGINE`` or ``threaded``).

    Keyword settings are :class:`EngineConfig` fields.

    >>> with create_engine("naive", cpu_threads=1) as eng:
    ...     eng.kind
    'naive'
    """
    _load_builtin()
    kind = kind or os.environ.get(ENGINE_ENV) or "threaded"
    if kind not in _ENGINES:
        raise unknown_choice("engine", kind, sorted(_ENGINES.names()))
    if config is not None and settings:
        raise UsageError("pass either config= or keyword settings, not both")
    if config is not None and not isinstance(config, EngineConfig):
        raise EngineArgumentError(f"create_engine: config is {type(config).__name__}; expected an EngineConfig")
    unknown = sorted(set(settings) - {f.name for f in fields(EngineConfig)})
    if unknown:
        raise EngineArgumentError(f"create_engine: unknown setting {unknown[0]!r}; EngineConfig has "
                                  + ", ".join(f.name for f in fields(EngineConfig)))
    return _ENGINES.get(kind)(config or EngineConfig(**settings))


_default: Engine | None = None
_default_lock = threading.Lock()


def default_engine() -> Engine:
    """The process-wide engine, created on first use and closed at interpreter exit.

    Libraries and tests should prefer engines they create and close themselves.
    """
    global _default
    eng = _default
    if eng is not None and not eng.closed:
        return eng
    with _default_lock:
        if _default is None or _default.closed:
            first = _default is None
            _default = create_engine()
            if first:
                atexit.register(_close_default)
        return _default


def _close_default() -> None:
    if _default is not None:
        _default.close()


_LIVE: weakref.WeakSet[Engine] = weakref.WeakSet()


def waitall() -> None:
    """Wait for everything pushed to every open engine (d2l's ``npx.waitall()``).

    Covers the default engine and every engine made with :func:`create_engine` that is still
    open; closed ones have nothing left to wait for. Every engine is waited for even if one
    reports an error; the first error is raised at the end.

    >>> with create_engine() as eng:
    ...     box = []
    ...     _ = eng.push(box.append, args=(1,))
    ...     waitall()
    ...     box
    [1]
    """
    first: BaseException | None = None
    for eng in list(_LIVE):
        if eng.closed:
            continue
        try:
            eng.waitall()
        except BaseException as exc:
            if first is None:
                first = exc
    if first is not None:
        raise first

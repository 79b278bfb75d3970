"""Per-device workers: one thread per (device, lane) that runs ready operations.

A worker owns a FIFO of ready operations (plus a heap for those pushed with a priority) and sleeps on a lock used
as a one-shot semaphore, so a push to a busy worker costs one ``deque.append``. Each wake-up drains every ready
operation and releases their dependents in groups. A CPU worker that ran dry naps briefly (``NAP_S`` up to
``IDLE_CHECK_S``) and, while its operations are small, is left asleep by a push (:meth:`Worker.enqueue_pushed`);
it sets its own intra-op thread budget (:class:`CpuWorker`). A worker knows its engine only as a weakly held
:class:`WorkerHost`, so an engine dropped without ``close()`` is still collected. The rules and their reasons:
docs/design/engine.md.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sized
from time import perf_counter, thread_time
from typing import Protocol

import torch

from .._threads import ServiceThread, restore_process_default, set_thread_budget
from ..devices import Device, cpu_count
from .batches import members as _members
from .batches import run_auto
from .var import QUEUED, RUNNING, Op

__all__ = ["Worker", "WorkerHost", "CpuWorker", "MAX_BATCH"]

MAX_BATCH = 256  # ready operations taken per lock acquisition: bounds how long priorities wait
IDLE_CHECK_S = 1.0  # an idle worker checks this often whether its engine was dropped unclosed
NAP_S = 0.0005  # a CPU worker that ran dry looks at its queue again after this, twice as long each time...
DEFER_NAP_S = 0.002  # ...and while it will look within this, a push does not wake it (see enqueue_pushed)
DEFER_MAX = 64  # unless this many operations are queued: then they are worth a wake-up at once
SMALL_OP_S = 0.00002  # ...and only while its recent operations took less than this each, about what a
# wake-up costs: a nap must never hold back work that could run beside another device's (d2l 12.3's
# automatic parallelism shows from ~0.1 ms operations on), nor the start of anything longer
LONG_OP_S = 0.0002  # a worker whose recent operations took longer gets no automatic batches (but of
# records on tiny inputs, see ThreadedEngine._push_rec_slow): a long member would hold back the
# dependents of the members before it
_seq = itertools.count()


class WorkerHost(Protocol):
    """What a worker needs from the engine that owns it: all it may read or call there.

    The first four are read once, when the worker is made; the rest at each use.
    """

    @property
    def lock(self) -> threading.Lock:
        """The scheduler's lock: a worker's queues and counters change only under it."""

    @property
    def open_auto(self) -> Sized:
        """The automatic batches threads are collecting (one shared, changing container)."""

    @property
    def batch_latency_s(self) -> float:
        """A batch's finished operations are released at least this often (seconds)."""

    @property
    def cpu_threads(self) -> int | None:
        """Intra-op threads per CPU device; None: a fair share of the cores."""

    @property
    def cpu_workers(self) -> int:
        """CPU workers started so far (they share the cores)."""

    @property
    def blind_waiters(self) -> int:
        """Threads waiting for any completion: finished operations are released to them at once."""

    @property
    def has_gpu(self) -> bool:
        """Whether a GPU worker exists (then CPU operations wait for device events first)."""

    @property
    def host_threads(self) -> int:
        """The process default intra-op thread count, put back after a worker's budget."""

    def execute(self, op: Op, where: str) -> None:
        """Run ``op`` in this thread; skip it if an input failed, keep its error."""

    def complete(self, ops: list[Op]) -> None:
        """Release the variables of finished operations and wake whoever waits (takes the lock)."""

    def fail(self, op: Op, exc: BaseException) -> None:
        """Mark ``op`` failed with ``exc`` without running it."""

    def send_auto_for(self, worker: Worker) -> int:
        """Send ``worker``'s automatic batches that stopped growing (lock held): 1 sent, -1 growing, 0 none."""

    def worker_started(self, worker: Worker) -> None:
        """Called in the worker's thread before it runs anything (the engine marks the thread)."""

    def worker_died(self, worker: Worker, exc: BaseException) -> None:
        """Called in the worker's thread when its loop failed: nothing will run its operations any more."""


class Worker:
    """A thread that runs the ready operations of one device lane (``compute`` or ``copy``)."""

    can_steal = False  # may a thread waiting on one of our queued ops run it itself?
    first_nap = IDLE_CHECK_S  # sleep after running dry; short only where pushes may skip the wake-up

    def __init__(self, host: WorkerHost, device: Device, lane: str) -> None:
        # Weak: the thread must not keep an unclosed, unreferenced engine alive (see _loop). It gives
        # None only once the engine is collected, when no operation of this worker is queued or
        # running: only _loop and _send_collected, which run then, check.
        self._host_ref: Callable[[], WorkerHost] = weakref.ref(host)  # type: ignore[assignment]
        self._lock = host.lock
        self._open_auto = host.open_auto  # threads' unsent automatic batches (see ThreadedEngine)
        self._latency = host.batch_latency_s
        self.device = device
        self.lane = lane
        self.label = f"{device}/{lane}"
        self.caller_label = f"{device}/caller"  # where a waiting thread that runs our operation runs it
        self.unfinished = 0      # pushed, not yet done (engine lock): the max_queued limit counts these
        self.busy = False        # running a batch (engine lock)
        # What this thread is running, for the wait-for graph (see waitgraph.py) and so that a wait
        # inside an operation can first release the batch's finished operations.
        self.current: Op | None = None
        self.batch: list[Op] | None = None
        self._done: list[Op] = []  # run, not yet released to the scheduler
        self._q: deque[Op] = deque()
        self._heap: list[tuple[int, int, Op]] = []
        self._sleeping = False
        self._nap = IDLE_CHECK_S  # timeout of the current (or next) sleep (engine lock)
        self.small_ops = False   # its last batch (or stolen op) averaged under SMALL_OP_S an op
        self.long_ops = False    # ...or over LONG_OP_S: then pushes to it are not batched automatically
        self._stop = False
        self.setup_error: BaseException | None = None
        self._wake = threading.Lock()
        self._wake.acquire()     # held = "no news"; enqueue() releases it once per sleep
        self.thread = ServiceThread(self._run, name=f"dlperf-engine-{self.label}")

    @property
    def host(self) -> WorkerHost:
        """The owning engine (alive whenever an operation of this worker is queued or running)."""
        return self._host_ref()

    def start(self) -> None:
        self.thread.start()

    # engine lock held ------------------------------------------------------------------------
    def enqueue(self, op: Op) -> None:
        if op.priority:
            heapq.heappush(self._heap, (-op.priority, next(_seq), op))
        else:
            self._q.append(op)
        if self._sleeping:
            self._sleeping = False
            self._wake.release()

    def enqueue_pushed(self, op: Op) -> None:
        """Queue an operation a frontend push made ready; wake the worker only if it would sleep long.

        A wake-up costs more than a small operation: the woken thread competes for the GIL with
        the pusher, which typically waits for this very operation next and then runs it itself
        (see ThreadedEngine._wait_done). A worker that ran dry a moment ago looks at its queue
        again within ``DEFER_NAP_S`` on its own, so a push leaves it asleep; every wait wakes the
        workers whose queued operations it may need (``ThreadedEngine._wake_deferred``).
        """
        if op.priority:
            heapq.heappush(self._heap, (-op.priority, next(_seq), op))
        else:
            self._q.append(op)
        if self._sleeping and (self._nap > DEFER_NAP_S or not self.small_ops or len(self._q) >= DEFER_MAX):
            self.wake()

    def wake(self) -> None:
        """Wake the worker if it sleeps."""
        if self._sleeping:
            self._sleeping = False
            self._wake.release()

    def wake_if_queued(self) -> None:
        """Wake the worker if it sleeps on queued operations (a wait may need them now)."""
        if self._sleeping and (self._q or self._heap):
            self._sleeping = False
            self._wake.release()

    def stop(self) -> None:
        self._stop = True
        if self._sleeping:
            self._sleeping = False
            self._wake.release()

    def stuck_ops(self) -> list[Op]:
        """Operations that cannot start before the current one ends: rest of the batch, the queue."""
        out: list[Op] = []
        batch, current = self.batch, self.current
        if batch and current is not None:
            for i, op in enumerate(batch):
                if op is current:
                    out.extend(o for o in batch[i + 1:] if o.state == RUNNING)
                    break
        out.extend(op for op in self._q if op.state == QUEUED)
        out.extend(entry[2] for entry in self._heap if entry[2].state == QUEUED)
        return out

    def _take(self) -> tuple[list[Op], list[Op]]:
        # Returns (ops to run, ops a waiting thread already ran); the caller drops the latter
        # outside the lock, since one of them may hold the last reference to the engine.
        out: list[Op] = []
        skipped: list[Op] = []
        q, heap = self._q, self._heap
        while len(out) < MAX_BATCH:
            if heap and (heap[0][0] < 0 or not q):  # positive priority first, negative after the FIFO
                op = heapq.heappop(heap)[2]
            elif q:
                op = q.popleft()
            else:
                break
            if op.state == QUEUED:  # skip ops a waiting thread already ran
                op.state = RUNNING
                out.append(op)
            else:
                skipped.append(op)
        return out, skipped

    def _send_collected(self) -> int:
        """Before going idle (lock held): send the automatic batches threads collect for this worker
        (see ThreadedEngine.send_auto_for for the result)."""
        # (an unsent batch's operation holds the engine: this reference is never the last one)
        host = self._host_ref()
        return 0 if host is None else host.send_auto_for(self)

    # worker thread ---------------------------------------------------------------------------
    def setup(self) -> None:
        """Per-thread initialisation (thread budget, CUDA device and streams)."""

    def before_batch(self) -> None:
        """Called before each batch (CPU workers re-apply a changed thread budget)."""

    def run_op(self, op: Op, where: str) -> None:
        """Run one operation in the current thread (device-specific synchronisation around it)."""
        self.host.execute(op, where)

    def run_stolen(self, op: Op, where: str) -> None:
        """Run ``op`` in a thread that waits for it (only where ``can_steal``)."""
        self.run_op(op, where)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            # An operation's error is kept on the operation; this is the loop itself failing. The engine
            # must know, or its waits would wait for this thread forever; the thread then reports it.
            host = self._host_ref()
            if host is not None and not self._stop:  # (stopped: its queue ran dry, nothing is left to wait for)
                host.worker_died(self, exc)
            del host  # the traceback keeps this frame: it must not keep the engine alive
            raise

    def _loop(self) -> None:
        # No local here may hold the engine (or an operation, which holds its engine) while the
        # worker sleeps, and none may be dropped while the lock is held: dropping the last
        # reference runs Engine.__del__ in this thread.
        self._start()
        lock = self._lock
        nap = IDLE_CHECK_S
        while True:
            with lock:
                batch, skipped = self._take()
                if not batch and self._open_auto:
                    collected = self._send_collected()
                    if collected > 0:
                        batch, more = self._take()
                        skipped += more
                    elif collected < 0:
                        nap = min(nap, NAP_S)  # look again soon: a thread is still collecting
                if not batch:
                    if self._stop:
                        break
                    self._sleeping = True
                    self._nap = nap
                self.busy = bool(batch)
            del skipped  # outside the lock (see _take)
            if not batch:
                if self._wake.acquire(timeout=nap):
                    nap = self.first_nap
                else:
                    with lock:
                        # every release happens under the engine lock with _sleeping set False: one that came
                        # after the timeout is consumed now, or the wake lock would stay released while the
                        # next sleep says otherwise, and a wake then would release an unlocked lock
                        if self._sleeping:
                            self._sleeping = False
                        else:
                            self._wake.acquire(blocking=False)
                    if self._host_ref() is None:
                        break  # the engine was collected unclosed and could not signal us
                    nap = min(2 * nap, IDLE_CHECK_S)
                continue
            self._process(batch)
            del batch  # (see above: nothing may hold an operation while the worker sleeps)
            self.batch = self.current = None
            nap = self.first_nap
        self.teardown()

    def _start(self) -> None:
        self.host.worker_started(self)
        try:
            self.setup()
        except BaseException as exc:  # e.g. CUDA init failed: fail this worker's ops, do not hang
            self.setup_error = exc

    def _process(self, batch: list[Op]) -> None:
        if self.setup_error is not None:
            host = self.host
            for op in batch:
                host.fail(op, self.setup_error)
            host.complete(batch)
            return
        self.before_batch()
        self._run_batch(batch, self._latency)

    def runner(self, host: WorkerHost) -> Callable[[Op, str], None]:
        """The function that runs one operation here (device synchronisation included)."""
        return self.run_op

    def _run_batch(self, batch: list[Op], latency: float) -> None:
        host = self.host
        label = self.label
        self.batch = batch
        run_op = self.runner(host)
        began = perf_counter()
        if len(batch) == 1:
            self.current = op = batch[0]
            if op.fn is run_auto:
                cpu = thread_time()
                run_op(op, label)
                self._judge(thread_time() - cpu, len(op.args[0].run))
            else:
                members = _members(op)
                run_op(op, label)
                self._judge(perf_counter() - began, members)
            host.complete(batch)
            return
        self._done = []
        start = began
        members = sum(_members(op) for op in batch)
        auto = any(op.fn is run_auto for op in batch)
        cpu = thread_time() if auto else 0.0
        for op in batch:
            self.current = op
            run_op(op, label)
            done = self._done  # a wait inside the op may have released and replaced it
            done.append(op)
            now = perf_counter()
            # Release now if a long op (or many short ones) ran, or if someone is already waiting:
            # deferring past the next op could hold a dependent back for that op's whole duration.
            if now - start >= latency or op.waited or host.blind_waiters or _has_dependents(op):
                self._done = []
                host.complete(done)
                start = now
        self._judge(thread_time() - cpu if auto else perf_counter() - began, members)
        done, self._done = self._done, []
        if done:
            host.complete(done)

    def _judge(self, took: float, members: int) -> None:
        # Automatic batches are timed in this thread's CPU time (a system call, paid once a batch):
        # they run while their frontend thread pushes more, and the time spent waiting for the GIL
        # would make small operations look long, turn batching off and wake this worker for every
        # push, the very contention that made them look long.
        self.small_ops = took < SMALL_OP_S * members
        self.long_ops = took > LONG_OP_S * members

    def release_finished(self) -> None:
        """Release the batch's finished operations now (called before this thread blocks in a wait)."""
        done = self._done
        if done:
            self._done = []
            self.host.complete(done)

    def teardown(self) -> None:
        """Per-thread clean-up before the thread exits."""


class CpuWorker(Worker):
    """Worker of a logical CPU device, with its own intra-op thread budget."""

    can_steal = True
    first_nap = NAP_S

    def __init__(self, host: WorkerHost, device: Device, lane: str) -> None:
        super().__init__(host, device, lane)
        self.threads = 0
        self._fixed_threads = host.cpu_threads

    def budget(self) -> int:
        """Intra-op threads for this device: the configured number, or a fair share of the cores."""
        fixed = self._fixed_threads
        if fixed is not None:
            return fixed
        return _cores() // self._host_ref().cpu_workers or 1  # this worker counts, so never divides by 0

    def setup(self) -> None:
        # PyTorch initialises a thread's OpenMP/MKL thread count lazily, on the thread's first
        # get_num_threads()/parallel region, from a process-wide value that set_num_threads() also
        # overwrites. Initialise this thread first, so a later lazy init cannot undo our budget.
        torch.get_num_threads()
        self.before_batch()

    def before_batch(self) -> None:
        want = self.budget()
        if want != self.threads:  # per-thread OpenMP/MKL setting: other threads keep theirs
            set_thread_budget(want, self.host.host_threads)
            self.threads = want

    def run_stolen(self, op: Op, where: str) -> None:
        """Run ``op`` in a waiting thread, under this device's thread budget."""
        want, have = self.budget(), torch.get_num_threads()
        if want == have:  # the usual case: one CPU device, the whole machine
            if op.fn is run_auto:
                cpu = thread_time()
                self.run_op(op, where)
                self._judge(thread_time() - cpu, len(op.args[0].run))
                return
            members = _members(op)
            began = perf_counter()
            self.run_op(op, where)
            self._judge(perf_counter() - began, members)
            return
        torch.set_num_threads(want)
        try:
            self.run_op(op, where)
        finally:
            if want != have:
                torch.set_num_threads(have)  # also the process default: put the engine's back
                host_threads = self.host.host_threads
                if have != host_threads:
                    restore_process_default(host_threads)

    def runner(self, host: WorkerHost) -> Callable[[Op, str], None]:
        # Without GPUs there are no device events to wait for: run the operation directly.
        return self.run_op if host.has_gpu else host.execute

    def run_op(self, op: Op, where: str) -> None:
        host = self._host_ref()
        if not host.has_gpu:
            host.execute(op, where)
            return
        _host_wait_for_events(op)
        host.execute(op, where)
        for v in op.writes:  # a finished host write supersedes any device events
            v._wev = None
            v._revs = None


_cores_cache: list[float] = [0.0, 0.0]  # (checked at, cores)


def _cores() -> int:
    # cpu_count() is a system call; a synchronous loop asks once per operation (run_stolen).
    now = perf_counter()
    if now - _cores_cache[0] > 1.0:
        _cores_cache[:] = [now, cpu_count()]
    return int(_cores_cache[1])


def _has_dependents(op: Op) -> bool:
    # Read without the lock: a stale answer only delays or hastens one group release.
    for v in op.writes:
        if v._queue:
            return True
    for v in op.reads:
        if v._queue:
            return True
    return False


def _host_wait_for_events(op: Op) -> None:
    """Block this host thread until GPU work the operation depends on has finished."""
    for v in op.reads:
        if v._wev is not None:
            v._wev.synchronize()
    for v in op.writes:
        if v._wev is not None:
            v._wev.synchronize()
        if v._revs:
            for ev in list(v._revs.values()):
                ev.synchronize()

"""The threaded engine: the frontend pushes and returns; per-device workers run what is ready.

Scheduling state (each variable's granted readers and writer and its queue, each operation's count of variables
it still waits for) is plain ints and deques under one lock, in the style of MXNet's ``ThreadedVar``; an
operation whose count reaches zero goes to its device's worker (:mod:`dlperf.engine.worker`). A thread that waits
on a ready operation of an idle CPU worker runs it itself; one thread's consecutive small elementwise pushes to a
busy CPU worker are collected into one operation (``EngineConfig.auto_bulk``; the rules at
``ThreadedEngine._push_rec``); a thread that blocks inside an operation checks the wait-for graph
(:mod:`dlperf.engine.waitgraph`). Why each of these, what they cost, and the GIL and garbage-collection costs to
know about: docs/design/engine.md.
"""

from __future__ import annotations

import threading
from time import monotonic

import torch

from .._threads import join_all
from ..devices import Device, require_available
from .batches import AutoBatch, run_auto, run_rec
from .engine import (
    DEADLOCK_FIX,
    Engine,
    EngineClosedError,
    EngineConfig,
    EngineDeadlockError,
    EngineWorkerError,
    register_engine,
)
from .var import DONE, QUEUED, RUNNING, Op, Var
from .waitgraph import Waiter, describe_op, find_cycle
from .worker import DEFER_MAX, DEFER_NAP_S, CpuWorker, Worker

__all__ = ["ThreadedEngine", "RECHECK_S", "RECHECK_MAX_S"]

TINY_NUMEL = 4096  # an elementwise record on at most this many elements an input takes microseconds
RECHECK_S = 0.05
"""A thread blocked inside an operation re-checks the wait-for graph after this long (seconds)..."""
RECHECK_MAX_S = 0.5
"""...then twice as long each time up to this: a long legitimate wait costs little."""


class ThreadedEngine(Engine):
    """Asynchronous engine with one worker thread per device lane; see the module docstring.

    >>> import torch
    >>> from dlperf.devices import cpu
    >>> with ThreadedEngine() as eng:
    ...     ops = [eng.push(torch.ones, args=(2,), device=cpu(i)) for i in range(2)]
    ...     [op.wait().sum().item() for op in ops]
    [2.0, 2.0]
    """

    kind = "threaded"

    def __init__(self, config: EngineConfig | None = None) -> None:
        super().__init__(config)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._workers: dict[tuple[Device, str], Worker] = {}
        self._pending = 0
        # Who must be woken when operations finish (a notify wakes every waiter, each of which then
        # competes for the GIL, so finishing an operation nobody waits for wakes nobody):
        self.blind_waiters = 0  # waits that need every completion: room under max_queued, held ops
        self._all_waiters = 0    # waitall()s: woken when nothing is pending
        self.cpu_workers = 0
        self.has_gpu = False
        # The compute worker pushes went to last. Its worker is read only when a push's device is
        # this one, which no push's device is while it is None.
        self._last: tuple[Device | None, Worker] = (None, None)  # type: ignore[assignment]
        self._blocked: dict[int, Waiter] = {}  # threads waiting inside operations, by thread id
        # Automatic batches (see _push_rec). max_queued bounds unfinished operations one by one,
        # which batches would make coarse, so it turns them off.
        self._auto_size = self.config.auto_bulk if self.config.max_queued is None else 0
        self._open_auto: list[AutoBatch] = []  # every thread's unsent automatic batch (engine lock)
        # Array records sent in automatic batches, and sent alone while batching was on (engine
        # lock): whether a slow run of small operations batched at all (benchmarks/bench_engine.py).
        self.records_batched = 0
        self.records_alone = 0
        # Initialise this thread's PyTorch thread count now (see CpuWorker.setup) and remember it
        # as the process default that workers restore after setting their own budgets.
        self.host_threads = torch.get_num_threads()

    # ----------------------------------------------------------------- what workers see (WorkerHost)
    # Workers read these once when made, and call the methods below; the counters above
    # (blind_waiters, cpu_workers, has_gpu, host_threads) they read as plain attributes.
    @property
    def lock(self) -> threading.Lock:
        return self._lock

    @property
    def open_auto(self) -> list[AutoBatch]:
        return self._open_auto

    @property
    def batch_latency_s(self) -> float:
        return self.config.batch_latency_us * 1e-6

    @property
    def cpu_threads(self) -> int | None:
        return self.config.cpu_threads

    execute = Engine._execute
    fail = Engine._fail

    def worker_started(self, worker: Worker) -> None:
        self._local.worker = worker

    def worker_died(self, worker: Worker, exc: BaseException) -> None:
        # Its queued and running operations never finish: refuse pushes, and wake every wait so that it
        # raises instead of waiting for them (waits check _broken only when they would block).
        with self._lock:
            if self._broken is None:
                self._broken = (worker.label, exc)
            self._closed = True
            worker.can_steal = False  # a waiting thread must not run part of its queue: it raises
            self._cond.notify_all()

    # ----------------------------------------------------------------- workers
    def _worker(self, device: Device, kind: str) -> Worker:
        last_dev, last_w = self._last
        if device is last_dev and kind == "compute":
            return last_w
        lane = "copy" if kind == "copy" and device.is_gpu else "compute"
        w = self._workers.get((device, lane))
        if w is None:
            w = self._start_worker(device, lane)
        if lane == "compute":
            self._last = (device, w)
        return w

    def _start_worker(self, device: Device, lane: str) -> Worker:
        require_available(device)  # a worker for a missing GPU would die and leave its ops hanging
        with self._lock:
            w = self._workers.get((device, lane))
            if w is not None:
                return w
            if self._closed:
                raise self._refusal()
            if device.is_gpu:
                from .cuda import GpuWorker

                w = GpuWorker(self, device, lane)
                self.has_gpu = True
            else:
                w = CpuWorker(self, device, lane)
                self.cpu_workers += 1
            self._workers[(device, lane)] = w
            w.start()
            return w

    @property
    def workers(self) -> list[str]:
        """Labels of the workers started so far, e.g. ``['cpu(0)/compute']``."""
        return [w.label for w in self._workers.values()]

    # ----------------------------------------------------------------- scheduling (lock held)
    def _submit(self, op: Op, device: Device, kind: str) -> None:
        last_dev, worker = self._last
        switched = device is not last_dev or kind != "compute"
        if switched:
            worker = self._worker(device, kind)
        with self._lock:
            if self._closed:
                raise self._refusal()
            limit = self.config.max_queued
            # A thread inside an operation may not wait for room: the room may be its own operation.
            if limit is not None and worker.unfinished >= limit and not self._running_ops():
                self._wait_for_room(worker, limit)
            if self._open_auto:
                self._order_after_auto(op, worker)
            self._submit_locked(op, worker, switched)

    def _submit_locked(self, op: Op, worker: Worker, switched: bool) -> None:
        """Schedule ``op`` on ``worker`` (lock held; callers check that the engine is open)."""
        op.worker = worker
        if self._trace is not None:
            self._trace_deps(op, self._ids)
        for v in op.reads:
            if v._writing or v._queue:
                self._enqueue_var(v, op, False)
            else:
                v._readers += 1
        for v in op.writes:
            if v._writing or v._readers or v._queue:
                self._enqueue_var(v, op, True)
            else:
                v._writing = True
            v._last_write = op
        worker.unfinished += 1
        self._pending += 1
        waits = op.wait_count - 1  # drop the guard count Op() starts with
        op.wait_count = waits
        if waits == 0:
            op.state = QUEUED
            if op.priority:
                worker.enqueue_pushed(op)
                return
            q = worker._q  # Worker.enqueue_pushed, inlined for the common case
            q.append(op)
            # a push that turns to another worker is work meant to run beside the last one's
            # (d2l 12.3's automatic parallelism): that worker is woken now, never left to its nap
            if worker._sleeping and (switched or worker._nap > DEFER_NAP_S or not worker.small_ops
                                     or len(q) >= DEFER_MAX):
                worker.wake()

    def _wait_for_room(self, worker: Worker, limit: int) -> None:
        """Block (lock held) until ``worker`` has fewer than ``limit`` unfinished operations."""
        self.blind_waiters += 1
        try:
            self._wake_deferred()
            while worker.unfinished >= limit:  # bound memory held by queued work
                if self._broken is not None:
                    raise self._worker_error()
                self._cond.wait()
        finally:
            self.blind_waiters -= 1
        if self._broken is not None:
            raise self._worker_error()
        if self._closed:  # closed while we waited: its workers may be stopped already
            raise EngineClosedError("this threaded engine was closed while a push waited for room "
                                    "(max_queued); create a new one to push more work")

    def _wake_deferred(self) -> None:
        """Wake every worker sleeping on queued operations a push did not wake it for (lock held)."""
        for w in self._workers.values():
            w.wake_if_queued()

    # ----------------------------------------------------------------- automatic batches
    # One thread's consecutive elementwise array operations to a busy CPU worker are collected as
    # light records (runner, function, inputs, output) into one engine operation, MXNet's bulk
    # execution without a bulk() block. Collecting one costs a few stores, no lock (see AutoBatch):
    # no Op, no scheduling, no release. Nothing waits longer than it would unbatched: a push to an
    # idle worker is sent at once; the worker, once it runs dry, sends a batch that stopped growing
    # (one still growing is sent by its thread at the size bound); any wait that needs a result
    # sends its batch (whichever thread waits), waitall sends them all, and any other push sends
    # the batches of its worker and those whose results it uses or whose inputs it writes. A record
    # joins only if what it reads is ready, made in the batch, or made by work already queued on
    # the same worker: members never wait behind work that could wait for them. Measured on the
    # per-operation benchmark (1000 x `x + 1` then waitall), quiet or with a CPU hog on one of the
    # two cores: after the first round, 997-999 of each round's 1000 records were batched (the
    # first push of a round finds the worker idle and goes alone), also in runs 1.5x slower than
    # usual under other programs' load: those are slow for want of a core, not of batches. Only a
    # loop that starts while the worker looks long (see below) went one by one, up to all 1000.
    def _push_rec(self, rec: tuple, read: Var, read2: Var | None, out: Var, device: Device, name: str) -> None:
        batch = self._local.auto
        if batch is not None and batch.device is device and not batch.sealed:
            op = batch.op
            last = read._last_write
            if (last is None or last is op or last.state == DONE) and (
                    read2 is None or (last := read2._last_write) is None or last is op or last.state == DONE):
                reads = batch.reads
                reads[read] = None
                if read2 is not None:
                    reads[read2] = None
                out._last_write = op
                out._writing = True  # granted to the batch: nothing else can have asked for it
                batch.outs.append(out)  # before the record: a sender takes as many as records
                recs = batch.recs
                recs.append(rec)
                if batch.sealed or len(recs) >= self._auto_size:
                    self._appended(batch, rec, read, read2, name)
                return
        self._push_rec_slow(rec, read, read2, out, device, name)

    def _appended(self, batch: AutoBatch, rec: tuple, read: Var, read2: Var | None, name: str) -> None:
        """After an append to this thread's batch that filled it or raced with its sending."""
        if batch.sealed:
            index = len(batch.recs) - 1  # only this thread appends
            with batch.lock:  # the sender is done once it lets go
                taken = index < len(batch.run)
            if not taken:  # appended after the sender took the records: push it again
                out = rec[-1]._var
                out._writing = False
                out._last_write = None
                self._push_rec_slow(rec, read, read2, out, batch.device, name)
            return
        self._flush_auto()

    def _push_rec_slow(self, rec: tuple, read: Var, read2: Var | None, out: Var, device: Device,
                       name: str) -> None:
        loc = self._local
        reads = (read,) if read2 is None else (read, read2)
        batch = loc.auto
        if batch is not None and (batch.sealed or batch.device is not device):
            self._flush_auto()
            batch = None
        if (not self._auto_size or loc.bulk is not None or loc.worker is not None or loc.running
                or self._trace is not None or self._closed):
            self._push(run_rec, (rec,), reads, (out,), device, 0, name, "compute")  # one by one
            return
        switched = device is not self._last[0]
        worker = self._worker(device, "compute")
        with self._lock:  # every sender holds it: nothing seals the batch meanwhile
            if self._closed:
                raise self._refusal()
            for v in reads:  # written in another thread's unsent batch: send it, then order after it
                last = v._last_write
                if last is not None and last.worker is None and last.fn is run_auto and (
                        batch is None or last is not batch.op):
                    self._send_auto(last.args[0])
            if batch is not None and _joins(reads, batch.op, worker):
                self._add(batch, rec, reads, out)
                if len(batch.recs) >= self._auto_size:
                    self._send_auto(batch)
                    loc.auto = None
                return
            if batch is not None:
                self._send_auto(batch)
                loc.auto = None
            # A push to an idle worker starts at once; only small work is batched (a long member
            # would hold back the dependents of the members before it). A worker's judgement lags:
            # after an operation that looked long (its first, or one preempted on a loaded machine)
            # it stays until the worker runs again, which, while this thread holds the GIL, is a
            # switch interval (5 ms) away: thousands of pushes. Records on inputs too small to
            # take long are batched regardless.
            if (not worker.can_steal or not (worker.busy or worker._q)
                    or (worker.long_ops and not _tiny(rec)) or not _joins(reads, None, worker)):
                self.records_alone += 1
                self._submit_locked(Op(self, run_rec, (rec,), reads, (out,), None, 0, name), worker, switched)
                return
            batch = loc.auto = AutoBatch(Op(self, run_auto, (), (), (), None, 0, "auto_bulk"), device, worker)
            self._open_auto.append(batch)
            self._add(batch, rec, reads, out)

    @staticmethod
    def _add(batch: AutoBatch, rec: tuple, reads: tuple, out: Var) -> None:
        for v in reads:
            batch.reads[v] = None
        out._last_write = batch.op
        out._writing = True
        batch.outs.append(out)
        batch.recs.append(rec)

    def _flush_auto(self) -> None:
        loc = self._local
        batch = loc.auto
        if batch is not None:
            loc.auto = None
            if not batch.sealed:
                with self._lock:
                    self._send_auto(batch)

    def _send_auto(self, batch: AutoBatch) -> None:
        """Schedule an automatic batch as one operation, unless already sent (engine lock held)."""
        with batch.lock:
            if batch.sealed:
                return
            batch.sealed = True
            # The owner may append meanwhile: what it appends from here on is not taken (it sees
            # `sealed` and pushes the record again). Copies are single C calls: atomic under the GIL.
            run = batch.run = batch.recs[:]
            reads = list(batch.reads)
            outs = batch.outs[:len(run)]  # each record's output is appended just before it
        self._open_auto.remove(batch)
        op = batch.op
        op.reads = tuple(v for v in reads if v._last_write is not op)
        # The outputs were granted to the batch when collected; complete() releases them.
        batch.sent_outs = outs
        op.name = f"auto_bulk[{len(run)}]"
        self.records_batched += len(run)
        self._submit_locked(op, batch.worker, False)

    def _order_after_auto(self, op: Op, worker: Worker) -> None:
        """Send the unsent batches ``op`` must follow: every one collected for its worker (which
        runs in push order), and those that write what it uses or read what it writes."""
        for batch in list(self._open_auto):
            if batch.worker is worker:
                self._send_auto(batch)
        for v in op.reads:
            last = v._last_write
            if last is not None and last.worker is None and last.fn is run_auto:
                self._send_auto(last.args[0])
        for v in op.writes:
            last = v._last_write
            if last is not None and last.worker is None and last.fn is run_auto:
                self._send_auto(last.args[0])
            for batch in list(self._open_auto):
                if v in batch.reads:
                    self._send_auto(batch)

    def send_auto_for(self, worker: Worker) -> int:
        """Called by ``worker`` (lock held) before it goes idle: send the batches collected for it
        that stopped growing since it last looked. 1: sent some; -1: some still grow (look again
        soon: their thread is busy collecting and sends them at the size bound); 0: none."""
        result = 0
        for batch in list(self._open_auto):
            if batch.worker is worker:
                n = len(batch.recs)
                if n == batch.seen:
                    self._send_auto(batch)
                    result = 1
                else:
                    batch.seen = n
                    result = result or -1
        return result

    @staticmethod
    def _enqueue_var(v: Var, op: Op, is_write: bool) -> None:
        if v._queue is None:
            from collections import deque

            v._queue = deque()
        v._queue.append((op, is_write))
        op.wait_count += 1

    @staticmethod
    def _ready(op: Op) -> None:
        op.wait_count -= 1
        if op.wait_count == 0:
            op.state = QUEUED
            op.worker.enqueue(op)

    def _grant(self, v: Var) -> None:
        q = v._queue
        if v._writing or not q:
            return
        if q[0][1]:  # a write: needs the variable to itself
            if v._readers == 0:
                op = q.popleft()[0]
                v._writing = True
                self._ready(op)
            return
        while q and not q[0][1]:  # a run of reads goes together
            op = q.popleft()[0]
            v._readers += 1
            self._ready(op)

    def _release_writes(self, op: Op, writes: tuple, forget: bool) -> None:
        for v in writes:
            v._writing = False
            if v._queue:
                self._grant(v)
            elif forget and v._last_write is op:
                v._last_write = None

    def complete(self, ops: list[Op]) -> None:
        """Release the variables of finished operations and wake whoever waits (takes the lock)."""
        with self._lock:
            wake = self.blind_waiters
            forget = self._trace is None
            for op in ops:
                for v in op.reads:
                    v._readers -= 1
                    if v._readers == 0 and v._queue:
                        self._grant(v)
                self._release_writes(op, op.writes, forget)
                if op.fn is run_auto:  # an automatic batch's outputs are kept beside its writes
                    self._release_writes(op, op.args[0].sent_outs, forget)
                # Break the cycles op -> args -> output array -> var -> op: reference counting, not
                # the cyclic collector, then frees each finished operation (see the module docstring).
                op.args = ()
                op.state = DONE
                op.worker.unfinished -= 1
                if op.waited:
                    wake = True
            self._pending -= len(ops)
            if wake or (self._all_waiters and not self._pending):
                self._cond.notify_all()

    # ----------------------------------------------------------------- waiting
    def _wait_done(self, op: Op, var: Var | None = None) -> None:
        if op.state == DONE:
            return
        w = op.worker
        if w is None and op.fn is run_auto:  # an unsent automatic batch (maybe another thread's)
            with self._lock:
                self._send_auto(op.args[0])
            w = op.worker
        if w.__class__ is Op:  # a member of a sent batch: wait for (or run) the batch
            self._wait_done(w, var)
            return
        steal = False
        if w is not None:  # None: held in another thread's open bulk(), nothing to run yet
            with self._lock:
                if op.state == QUEUED and w.can_steal and not w.busy and w.setup_error is None:
                    op.state = RUNNING  # the worker will skip it
                    steal = True
                    q = w._q
                    if q and q[-1] is op:  # the usual case: pushed, then waited for at once
                        q.pop()
                    w.wake_if_queued()  # what was pushed before it runs meanwhile
        if steal:
            self._run_here(w, op)
            return
        running = self._running_ops()
        if running:
            self._wait_inside_op(op, var, running)
            return
        # Not running an operation: nothing waits for this thread, so it cannot close a cycle.
        with self._lock:
            blind = self._mark_waited(op)
            self._wake_deferred()
            try:
                while op.state != DONE:
                    if self._broken is not None:
                        raise self._worker_error()
                    self._cond.wait()
            finally:
                self.blind_waiters -= blind

    def _run_queued_batches(self) -> bool:
        """Run, in this waiting thread, the array records first in line on an idle CPU worker.

        Small work only (what automatic batches hold): waking the worker and sleeping until it is
        done costs two thread switches, and on a loaded machine each can wait for a free core.
        """
        with self._lock:
            for w in self._workers.values():
                q = w._q
                if (q and q[0].fn in _SMALL_WORK and w.can_steal and not w.busy and not w.long_ops
                        and w.setup_error is None):
                    ops = []
                    while q and q[0].fn in _SMALL_WORK:
                        op = q.popleft()
                        if op.state == QUEUED:
                            op.state = RUNNING  # (the worker skips what it finds in this state)
                            ops.append(op)
                    break
            else:
                return False
        for op in ops:
            self._run_here(w, op)
        return True

    def _run_here(self, w: Worker, op: Op) -> None:
        """Run ``op``, taken from ``w``'s queue, in this waiting thread, then release it."""
        stack = self._running_stack()
        stack.append(op)
        try:
            w.run_stolen(op, w.caller_label)
        finally:
            stack.pop()
        self.complete([op])

    def _mark_waited(self, op: Op) -> int:
        """Ask for a wake-up when ``op`` finishes (lock held); 1 if every completion must wake us."""
        op.waited = True
        if op.worker is None:  # held in another thread's open bulk(): its batch is not known yet
            self.blind_waiters += 1
            return 1
        return 0

    def _wait_inside_op(self, op: Op, var: Var | None, running: list[Op]) -> None:
        """Block a thread that runs operations, as a node of the wait-for graph; raise on a cycle."""
        worker = self._local.worker
        if worker is not None:
            worker.release_finished()  # they ran: nothing may wait for them behind this wait
        me = Waiter(running, worker, op, var)
        key = threading.get_ident()
        with self._lock:
            self._blocked[key] = me
            blind = self._mark_waited(op)
            self._wake_deferred()
            try:
                self._check_cycle(me)
                pause = RECHECK_S
                next_check = monotonic() + pause
                while op.state != DONE:
                    if self._broken is not None:
                        raise self._worker_error()
                    # A cycle can also close without a new wait (an operation it waits for becomes
                    # queued on a stuck worker, a bulk batch is sent): look again now and then.
                    self._cond.wait(pause)
                    if op.state != DONE and monotonic() >= next_check:
                        self._check_cycle(me)
                        pause = min(2 * pause, RECHECK_MAX_S)
                        next_check = monotonic() + pause
            finally:
                self.blind_waiters -= blind
                del self._blocked[key]

    def _check_cycle(self, me: Waiter) -> None:
        cycle = find_cycle(me, list(self._blocked.values()))
        if cycle is not None:
            raise EngineDeadlockError(f"this wait would deadlock, so it was not started: {cycle}. {DEADLOCK_FIX}")

    def _wake_waiters(self) -> None:
        with self._lock:
            self._cond.notify_all()

    def _wait_all(self) -> None:
        running = self._running_ops()
        if running:
            raise EngineDeadlockError(
                f"waitall() was called inside the pushed function of {describe_op(running[-1])}; it waits for "
                "every pushed operation, that one included, so it would never return. Wait for what the "
                "function needs with wait_to_read(), or call waitall() outside pushed functions")
        with self._lock:
            for batch in list(self._open_auto):  # every thread's collected operations count as pushed
                self._send_auto(batch)
        while self._auto_size and self._run_queued_batches():
            pass
        with self._lock:
            self._all_waiters += 1
            self._wake_deferred()
            try:
                while self._pending:
                    if self._broken is not None:
                        raise self._worker_error()
                    self._cond.wait()
            finally:
                self._all_waiters -= 1

    def _sync_var(self, var: Var) -> None:
        if self.has_gpu and var._wev is not None:
            var._wev.synchronize()

    # ----------------------------------------------------------------- lifetime
    def _shutdown(self) -> None:
        try:
            self._wait_all()
        except EngineWorkerError:
            pass  # raised below, once the other workers are stopped: what they hold may still run
        with self._lock:
            workers = list(self._workers.values())
            for w in workers:
                w.stop()
        try:
            join_all(w.thread for w in workers)
        except BaseException:
            if self._broken is None:
                raise
            # the dead worker's error, the cause of the one raised here (any other was reported as it died)
        if self._broken is not None:
            raise self._worker_error()

    def _abandon(self) -> None:
        # Garbage-collected unclosed, possibly in a thread that holds the lock: never block here.
        # Workers that miss this signal see their engine gone at their next idle check.
        if not self._lock.acquire(blocking=False):
            return
        try:
            for w in self._workers.values():
                w.stop()
        finally:
            self._lock.release()


_SMALL_WORK = (run_auto, run_rec)  # automatic batches and single elementwise array operations


def _tiny(rec: tuple) -> bool:
    """Are a record's array inputs all computed and at most ``TINY_NUMEL`` elements each?"""
    for item in rec[2:-1]:
        if type(item) is int or type(item) is float:
            continue
        data = getattr(item, "_data", None)
        if data is None or data.numel() > TINY_NUMEL:  # None: not computed yet, size unknown
            return False
    return True


def _joins(reads: tuple, op: Op | None, worker: Worker) -> bool:
    """May a record reading ``reads`` join the batch ``op`` for ``worker``? (lock held)

    Only if each input is ready, made in the batch, or made by an operation already queued or
    running on the same worker, which runs before the batch anyway.
    """
    for v in reads:
        if v._bulk_write is not None or v._queue:
            return False
        last = v._last_write
        if last is None or last is op or last.state == DONE:
            continue
        if last.worker is not worker or not (last.state == QUEUED or last.state == RUNNING):
            return False
    return True


register_engine("threaded", ThreadedEngine)

"""Workers run through the narrow WorkerHost interface: no engine needed, and no import of one."""

from __future__ import annotations

import ast
import gc
import threading
import time
from pathlib import Path

import pytest
import torch

from dlperf.devices import cpu
from dlperf.engine import create_engine
from dlperf.engine.threaded import ThreadedEngine
from dlperf.engine.var import QUEUED, Op
from dlperf.engine.worker import CpuWorker, WorkerHost

ENGINE_DIR = Path(__file__).resolve().parents[1] / "src" / "dlperf" / "engine"


class RecordingHost:
    """A WorkerHost that is no engine: it runs what it is given and records every call."""

    def __init__(self, expected: int) -> None:
        self.lock = threading.Lock()
        self.open_auto: list = []
        self.batch_latency_s = 0.0
        self.cpu_threads: int | None = 1
        self.cpu_workers = 1
        self.blind_waiters = 0
        self.has_gpu = False
        self.host_threads = torch.get_num_threads()
        self.where: list[str] = []
        self.completed: list[Op] = []
        self.started_in: threading.Thread | None = None
        self.expected = expected
        self.all_done = threading.Event()

    def execute(self, op: Op, where: str) -> None:
        op.result = op.fn(*op.args)
        self.where.append(where)

    def complete(self, ops: list[Op]) -> None:
        with self.lock:
            self.completed += ops
            if len(self.completed) >= self.expected:
                self.all_done.set()

    def fail(self, op: Op, exc: BaseException) -> None:
        op.exc = exc

    def send_auto_for(self, worker: object) -> int:
        return 0

    def worker_started(self, worker: object) -> None:
        self.started_in = threading.current_thread()

    def worker_died(self, worker: object, exc: BaseException) -> None:
        self.died = exc


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside functions (relative ones as ``.name``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_workers_import_neither_the_engine_nor_the_threaded_engine():
    for module in ("worker.py", "cuda.py", "batches.py"):
        imported = _imports(ENGINE_DIR / module)
        for higher in (".engine", ".threaded", "dlperf.engine.engine", "dlperf.engine.threaded"):
            assert higher not in imported, f"{module} imports {higher}"


def test_the_threaded_engine_is_a_worker_host():
    host: WorkerHost = ThreadedEngine()  # checked by mypy too
    try:
        for name in ("lock", "open_auto", "batch_latency_s", "cpu_threads", "cpu_workers", "blind_waiters",
                     "has_gpu", "host_threads", "execute", "complete", "fail", "send_auto_for", "worker_started",
                     "worker_died"):
            assert hasattr(host, name), name
    finally:
        host.close()  # type: ignore[attr-defined]


def test_a_cpu_worker_runs_and_releases_ops_through_its_host_alone():
    host = RecordingHost(expected=20)
    worker = CpuWorker(host, cpu(0), "compute")
    worker.start()
    box: list[int] = []
    ops = [Op(None, box.append, (i,), (), (), worker, 0, None) for i in range(20)]
    with host.lock:
        for op in ops:
            op.state = QUEUED
            worker.enqueue(op)
    assert host.all_done.wait(10)
    assert box == list(range(20))  # one worker: push order
    assert host.completed == ops and set(host.where) == {"cpu(0)/compute"}
    assert host.started_in is worker.thread
    with host.lock:
        worker.stop()
    worker.thread.join(10)
    assert not worker.thread.is_alive()
    assert worker.threads == 1  # the host's budget, applied in the worker's own thread
    assert torch.get_num_threads() == host.host_threads  # the caller's count untouched


def test_a_worker_whose_host_is_gone_ends_on_its_own():
    host = RecordingHost(expected=1)
    worker = CpuWorker(host, cpu(0), "compute")
    worker.start()
    del host
    gc.collect()
    deadline = time.monotonic() + 10  # idle workers look at their host about once a second
    while worker.thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not worker.thread.is_alive()


def test_an_engine_dropped_unclosed_still_ends_its_workers():
    before = set(threading.enumerate())
    eng = create_engine("threaded")
    assert eng.push(lambda: 5).wait() == 5
    threads = [t for t in set(threading.enumerate()) - before if t.name.startswith("dlperf-engine-")]
    assert threads
    del eng
    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.timeout(60)
def test_close_reports_both_an_operations_error_and_a_worker_that_failed_to_end(monkeypatch, capsys):
    from dlperf.engine import worker as worker_module

    def fails_to_end(self):
        raise RuntimeError("the worker failed to end")

    reports: list = []
    monkeypatch.setattr(worker_module.Worker, "teardown", fails_to_end)
    monkeypatch.setattr(threading, "excepthook", reports.append)
    eng = create_engine("threaded")
    eng.push(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError) as info:  # the operation's error is not dropped for the worker's
        eng.close()
    assert isinstance(info.value.__context__, RuntimeError) and "failed to end" in str(info.value.__context__)
    assert [str(r.exc_value) for r in reports] == ["the worker failed to end"]  # reported as the thread died
    eng.close()  # closed: nothing more

    with pytest.raises(KeyError, match="mine"), create_engine("threaded") as eng:
        eng.push(lambda: None).wait()
        raise KeyError("mine")  # what leaves the block wins over the worker's error
    assert "an engine worker failed too (RuntimeError: the worker failed to end)" in capsys.readouterr().err


def test_a_worker_whose_loop_fails_tells_its_host_and_its_join_raises(monkeypatch):
    reports: list = []
    monkeypatch.setattr(threading, "excepthook", reports.append)
    host = RecordingHost(expected=1)
    worker = CpuWorker(host, cpu(0), "compute")

    def broken_loop():
        raise RuntimeError("loop broke")

    monkeypatch.setattr(worker, "_loop", broken_loop)
    worker.start()
    with pytest.raises(RuntimeError, match="loop broke"):
        worker.thread.join(10)
    assert str(host.died) == "loop broke" and [str(r.exc_value) for r in reports] == ["loop broke"]


def test_a_worker_failing_after_its_stop_leaves_its_host_alone(monkeypatch):
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    host = RecordingHost(expected=1)
    worker = CpuWorker(host, cpu(0), "compute")
    monkeypatch.setattr(worker, "teardown", lambda: 1 / 0)  # it ran dry and was stopped: nothing is lost
    worker.start()
    with host.lock:
        worker.stop()
    with pytest.raises(ZeroDivisionError):
        worker.thread.join(10)
    assert not hasattr(host, "died")


class _RacingWake:
    """The worker's wake lock, with a wake-up landing just after its first timed-out sleep (as a push on another
    thread can, between the timeout and the worker taking the engine lock again); every later sleep checks that
    the lock it waits on is held, which a release left over from that race would break."""

    def __init__(self, worker, host_lock) -> None:
        self.real, self.worker, self.host_lock = worker._wake, worker, host_lock
        self.raced = threading.Event()
        self.unheld_sleeps = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if timeout is not None and timeout >= 0 and blocking:
            if not self.real.locked():
                self.unheld_sleeps += 1
            got = self.real.acquire(timeout=timeout)
            if not got and not self.raced.is_set():
                with self.host_lock:
                    self.worker.wake()  # what enqueue does: _sleeping = False, then release
                self.raced.set()
            return got
        return self.real.acquire(blocking)

    def release(self) -> None:
        self.real.release()

    def locked(self) -> bool:
        return self.real.locked()


def test_a_wake_up_that_races_a_timed_out_sleep_is_not_left_over():
    with create_engine("threaded") as eng:
        x = torch.ones(2)
        eng.push(lambda: None, device=cpu(0), name="warm")
        eng.waitall()
        worker = eng._worker(cpu(0), "compute")
        racing = _RacingWake(worker, eng._lock)
        with eng._lock:
            worker._wake = racing
        deadline = time.monotonic() + 10
        while not racing.raced.is_set() and time.monotonic() < deadline:
            eng.push(lambda: None, device=cpu(0), name="tick")
            time.sleep(0.002)  # lets the worker run dry and time out (its nap is short after running dry)
        assert racing.raced.is_set(), "the worker never timed out asleep"
        for _ in range(50):  # sleeps and wake-ups after the race
            eng.push(lambda: x.add_(1), device=cpu(0), name="add")
            time.sleep(0.001)
        eng.waitall()
        assert racing.unheld_sleeps == 0
        assert x.tolist() == [51.0, 51.0]

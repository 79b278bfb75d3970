"""One way to make a thread (dlperf._threads.ServiceThread, offered by the engine): nothing else in src/dlperf
constructs one, what a thread raises reaches whoever joins it, and each owner leaves no thread after close.

The scan parses every module with :mod:`ast`, as tests/test_layers.py does for imports, so a thread made
inside a function or through ``from threading import Thread`` counts as much as one at the top of a file.
"""

from __future__ import annotations

import ast
import gc
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from dlperf import engine
from dlperf._threads import ServiceThread, join_all, on_fresh_thread
from dlperf.parallel.launchers.watchdog import Watchdog

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "dlperf"
OWNER = PACKAGE / "_threads.py"  # the one module that may construct a thread

# what starts a thread: threading's classes, the low-level module, and pools of threads
_MAKERS = {("threading", "Thread"), ("threading", "Timer"), ("_thread", "start_new_thread"),
           ("_thread", "start_new"), ("concurrent.futures", "ThreadPoolExecutor"),
           ("concurrent.futures.thread", "ThreadPoolExecutor"), ("multiprocessing.pool", "ThreadPool")}


def _maker_spellings(tree: ast.AST) -> set[str]:
    """How ``tree`` can spell a thread maker: ``threading.Thread``, through an alias (``import threading as
    th``: ``th.Thread``) or a name imported bare (``from threading import Thread as T``: ``T``)."""
    spellings = {f"{module}.{name}" for module, name in _MAKERS}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            spellings |= {a.asname or a.name for a in node.names if (node.module, a.name) in _MAKERS}
        elif isinstance(node, ast.Import):
            spellings |= {f"{a.asname}.{name}" for a in node.names if a.asname
                          for module, name in _MAKERS if module == a.name}
    return spellings


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def thread_makers(source: str, rel: str) -> list[str]:
    """``rel:line: what`` for every call or subclass of a thread maker in ``source``."""
    tree = ast.parse(source, filename=rel)
    makers = _maker_spellings(tree)

    def is_maker(node: ast.expr) -> bool:
        return _dotted(node) in makers

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and is_maker(node.func):
            found.append(f"{rel}:{node.lineno}: {_dotted(node.func)}(...)")
        elif isinstance(node, ast.ClassDef):
            found += [f"{rel}:{node.lineno}: class {node.name}({_dotted(b)})" for b in node.bases if is_maker(b)]
    return found


def test_only_the_owner_of_the_mechanism_makes_threads():
    others = [found for path in sorted(PACKAGE.rglob("*.py")) if path != OWNER
              for found in thread_makers(path.read_text(), str(path.relative_to(SRC)))]
    assert not others, ("threads made outside dlperf._threads; run them on a ServiceThread "
                        "(dlperf.engine.ServiceThread):\n" + "\n".join(others))
    assert thread_makers(OWNER.read_text(), "_threads.py"), "the scan no longer sees the mechanism itself"


def test_the_scan_sees_every_way_to_make_a_thread():
    source = ("import threading\nimport threading as th\nfrom threading import Thread as T\n"
              "from concurrent.futures import ThreadPoolExecutor\n"
              "def f():\n    threading.Thread(target=f).start()\n    th.Timer(1, f)\n    T(target=f)\n"
              "    ThreadPoolExecutor(2)\nclass W(threading.Thread):\n    pass\n"
              "threading.Event()\nthreading.current_thread()\n")
    assert sorted(line.split(": ", 1)[1] for line in thread_makers(source, "x.py")) == sorted([
        "class W(threading.Thread)", "threading.Thread(...)", "th.Timer(...)", "T(...)", "ThreadPoolExecutor(...)"])


def test_the_engine_offers_the_one_mechanism():
    assert engine.ServiceThread is ServiceThread
    assert "ServiceThread" in engine.__all__


# -- the mechanism -------------------------------------------------------------------------------------------
def test_a_targets_exception_is_raised_by_join_once_with_its_traceback(reports):
    def fails(x):
        raise ValueError(f"bad {x}")

    t = ServiceThread(fails, 3, name="dlperf-test-fails")
    assert t.daemon and t.name == "dlperf-test-fails"
    t.start()
    with pytest.raises(ValueError, match="bad 3") as info:
        t.join(10)
    assert any(entry.name == "fails" for entry in info.traceback)  # raised where it happened, not re-made
    assert isinstance(t.error, ValueError) and not t.is_alive()
    t.join(10)  # raised once: a second join (a close called twice) returns


def _failing_once_released(error: BaseException, name: str) -> tuple[threading.Event, ServiceThread]:
    """A started thread that raises ``error`` once the event returned with it is set (or after 10 s)."""
    release = threading.Event()

    def waits_then_fails():
        release.wait(10)
        raise error

    t = ServiceThread(waits_then_fails, name=name)
    t.start()
    return release, t


def test_a_thread_still_running_after_the_timeout_raises_nothing_yet(reports):
    release, t = _failing_once_released(RuntimeError("late"), "dlperf-test-late")
    t.join(0.01)
    assert t.is_alive()
    release.set()
    with pytest.raises(RuntimeError, match="late"):
        t.join(10)


def test_the_result_and_the_thread_it_ran_on(reports):
    seen = []
    t = ServiceThread(lambda a, b: seen.append(threading.current_thread()) or a + b, 2, 3, name="dlperf-test-add")
    t.start()
    t.join(10)
    assert t.result == 5 and seen == [t] and t.error is None
    assert on_fresh_thread(lambda: threading.current_thread().name, name="dlperf-test-name") == "dlperf-test-name"
    with pytest.raises(ZeroDivisionError):
        on_fresh_thread(lambda: 1 / 0, name="dlperf-test-zero")


@pytest.fixture
def reports(monkeypatch):
    """What reaches threading.excepthook (a thread's death), instead of printed."""
    seen: list = []
    monkeypatch.setattr(threading, "excepthook", seen.append)
    return seen


def test_an_error_is_reported_once_as_the_thread_dies_and_still_raised_by_join(reports):
    release, t = _failing_once_released(ValueError("the loop died"), "dlperf-test-dies")
    assert not reports
    release.set()
    deadline = time.monotonic() + 10
    while t.is_alive() and time.monotonic() < deadline:  # nobody joins yet: the owner would run on unaware
        time.sleep(0.01)
    assert [(r.exc_type, str(r.exc_value), r.thread) for r in reports] == [(ValueError, "the loop died", t)]
    with pytest.raises(ValueError, match="the loop died"):
        t.join(10)
    del t
    gc.collect()
    assert len(reports) == 1  # one report: neither the join nor the collection repeats it

    t = ServiceThread(lambda: 1 / 0, name="dlperf-test-unjoined")
    t.start()
    while t.is_alive():
        time.sleep(0.01)
    del t
    gc.collect()
    assert [(r.exc_type, r.thread.name) for r in reports[1:]] == [(ZeroDivisionError, "dlperf-test-unjoined")]


def test_a_name_without_the_prefix_is_refused():
    with pytest.raises(ValueError, match="'reader'.*'dlperf-reader'"):
        ServiceThread(print, name="reader")


def test_join_all_waits_for_every_thread_then_raises_the_first_error(reports):
    def slow() -> str:
        time.sleep(0.2)
        return "done"

    t1 = ServiceThread(lambda: 1 / 0, name="dlperf-test-first")
    t2 = ServiceThread(slow, name="dlperf-test-second")
    t1.start()
    t2.start()
    with pytest.raises(ZeroDivisionError):
        join_all([t1, t2], 10)
    assert not t2.is_alive() and t2.result == "done"  # waited for, although the first had failed


# -- every owner leaves no thread after close -----------------------------------------------------------------
def _new_threads(before: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t not in before and t.is_alive())


@pytest.mark.timeout(60)
def test_engine_workers_are_gone_after_close():
    before = set(threading.enumerate())
    with engine.create_engine("threaded") as eng:
        x = engine.array.ones((2, 2), engine=eng)
        assert (x + x).tolist() == [[2.0, 2.0], [2.0, 2.0]]
        assert _new_threads(before) and all(n.startswith("dlperf-engine-") for n in _new_threads(before))
    assert not _new_threads(before)


@pytest.mark.timeout(60)
def test_the_loader_leaves_no_thread_whether_read_to_the_end_or_stopped_early():
    from dlperf.data.loader import ArrayLoader

    X, y = torch.randint(0, 255, (10, 4, 4), dtype=torch.uint8), torch.arange(10)
    loader = ArrayLoader(X, y, batch_size=3, shuffle=False, prefetch=1)
    before = set(threading.enumerate())
    assert torch.equal(torch.cat([yb for _, yb in loader.epoch_batches(0)]), y)
    assert not _new_threads(before)
    it = loader.epoch_batches(1)
    next(it)
    assert _new_threads(before) == ["dlperf-loader"]
    it.close()
    assert not _new_threads(before)


@pytest.mark.timeout(60)
def test_the_loaders_failure_reaches_the_consumer_and_leaves_no_thread(monkeypatch):
    from dlperf.data import loader as loader_module

    def no_budget(n, default):
        raise RuntimeError("no budget")

    monkeypatch.setattr(loader_module, "set_thread_budget", no_budget)
    before = set(threading.enumerate())
    loader = loader_module.ArrayLoader(torch.zeros(4, 2, 2), torch.arange(4), batch_size=2)
    with pytest.raises(RuntimeError, match="no budget"):  # raised to the consumer, not lost with a hang
        list(loader)
    assert not _new_threads(before)


@pytest.mark.timeout(60)
def test_kvstore_control_threads_are_gone_after_close():
    from dlperf.kvstore.control import ControlClient, ControlServer

    before = set(threading.enumerate())
    server = ControlServer(lambda src, op, meta, reply: reply.set_result((0, {"echo": meta}, [])), {0}, "kvstore test")
    client = ControlClient(server.name, server.token, 0, 1, timeout_s=10, server_pid=os.getpid())
    try:
        assert client.request(1, {"k": 1}, "a push")() == (0, {"echo": {"k": 1}})
        names = _new_threads(before)
        assert names == ["dlperf-kvstore test control accept", "dlperf-kvstore test control connection"], names
    finally:
        client.close()
        server.close()
    assert server.thread_count() == 0 and not _new_threads(before)


@pytest.mark.timeout(60)
def test_a_kvstore_control_thread_that_failed_is_raised_by_close(reports):
    from dlperf.kvstore.control import ControlServer

    server = ControlServer(lambda *a: None, {0}, "kvstore test")
    failed = threading.Event()

    def fails():
        failed.set()
        raise SystemExit("a handler left the thread")  # past the connection's own `except Exception`

    server._spawn(fails, "dlperf-kvstore test failing")
    assert failed.wait(10)
    server._spawn(lambda: None, "dlperf-kvstore test later")  # prunes finished threads: not the failed one
    with pytest.raises(SystemExit, match="a handler left"):
        server.close()
    assert server.thread_count() == 0


@pytest.mark.timeout(60)
def test_the_launch_watchdog_is_gone_after_stop_and_its_failure_is_raised(tmp_path, monkeypatch, reports):

    before = set(threading.enumerate())
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    watchdog = Watchdog(str(tmp_path), 1, 60.0, None)
    watchdog.start()
    assert _new_threads(before) == ["dlperf-launch-watchdog"]
    watchdog.stop()
    watchdog.stop()  # twice, as an interrupted launch does
    assert not _new_threads(before) and signal.set_wakeup_fd(wakeup) == wakeup

    def broken(self):
        raise OSError("the markers went away")

    monkeypatch.setattr(Watchdog, "_run", broken)
    watchdog = Watchdog(str(tmp_path), 1, 60.0, None)
    watchdog.start()
    with pytest.raises(OSError, match="markers went away"):
        watchdog.stop()
    assert not _new_threads(before) and signal.set_wakeup_fd(wakeup) == wakeup  # the watch on signals is back


def _stderr_target() -> tuple[int, int]:
    st = os.fstat(2)
    return st.st_dev, st.st_ino


@pytest.mark.timeout(60)
def test_the_stderr_filter_is_gone_after_stop_and_its_failure_is_raised(tmp_path, monkeypatch, reports):
    from dlperf.parallel.launchers import parent

    before, fd2 = set(threading.enumerate()), _stderr_target()
    filt = parent._StderrFilter(tmp_path / "torch.log")
    filt.start()
    assert _new_threads(before) == ["dlperf-launch-stderr"]
    os.write(2, b"[W1125 19:11:23.767 TCPStore.cpp:340] a line of torch's\n")
    filt.stop()
    assert not _new_threads(before) and _stderr_target() == fd2
    assert "TCPStore.cpp" in (tmp_path / "torch.log").read_text()

    def broken(self, read_end):
        raise OSError("the log's disk is full")

    monkeypatch.setattr(parent._StderrFilter, "_filter", broken)
    filt = parent._StderrFilter(tmp_path / "torch.log")
    filt.start()
    with pytest.raises(OSError, match="disk is full"):
        filt.stop()
    assert not _new_threads(before) and _stderr_target() == fd2

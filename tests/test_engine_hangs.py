"""Waits that could never return raise a clear error instead of hanging; bulk writes are never read stale.

Every test has a timeout: a regression shows up as a failure, not a stuck suite.
"""

from __future__ import annotations

import threading
import time

import pytest

from dlperf.devices import cpu
from dlperf.engine import EngineDeadlockError, EngineUsageError, create_engine
from dlperf.errors import DlperfError, UsageError

KINDS = ["threaded", "naive"]
PROMPT_S = 2.0  # detection is immediate or within one re-check (0.1 s); slack for a loaded machine


def _workers_stopped(eng) -> bool:
    return all(not w.thread.is_alive() for w in getattr(eng, "_workers", {}).values())


def _still_works(eng) -> None:
    v = eng.new_var("after")
    box = []
    eng.push(box.append, args=(1,), writes=[v], device=cpu(0))
    eng.push(box.append, args=(2,), reads=[v], device=cpu(1))
    eng.waitall()
    assert box == [1, 2]


def test_errors_are_usage_errors_of_the_project():
    assert issubclass(EngineDeadlockError, EngineUsageError)
    assert issubclass(EngineUsageError, UsageError) and issubclass(EngineUsageError, DlperfError)


# ------------------------------------------------------------------------------------------ 1: waitall inside an op
@pytest.mark.timeout(20)
def test_waitall_inside_a_pushed_function_raises_on_the_threaded_engine():
    with create_engine("threaded") as eng:
        op = eng.push(lambda: eng.waitall(), name="stepper", device=cpu(1))
        t0 = time.monotonic()
        with pytest.raises(EngineDeadlockError, match=r"waitall\(\).*'stepper' \(cpu\(1\)/compute\)"):
            op.wait()
        assert time.monotonic() - t0 < PROMPT_S
        _still_works(eng)
    assert _workers_stopped(eng)


@pytest.mark.timeout(20)
def test_waitall_inside_a_pushed_function_returns_on_the_naive_engine():
    with create_engine("naive") as eng:
        box = []
        eng.push(box.append, args=(1,))
        assert eng.push(lambda: (eng.waitall(), box[:])[1]).wait() == [1]
        _still_works(eng)


# ------------------------------------------------------------------------------------------ 2: close inside an op
@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
def test_close_inside_a_pushed_function_raises_and_leaves_the_engine_open(kind):
    eng = create_engine(kind)
    op = eng.push(eng.close, name="closer")
    with pytest.raises(EngineUsageError, match=r"close\(\).*'closer'"):
        op.wait()
    assert not eng.closed
    _still_works(eng)
    eng.close()  # the error was reported by op.wait(): closing raises nothing
    assert eng.closed
    assert _workers_stopped(eng)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
def test_close_inside_a_pushed_function_nobody_waited_for_is_raised_by_close(kind):
    with pytest.raises(EngineUsageError, match=r"close\(\)"):
        with create_engine(kind) as eng:
            eng.push(lambda: eng.close())
    assert eng.closed
    assert _workers_stopped(eng)


# ------------------------------------------------------------------------------------------ 3: waits forming a cycle
def _deadlock(eng, a_waits, b_waits):
    """Ops 'A' on cpu(0) (writes va) and 'B' on cpu(1) (writes vb), each waiting once both run."""
    va, vb = eng.new_var("va"), eng.new_var("vb")
    both_running = threading.Barrier(2, timeout=10)
    ops = {}
    filled = threading.Event()  # the ops may run before push() returns their handles

    def body(wait):
        both_running.wait()
        filled.wait(10)
        wait(ops)

    ops["A"] = eng.push(body, args=(a_waits,), writes=[va], device=cpu(0), name="A")
    ops["B"] = eng.push(body, args=(b_waits,), writes=[vb], device=cpu(1), name="B")
    ops["va"], ops["vb"] = va, vb
    filled.set()
    return ops


@pytest.mark.timeout(20)
@pytest.mark.parametrize("how", ["vars", "ops", "var_and_op"])
def test_two_ops_on_two_workers_waiting_for_each_other_raise(how):
    with create_engine("threaded") as eng:
        if how == "vars":
            a = lambda o: eng.wait_to_read(o["vb"])  # noqa: E731
            b = lambda o: eng.wait_to_read(o["va"])  # noqa: E731
        elif how == "ops":
            a = lambda o: o["B"].wait()  # noqa: E731
            b = lambda o: o["A"].wait()  # noqa: E731
        else:
            a = lambda o: eng.wait_to_read(o["vb"])  # noqa: E731
            b = lambda o: o["A"].wait()  # noqa: E731
        t0 = time.monotonic()
        ops = _deadlock(eng, a, b)
        with pytest.raises(EngineDeadlockError) as info:
            eng.waitall()
        assert time.monotonic() - t0 < PROMPT_S
        msg = str(info.value)
        assert "deadlock" in msg
        assert "'A' (cpu(0)/compute)" in msg and "'B' (cpu(1)/compute)" in msg
        if how == "vars":
            assert "var 'va'" in msg or "var 'vb'" in msg
        # The first waiter gets the error through the failed write of the op it waited for.
        for name in ("A", "B"):
            with pytest.raises(EngineDeadlockError):
                ops[name].wait()
        _still_works(eng)
    assert _workers_stopped(eng)


@pytest.mark.timeout(20)
def test_a_cycle_through_an_op_queued_behind_a_waiting_one_is_found():
    # A (cpu0) waits for vb; vb's writer B is queued on cpu1 behind C, and C waits for va (A's).
    with create_engine("threaded") as eng:
        va, vb = eng.new_var("va"), eng.new_var("vb")
        both_running = threading.Barrier(2, timeout=10)
        pushed = threading.Event()  # else A could read vb before B, its writer, is pushed: no cycle

        def a():
            both_running.wait()
            pushed.wait(10)
            eng.wait_to_read(vb)

        def c():
            both_running.wait()
            eng.wait_to_read(va)

        t0 = time.monotonic()
        eng.push(a, writes=[va], device=cpu(0), name="A")
        eng.push(c, device=cpu(1), name="C")
        eng.push(lambda: None, writes=[vb], device=cpu(1), name="B")
        pushed.set()
        with pytest.raises(EngineDeadlockError) as info:
            eng.waitall()
        assert time.monotonic() - t0 < PROMPT_S
        msg = str(info.value)
        assert "'B' (cpu(1)/compute) is queued on cpu(1)/compute behind op 'C'" in msg
        assert "'A' (cpu(0)/compute)" in msg
        _still_works(eng)


@pytest.mark.timeout(20)
def test_waiting_for_an_op_ordered_after_our_own_on_a_variable_raises():
    # B (cpu1) reads va after A writes it, so B cannot start before A ends; A waits for B.
    with create_engine("threaded") as eng:
        va = eng.new_var("va")
        ops = {}
        ready = threading.Event()

        def a():
            ready.wait(10)
            return ops["B"].wait()

        ops["A"] = eng.push(a, writes=[va], device=cpu(0), name="A")
        ops["B"] = eng.push(lambda: 1, reads=[va], device=cpu(1), name="B")
        ready.set()
        with pytest.raises(EngineDeadlockError, match=r"'B' \(cpu\(1\)/compute\) needs var 'va' after op 'A'"):
            ops["A"].wait()
        _still_works(eng)


@pytest.mark.timeout(20)
def test_waiting_for_a_pending_op_that_must_run_on_our_own_worker_raises():
    # P waits for var g (held a while by an op on cpu1), then must run on cpu0, whose thread waits for P.
    with create_engine("threaded") as eng:
        g = eng.new_var("g")
        eng.push(time.sleep, args=(0.3,), writes=[g], device=cpu(1))
        started = threading.Event()

        def a():
            started.set()
            return eng.push(lambda: 1, reads=[g], device=cpu(0), name="P").wait()

        op = eng.push(a, device=cpu(0), name="A")
        started.wait(10)  # cpu(0)'s worker runs A (a wait on a queued op could run it in this thread)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadlockError, match=r"'P' \(cpu\(0\)/compute\) must run on cpu\(0\)/compute"):
            op.wait()
        assert time.monotonic() - t0 < PROMPT_S
        _still_works(eng)


@pytest.mark.timeout(20)
def test_waits_inside_ops_without_a_cycle_finish():
    # A (cpu2) waits for B (cpu1), which waits for C (cpu0): a chain, not a cycle.
    with create_engine("threaded") as eng:
        vb, vc = eng.new_var("vb"), eng.new_var("vc")
        eng.push(time.sleep, args=(0.2,), writes=[vc], device=cpu(0), name="C")
        eng.push(lambda: eng.wait_to_read(vc), writes=[vb], device=cpu(1), name="B")
        op = eng.push(lambda: (eng.wait_to_read(vb), 5)[1], device=cpu(2), name="A")
        assert op.wait() == 5
        eng.waitall()


@pytest.mark.timeout(20)
def test_a_thread_running_a_waited_op_inline_joins_the_cycle():
    # The main thread's wait may run B itself (cpu1 idle); either way B and A wait for each other.
    with create_engine("threaded") as eng:
        va, vb = eng.new_var("va"), eng.new_var("vb")
        a_waiting, pushed = threading.Event(), threading.Event()
        ops = {}

        def a():
            pushed.wait(10)
            a_waiting.set()
            return ops["B"].wait()

        def b():
            a_waiting.wait(10)
            eng.wait_to_read(va)

        ops["A"] = eng.push(a, writes=[va], device=cpu(0), name="A")
        ops["B"] = eng.push(b, writes=[vb], device=cpu(1), name="B")
        pushed.set()
        with pytest.raises(EngineDeadlockError) as info:
            ops["B"].wait()
        assert "'A' (cpu(0)/compute)" in str(info.value) and "'B' (cpu(1)/compute)" in str(info.value)
        with pytest.raises(EngineDeadlockError):
            ops["A"].wait()
        _still_works(eng)


@pytest.mark.timeout(20)
def test_wait_to_write_inside_an_op_holding_the_variable_raises():
    with create_engine("threaded") as eng:
        v = eng.new_var("v")
        started = threading.Event()

        def a():
            started.set()
            eng.wait_to_write(v)

        op = eng.push(a, reads=[v], device=cpu(0), name="A")
        started.wait(10)
        with pytest.raises(EngineDeadlockError, match=r"'wait_to_write' .* needs var 'v' after op 'A'"):
            op.wait()
        _still_works(eng)


@pytest.mark.timeout(20)
def test_an_op_waiting_for_an_earlier_op_of_its_own_batch_finishes():
    # X and C run back to back in one batch of cpu(0)'s worker; X has finished when C waits for
    # it, but the batch releases finished ops in groups: the wait must release X, not hang or raise.
    with create_engine("threaded") as eng:
        v = eng.new_var("v")
        gate, box = threading.Event(), []
        eng.push(gate.wait, args=(10,), device=cpu(0))
        time.sleep(0.05)  # the worker is inside the gate; X and C queue up behind it
        eng.push(box.append, args=("x",), writes=[v], device=cpu(0), name="X")
        c = eng.push(lambda: (eng.wait_to_read(v), box[:])[1], device=cpu(0), name="C")
        gate.set()
        deadline = time.monotonic() + 10
        while not c.done and time.monotonic() < deadline:  # no wait here: it would release X early
            time.sleep(0.01)
        assert c.wait() == ["x"]


# ------------------------------------------------------------------------------------------ 4: bulk writes
@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("wait", ["wait_to_read", "op_wait"])
def test_a_reader_in_another_thread_waits_for_a_write_held_in_an_open_bulk(kind, wait):
    with create_engine(kind) as eng:
        v = eng.new_var("v")
        box = {"v": "old"}
        held = threading.Event()
        seen = {}

        def reader(op):
            held.wait(10)
            if wait == "wait_to_read":
                eng.wait_to_read(v)
            else:
                op.wait()
            seen["value"], seen["t"] = box["v"], time.monotonic()

        with eng.bulk(16):
            op = eng.push(box.__setitem__, args=("v", "new"), writes=[v])
            t = threading.Thread(target=reader, args=(op,))
            t.start()
            held.set()
            time.sleep(0.2)  # the reader is waiting now; a stale read would have returned already
            flushed = time.monotonic()
        t.join(10)
        assert seen["value"] == "new"
        assert seen["t"] >= flushed


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
def test_waiting_on_a_write_in_the_own_open_bulk_sends_the_batch(kind):
    with create_engine(kind) as eng:
        v, box = eng.new_var("v"), []
        with eng.bulk(16):
            op = eng.push(box.append, args=(1,), writes=[v])
            eng.wait_to_read(v)
            assert box == [1]
            assert op.wait() is None


@pytest.mark.timeout(20)
def test_a_bulk_batch_sent_into_a_cycle_with_a_waiting_op_is_reported():
    # R (cpu1) writes u, then waits to read v; v's write W sits in the main thread's open bulk and
    # reads u. When the block ends, W is queued behind R on u: R's wait could never return.
    with create_engine("threaded") as eng:
        u, v = eng.new_var("u"), eng.new_var("v")
        w_held = threading.Event()

        def r():
            w_held.wait(10)
            eng.wait_to_read(v)

        op = eng.push(r, writes=[u], device=cpu(1), name="R")
        with eng.bulk(16):
            eng.push(lambda: None, reads=[u], writes=[v], device=cpu(0), name="W")
            w_held.set()
            time.sleep(0.1)  # R now waits for W, still held here
        t0 = time.monotonic()
        with pytest.raises(EngineDeadlockError, match=r"'R' \(cpu\(1\)/compute\).*var 'u'"):
            op.wait()
        assert time.monotonic() - t0 < PROMPT_S
        _still_works(eng)


# ------------------------------------------------------------------------------------------ 5: the naive engine
@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
def test_an_op_waiting_to_read_its_own_write_raises(kind):
    with create_engine(kind) as eng:
        v = eng.new_var("v")
        op = eng.push(lambda: eng.wait_to_read(v), writes=[v], name="self-waiter")
        with pytest.raises(EngineDeadlockError, match="'self-waiter'.*waits for var 'v', written by op 'self-waiter'"):
            op.wait()
        _still_works(eng)


@pytest.mark.timeout(20)
def test_naive_ops_in_two_threads_waiting_for_each_other_raise():
    with create_engine("naive") as eng:
        va, vb = eng.new_var("va"), eng.new_var("vb")
        both_running = threading.Barrier(2, timeout=10)
        errors = []

        def body(wait_var):
            both_running.wait()
            eng.wait_to_read(wait_var)

        def pusher(name, writes, wait_var):
            try:
                eng.push(body, args=(wait_var,), writes=[writes], name=name).wait()
            except EngineDeadlockError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=pusher, args=("A", va, vb)),
                   threading.Thread(target=pusher, args=("B", vb, va))]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert time.monotonic() - t0 < PROMPT_S
        assert len(errors) == 2 and errors[0] is errors[1]  # one detects; the other fails through its var
        assert "'A' (cpu(0))" in str(errors[0]) and "'B' (cpu(0))" in str(errors[0])
        _still_works(eng)


# ------------------------------------------------------------------------------------------ no false alarms
@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(4))
def test_waits_on_earlier_pushes_never_raise(seed):
    # Ops without shared variables are ready when pushed, so each worker runs them in push order;
    # an op that only waits for earlier pushes can never be part of a cycle. The detector must agree.
    import random

    rng = random.Random(seed)
    with create_engine("threaded") as eng:
        ops, vars_, expected = [], [], []
        for i in range(80):
            v = eng.new_var(f"v{i}")
            j = rng.randrange(i) if i and rng.random() < 0.7 else None
            how = rng.choice(["op", "var"])
            nap = 0.002 if rng.random() < 0.6 else 0.0  # so that many waits really block

            def body(i=i, j=j, how=how, nap=nap):
                time.sleep(nap)
                if j is not None:
                    if how == "op":
                        ops[j].wait()
                    else:
                        eng.wait_to_read(vars_[j])
                return i

            ops.append(eng.push(body, writes=[v], device=cpu(rng.randrange(3)), name=f"op{i}"))
            vars_.append(v)
            expected.append(i)
            if rng.random() < 0.1:
                ops[rng.randrange(len(ops))].wait()  # the main thread may run queued ops itself
        eng.waitall()
        assert [op.wait() for op in ops] == expected


def _random_program(eng, rng, n_ops=30, n_vars=6, n_devices=3):
    """Ops on shared variables, some waiting inside for a random earlier op: some programs deadlock."""
    vs = [eng.new_var(f"s{k}") for k in range(n_vars)]
    ops = []
    for i in range(n_ops):
        reads = rng.sample(vs, rng.randrange(2))
        writes = [v for v in rng.sample(vs, rng.randrange(2)) if v not in reads]
        j = rng.randrange(i) if i and rng.random() < 0.25 else None
        nap = 0.002 if rng.random() < 0.5 else 0.0

        def body(j=j, nap=nap):
            time.sleep(nap)
            if j is not None:
                ops[j].wait()

        ops.append(eng.push(body, reads=reads, writes=writes, device=cpu(rng.randrange(n_devices)), name=f"op{i}"))
    return ops


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(6))
def test_random_programs_with_waits_inside_ops_finish_or_report_a_deadlock(seed):
    import random

    rng = random.Random(seed)
    with create_engine("threaded") as eng:
        _random_program(eng, rng)
        t0 = time.monotonic()
        try:
            eng.waitall()
        except EngineDeadlockError as exc:
            assert "deadlock" in str(exc)
        assert time.monotonic() - t0 < 30
        _still_works(eng)


# ------------------------------------------------------------------------------------------ a worker's loop dies
class _Death:
    """cpu(0)'s worker loop fails at its batch after ``after`` good ones (once ``hold`` is set, if given)."""

    def __init__(self) -> None:
        self.after = 0
        self.seen = 0
        self.hold: threading.Event | None = None
        self.reports: list = []


@pytest.fixture
def death(monkeypatch):
    from dlperf.engine import worker as worker_module

    state = _Death()
    original = worker_module.Worker._process

    def process(self, batch):
        if self.device == cpu(0):
            if state.seen >= state.after:
                if state.hold is not None:
                    state.hold.wait(10)
                raise RuntimeError("worker loop broke (injected)")  # the loop's own failure, not an op's
            state.seen += 1
        original(self, batch)

    monkeypatch.setattr(worker_module.Worker, "_process", process)
    monkeypatch.setattr(threading, "excepthook", state.reports.append)
    return state


def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _outcome(call, started=None, timeout: float = 10.0):
    """What ``call()`` raised, run in a thread that must end within ``timeout`` (a hang fails, not blocks)."""
    box: list = []

    def run():
        try:
            call()
            box.append(None)
        except BaseException as exc:  # noqa: BLE001 - the outcome under test
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    if started is not None:
        time.sleep(0.1)  # the call blocks in its wait by now
        assert t.is_alive()
        started()
    t.join(timeout)
    assert not t.is_alive(), f"{call} still blocked after {timeout} s: the worker's death went unnoticed"
    return box[0]


def _is_the_death(exc) -> None:
    from dlperf.engine import EngineWorkerError

    assert isinstance(exc, EngineWorkerError), repr(exc)
    assert "engine worker cpu(0)/compute died (RuntimeError: worker loop broke (injected))" in str(exc)
    assert isinstance(exc.__cause__, RuntimeError) and "injected" in str(exc.__cause__)


def _closes_raising_the_death(eng) -> None:
    _is_the_death(_outcome(eng.close))
    assert _workers_stopped(eng) and eng.closed
    assert not [t for t in threading.enumerate() if t.name.startswith("dlperf-engine-") and t.is_alive()
                and any(t is w.thread for w in eng._workers.values())]
    eng.close()  # raised once: closed, nothing more


@pytest.mark.timeout(60)
def test_a_dead_worker_fails_waits_on_its_ops_and_later_pushes(death):
    from dlperf.engine.var import DONE, RUNNING

    death.after, death.hold = 3, threading.Event()
    eng = create_engine("threaded")
    done = []
    for i in range(3):  # run by the worker itself: nobody waits for them
        done.append(eng.push(lambda i=i: i * 10, device=cpu(0)))
        _until(lambda: done[-1].state == DONE)
    doomed = eng.push(lambda: "never", device=cpu(0))
    _until(lambda: doomed.state == RUNNING)  # taken by the worker, which breaks once `hold` is set
    _is_the_death(_outcome(doomed.wait, started=death.hold.set))
    assert [str(r.exc_value) for r in death.reports] == ["worker loop broke (injected)"]  # reported as it died
    assert [op.wait() for op in done] == [0, 10, 20]  # what finished keeps its results
    for device in (cpu(0), cpu(1)):
        with pytest.raises(Exception) as info:
            eng.push(lambda: None, device=device)
        _is_the_death(info.value)
    assert not eng.closed
    _closes_raising_the_death(eng)


@pytest.mark.timeout(60)
def test_waitall_on_an_engine_whose_worker_died_raises_and_the_other_workers_finish(death):
    death.hold = threading.Event()
    eng = create_engine("threaded")
    other = eng.push(lambda: time.sleep(0.05) or "other", device=cpu(1))
    eng.push(lambda: "never", device=cpu(0))
    _is_the_death(_outcome(eng.waitall, started=death.hold.set))
    _is_the_death(_outcome(eng.waitall))  # each wait raises it, not only the first
    _closes_raising_the_death(eng)
    assert other.wait() == "other"


@pytest.mark.timeout(60)
def test_close_alone_stops_the_other_workers_and_raises_a_dead_workers_error(death):
    eng = create_engine("threaded")
    box: list = []
    eng.push(lambda: time.sleep(0.2) or box.append(1), device=cpu(1))
    eng.push(lambda: "never", device=cpu(0))
    _closes_raising_the_death(eng)  # no wait before: close is the first to see it
    assert box == [1]


@pytest.mark.timeout(60)
def test_a_wait_inside_an_op_for_a_dead_workers_op_raises_in_that_op(death):
    from dlperf.engine.var import RUNNING

    death.after = 1
    gate = threading.Event()
    eng = create_engine("threaded")
    first = eng.push(lambda: gate.wait(10), device=cpu(0))
    _until(lambda: first.state == RUNNING)
    doomed = eng.push(lambda: "never", device=cpu(0))  # queued behind `first` on a busy worker
    waiter = eng.push(lambda: doomed.wait(), device=cpu(1))
    _until(lambda: waiter.state == RUNNING)
    error = _outcome(waiter.wait, started=gate.set)  # the pushed function's own wait raised
    _is_the_death(error)
    _closes_raising_the_death(eng)


@pytest.mark.timeout(60)
def test_a_push_waiting_for_room_on_a_dead_worker_raises(death):
    from dlperf.engine import EngineConfig
    from dlperf.engine.var import RUNNING

    death.hold = threading.Event()
    eng = create_engine("threaded", EngineConfig(max_queued=1))
    held = eng.push(lambda: "never", device=cpu(0))
    _until(lambda: held.state == RUNNING)
    _is_the_death(_outcome(lambda: eng.push(lambda: None, device=cpu(0)), started=death.hold.set))
    _closes_raising_the_death(eng)

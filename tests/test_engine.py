"""The dependency engine against sequential execution: ordering, errors, lifetime, limits."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlperf.devices import cpu
from dlperf.engine import (
    ENGINE_ENV,
    EngineClosedError,
    InFlight,
    bounded,
    create_engine,
    engine_kinds,
)
from dlperf.engine.var import QUEUED
from dlperf.errors import UsageError

KINDS = ["threaded", "naive"]


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dlperf-engine-")]


@pytest.mark.parametrize("kind", KINDS)
def test_push_returns_handle_with_result(kind):
    with create_engine(kind) as eng:
        op = eng.push(lambda a, b: a + b, args=(2, 3))
        assert op.wait() == 5
        assert op.done


def test_unknown_engine_lists_choices():
    with pytest.raises(UsageError, match="naive, threaded"):
        create_engine("turbo")
    assert engine_kinds() == ["naive", "threaded"]


def test_env_var_selects_synchronous_engine(monkeypatch):
    monkeypatch.setenv(ENGINE_ENV, "naive")
    with create_engine() as eng:
        assert eng.kind == "naive"
        seen = []
        eng.push(seen.append, args=(threading.current_thread(),))
        assert seen == [threading.current_thread()]  # ran inline, before push returned


def test_reads_of_one_variable_run_concurrently():
    # Two reads of one variable on two devices must be able to meet at a barrier.
    barrier = threading.Barrier(2, timeout=10)
    with create_engine() as eng:
        v = eng.new_var("v")
        ops = [eng.push(barrier.wait, reads=[v], device=cpu(i)) for i in range(2)]
        for op in ops:
            op.wait()  # a BrokenBarrierError here would mean the reads were serialised


def test_write_waits_for_earlier_reads_and_later_reads_see_it():
    log: list[tuple[str, float]] = []
    box = {"x": 0}
    with create_engine() as eng:
        v = eng.new_var("v")

        def slow_read(tag):
            time.sleep(0.05)
            log.append((tag, box["x"]))

        def write():
            log.append(("write", box["x"]))
            box["x"] = 1

        eng.push(slow_read, args=("r0",), reads=[v], device=cpu(0))
        eng.push(slow_read, args=("r1",), reads=[v], device=cpu(1))
        eng.push(write, writes=[v], device=cpu(2))
        eng.push(lambda: log.append(("after", box["x"])), reads=[v], device=cpu(0))
        eng.waitall()
    assert sorted(log[:2]) == [("r0", 0), ("r1", 0)]
    assert log[2:] == [("write", 0), ("after", 1)]


def test_write_after_write_keeps_push_order_across_devices():
    out = []
    with create_engine() as eng:
        v = eng.new_var()
        for i in range(50):
            eng.push(out.append, args=(i,), writes=[v], device=cpu(i % 3))
        eng.wait_to_read(v)
    assert out == list(range(50))


# ------------------------------------------------------------------------------------------ random DAGs
@st.composite
def dags(draw, max_ops=25):
    n_vars = draw(st.integers(1, 6))
    var_ids = st.integers(0, n_vars - 1)
    ops = draw(st.lists(st.tuples(st.lists(var_ids, max_size=3), st.lists(var_ids, max_size=2),
                                  st.integers(0, 2), st.integers(-1, 1)),
                        min_size=1, max_size=max_ops))
    bulk = draw(st.sampled_from([None, 1, 3]))
    return n_vars, ops, bulk


def _run_dag(eng, dag):
    """Run the DAG; each op records what it read; returns (final values, per-op observations)."""
    n_vars, ops, bulk = dag
    vars_ = [eng.new_var(f"v{i}") for i in range(n_vars)]
    values = [i * 7 + 1 for i in range(n_vars)]
    seen: dict[int, tuple] = {}

    def body(i, reads, writes):
        got = tuple(values[r] for r in reads) + tuple(values[w] for w in writes)
        seen[i] = got
        for w in writes:
            values[w] = (values[w] * 31 + sum(got) + i) % 1_000_003

    def push_all():
        for i, (reads, writes, dev, prio) in enumerate(ops):
            eng.push(body, args=(i, tuple(reads), tuple(dict.fromkeys(writes))),
                     reads=[vars_[r] for r in reads], writes=[vars_[w] for w in writes],
                     device=cpu(dev), priority=prio)

    if bulk:
        with eng.bulk(bulk):
            push_all()
    else:
        push_all()
    for v in vars_:
        eng.wait_to_read(v)
    eng.waitall()
    return values, seen


def _check_dags(eng, oracle, max_examples):
    @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(dag=dags())
    def check(dag):
        assert _run_dag(eng, dag) == _run_dag(oracle, dag)

    check()


def test_random_dags_match_sequential_execution():
    with create_engine("threaded") as eng, create_engine("naive") as oracle:
        _check_dags(eng, oracle, 300)


@pytest.mark.slow
def test_random_dags_match_sequential_execution_many():
    with create_engine("threaded") as eng, create_engine("naive") as oracle:
        _check_dags(eng, oracle, 1500)


def test_many_frontend_threads_push_at_once():
    n_threads, n_ops = 4, 300
    shared = [0]
    own = [0] * n_threads
    with create_engine() as eng:
        sv = eng.new_var("shared")
        ov = [eng.new_var(f"own{i}") for i in range(n_threads)]

        def bump_shared():
            shared[0] += 1

        def bump_own(i):
            own[i] += 1

        def frontend(i):
            for k in range(n_ops):
                eng.push(bump_shared, writes=[sv], device=cpu(k % 2))
                eng.push(bump_own, args=(i,), reads=[sv], writes=[ov[i]], device=cpu(i % 2))

        threads = [threading.Thread(target=frontend, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        eng.waitall()
    assert shared[0] == n_threads * n_ops
    assert own == [n_ops] * n_threads


# ------------------------------------------------------------------------------------------ errors
class Boom(Exception):
    pass


def _boom():
    raise Boom("boom")


@pytest.mark.parametrize("kind", KINDS)
def test_error_skips_dependents_and_is_raised_at_wait_point(kind):
    ran = []
    with create_engine(kind) as eng:
        a, b, c = eng.new_var("a"), eng.new_var("b"), eng.new_var("c")
        eng.push(_boom, writes=[a])
        eng.push(ran.append, args=("b",), reads=[a], writes=[b])  # skipped: reads a failed output
        ok = eng.push(ran.append, args=("c",), writes=[c])  # independent
        ok.wait()
        with pytest.raises(Boom):
            eng.wait_to_read(b)
        with pytest.raises(Boom):
            eng.wait_to_read(a)
        eng.waitall()  # both reported at wait points already: nothing left to raise
        assert ran == ["c"]
        # the engine stays usable
        d = eng.new_var("d")
        assert eng.push(lambda: 4, writes=[d]).wait() == 4


@pytest.mark.parametrize("kind", KINDS)
def test_waitall_raises_unreported_error_once(kind):
    with create_engine(kind) as eng:
        v = eng.new_var()
        op = eng.push(_boom, writes=[v])
        with pytest.raises(Boom):
            eng.waitall()
        eng.waitall()  # reported once
        with pytest.raises(Boom):
            op.wait()


def test_close_joins_every_worker_and_refuses_new_work():
    eng = create_engine()
    try:
        for i in range(3):
            eng.push(time.sleep, args=(0.01,), device=cpu(i))
        assert len(_engine_threads()) == 3
    finally:
        eng.close()
    assert _engine_threads() == []
    with pytest.raises(EngineClosedError):
        eng.push(print)
    eng.close()  # idempotent


def test_close_finishes_pending_work():
    out = []
    eng = create_engine()
    v = eng.new_var()
    for i in range(20):
        eng.push(out.append, args=(i,), writes=[v])
    eng.close()
    assert out == list(range(20))


def test_deleting_a_variable_with_pending_ops_is_safe():
    gate = threading.Event()
    out = []
    with create_engine() as eng:
        v = eng.new_var("doomed")
        eng.push(gate.wait, args=(10,), writes=[v])
        eng.push(out.append, args=(1,), reads=[v])
        eng.push(out.append, args=(2,), writes=[v])
        del v
        gc.collect()
        gate.set()
        eng.waitall()
    assert out == [1, 2]


def test_wait_to_write_waits_for_readers():
    done = []
    with create_engine() as eng:
        v = eng.new_var()
        eng.push(lambda: (time.sleep(0.05), done.append("read")), reads=[v], device=cpu(1))
        eng.wait_to_write(v)
        assert done == ["read"]


# ------------------------------------------------------------------------------------------ scheduling
def test_priority_orders_ready_ops_of_one_worker():
    gate = threading.Event()
    order = []
    with create_engine() as eng:
        eng.push(gate.wait, args=(10,))
        time.sleep(0.05)  # the worker is now blocked inside the gate op
        eng.push(order.append, args=("low",), priority=-1)
        eng.push(order.append, args=("normal",))
        eng.push(order.append, args=("high",), priority=5)
        gate.set()
        eng.waitall()
    assert order == ["high", "normal", "low"]


def test_max_queued_blocks_the_frontend():
    gate = threading.Event()
    pushed = []
    with create_engine(max_queued=2) as eng:
        def frontend():
            for i in range(5):
                eng.push(gate.wait, args=(10,) if i == 0 else (0,))
                pushed.append(i)

        t = threading.Thread(target=frontend)
        t.start()
        deadline = time.monotonic() + 10
        while len(pushed) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert pushed == [0, 1]  # the third push waits until something finishes
        gate.set()
        t.join(timeout=10)
        eng.waitall()
    assert pushed == [0, 1, 2, 3, 4]


def test_bulk_batches_pushes_into_one_operation():
    out = []
    with create_engine(trace=True) as eng:
        v = eng.new_var()
        with eng.bulk(8):
            handles = [eng.push(out.append, args=(i,), writes=[v]) for i in range(20)]
        assert handles[3].wait() is None
        eng.waitall()
        names = [e.name for e in eng.stop_trace().events]
    assert out == list(range(20))
    assert names == ["bulk[8]", "bulk[8]", "bulk[4]"]


def test_bulk_failure_skips_rest_of_batch_and_dependents():
    out = []
    with create_engine() as eng:
        v, w = eng.new_var(), eng.new_var()
        with eng.bulk(10):
            eng.push(out.append, args=(1,), writes=[v])
            bad = eng.push(_boom, writes=[v])
            eng.push(out.append, args=(2,), writes=[v])
        eng.push(out.append, args=(3,), reads=[v], writes=[w])
        with pytest.raises(Boom):
            eng.wait_to_read(w)
        with pytest.raises(Boom):
            bad.wait()
        eng.waitall()
    assert out == [1]


def test_cpu_worker_thread_budget_is_per_worker():
    main_threads = torch.get_num_threads()
    with create_engine(cpu_threads=1) as eng:
        got = [eng.push(torch.get_num_threads, device=cpu(i)).wait() for i in range(2)]
    assert got == [1, 1]
    assert torch.get_num_threads() == main_threads
    # a thread started afterwards still gets the process default, not a worker's budget
    fresh = []
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert fresh == [main_threads]


def test_default_budget_shares_the_cores_between_cpu_devices():
    from dlperf.devices import cpu_count

    gate = threading.Event()
    with create_engine() as eng:
        eng.push(gate.wait, args=(10,), device=cpu(0))  # keep cpu(0)'s worker busy: no stealing
        eng.push(gate.wait, args=(10,), device=cpu(1))
        ops = [eng.push(torch.get_num_threads, device=cpu(i)) for i in range(2)]
        gate.set()
        got = [op.wait() for op in ops]
    assert got == [max(1, cpu_count() // 2)] * 2


# ------------------------------------------------------------------------------------------ in flight
@pytest.mark.parametrize("k", [1, 2, 3])
def test_inflight_window_bounds_overlap(k):
    spans: dict[int, list[float]] = {}
    with create_engine() as eng:
        params = eng.new_var("params")

        def step(b):
            def run():
                spans[b] = [time.perf_counter()]
                time.sleep(0.005)
                spans[b].append(time.perf_counter())

            data = eng.new_var(f"batch{b}")  # each batch on its own var: only the window orders them
            return eng.push(run, reads=[params], writes=[data], device=cpu(b % 3))

        markers = list(bounded(range(8), step, k, eng))
    assert all(m.done for m in markers)
    for b in range(8 - k):  # batch b finished before batch b + k started
        assert spans[b][1] <= spans[b + k][0]


def test_inflight_rejects_bad_limit():
    with create_engine("naive") as eng, pytest.raises(UsageError):
        InFlight(0, engine=eng)


def test_dependents_are_released_before_a_long_op_in_the_same_batch():
    gate = threading.Event()
    stamps = {}
    with create_engine() as eng:
        v = eng.new_var()
        eng.push(gate.wait, args=(10,), device=cpu(0))
        time.sleep(0.05)  # cpu(0)'s worker is inside the gate op; the next two queue behind it
        eng.push(lambda: stamps.__setitem__("a", time.perf_counter()), writes=[v], device=cpu(0))
        eng.push(lambda: (time.sleep(0.6), stamps.__setitem__("c", time.perf_counter())), device=cpu(0))
        eng.push(lambda: stamps.__setitem__("b", time.perf_counter()), reads=[v], device=cpu(1))
        gate.set()
        eng.waitall()
    assert stamps["b"] < stamps["c"] - 0.3  # b did not wait for the long op that followed a


def test_waiting_inside_a_pushed_function_on_its_own_worker_raises_instead_of_hanging():
    with create_engine() as eng:
        def outer():
            inner = eng.push(lambda: 1, device=cpu(0))  # queued behind us on the same worker
            return inner.wait()

        eng.push(time.sleep, args=(0.05,), device=cpu(0))  # the worker, not this thread, runs outer
        op = eng.push(outer, device=cpu(0))
        while not op.done:
            time.sleep(0.01)
        with pytest.raises(UsageError, match="deadlock"):
            op.wait()
        assert eng.push(lambda: 2, device=cpu(0)).wait() == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without this GPU")
def test_push_to_a_missing_gpu_fails_in_the_frontend():
    from dlperf.devices import gpu
    from dlperf.errors import DeviceUnavailableError

    with create_engine() as eng:
        with pytest.raises(DeviceUnavailableError):
            eng.push(print, device=gpu(7))
        assert eng.push(lambda: 3).wait() == 3
    assert _engine_threads() == []


def test_a_worker_that_cannot_start_fails_its_ops_instead_of_hanging(monkeypatch):
    from dlperf.engine.worker import CpuWorker

    def broken_setup(self):
        raise RuntimeError("device init failed")

    monkeypatch.setattr(CpuWorker, "setup", broken_setup)
    with create_engine() as eng:
        v = eng.new_var()
        op = eng.push(lambda: 1, writes=[v], device=cpu(3))
        deadline = time.monotonic() + 10
        while not op.done and time.monotonic() < deadline:  # no engine wait: the worker must fail it
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="device init failed"):
            eng.wait_to_read(v)
        with pytest.raises(RuntimeError, match="device init failed"):
            op.wait()


# ------------------------------------------------------------------------------------------ close and lifetime
@pytest.mark.parametrize("kind", KINDS)
def test_close_raises_an_error_no_wait_reported(kind):
    with pytest.raises(ZeroDivisionError):
        with create_engine(kind) as eng:
            eng.push(lambda: 1 / 0)
    eng = create_engine(kind)
    eng.push(_boom)
    with pytest.raises(Boom):
        eng.close()
    eng.close()  # idempotent: the error was raised once


@pytest.mark.parametrize("kind", KINDS)
def test_close_does_not_repeat_reported_errors_or_mask_the_block_s_own(kind):
    with create_engine(kind) as eng:
        op = eng.push(_boom)
        with pytest.raises(Boom):
            op.wait()  # reported here: leaving the block raises nothing
    with pytest.raises(KeyError):  # the exception leaving the block wins over the stored one
        with create_engine(kind) as eng:
            eng.push(_boom)
            raise KeyError("own")


def test_an_unclosed_engine_that_is_dropped_stops_its_threads():
    for i in range(3):
        eng = create_engine("threaded")
        v = eng.new_var()
        eng.push(lambda: None, writes=[v], device=cpu(i)).wait()
        eng.push(torch.ones, args=(2,), reads=[v], device=cpu(i)).wait()
        del eng, v
    # Finished operations and their variables form reference cycles that hold the engine until
    # the cyclic collector runs; a worker may also still hold a finished operation briefly.
    deadline = time.monotonic() + 5
    while _engine_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert _engine_threads() == []


def test_a_push_waiting_for_room_fails_when_the_engine_closes_meanwhile():
    gate = threading.Event()
    eng = create_engine(max_queued=1)
    eng.push(gate.wait, args=(10,))
    caught: list[BaseException] = []

    def frontend():
        try:
            eng.push(print)
        except EngineClosedError as exc:
            caught.append(exc)

    pusher = threading.Thread(target=frontend)
    pusher.start()
    time.sleep(0.1)  # the push now waits for room
    closer = threading.Thread(target=eng.close)
    closer.start()
    deadline = time.monotonic() + 10
    while not eng.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    pusher.join(timeout=10)
    closer.join(timeout=10)
    assert len(caught) == 1 and "closed" in str(caught[0])
    assert _engine_threads() == []


# ------------------------------------------------------------------------------------------ per-op cost
@pytest.mark.timeout(30)
def test_a_push_that_does_not_wake_a_napping_worker_still_runs_without_any_wait():
    # A CPU worker that ran dry a moment ago is left asleep by a push (waking it costs more than a
    # small op); it must look at its queue again on its own, since nobody may ever wait for the op.
    with create_engine("threaded") as eng:
        deferred = 0
        for _ in range(50):
            warm = threading.Event()
            eng.push(warm.set)
            assert warm.wait(5)  # the worker ran it and is about to nap briefly
            time.sleep(0.0002)
            worker = eng._workers[next(iter(eng._workers))]
            ran = threading.Event()
            op = eng.push(ran.set)
            with eng._lock:  # still asleep with the op queued: the push did not wake it
                deferred += worker._sleeping and op.state == QUEUED
            # within less than the idle check (1 s): the worker looks again on its own within ms
            assert ran.wait(0.9), "a pushed operation did not run although nothing waited for it"
            if deferred >= 3:
                break
        assert deferred >= 3  # the path under test was taken


@pytest.mark.timeout(30)
def test_a_push_wakes_a_napping_worker_at_once_after_long_operations():
    # The nap only pays for itself on small operations: after long ones a push must start at once.
    with create_engine("threaded") as eng:
        done = threading.Event()
        eng.push(lambda: (time.sleep(0.05), done.set()))
        assert done.wait(5)
        time.sleep(0.0002)  # the worker runs dry and naps
        worker = eng._workers[next(iter(eng._workers))]
        ran = threading.Event()
        op = eng.push(ran.set)
        with eng._lock:
            assert not (worker._sleeping and op.state == QUEUED)
        assert ran.wait(5)


@pytest.mark.timeout(30)
def test_a_waiting_thread_is_woken_only_by_what_it_waits_for():
    # Every wake-up makes the waiting thread compete for the GIL with the worker; 200 finished
    # operations nobody waits for must not wake a thread that waits for another one.
    class CountingCondition(threading.Condition):
        notified = 0

        def notify_all(self) -> None:
            CountingCondition.notified += 1
            super().notify_all()

    with create_engine("threaded") as eng:
        eng._cond = CountingCondition(eng._lock)
        gate = threading.Event()
        target = eng.push(gate.wait, args=(10,), device=cpu(1))
        waiter = threading.Thread(target=target.wait)
        waiter.start()
        time.sleep(0.1)  # the waiter is blocked in its wait
        deadline = time.monotonic() + 5
        others = [eng.push(lambda: None, device=cpu(0)) for _ in range(200)]
        while not all(op.done for op in others) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert all(op.done for op in others)
        assert CountingCondition.notified <= 2
        gate.set()
        waiter.join(10)
        assert not waiter.is_alive()


def test_finished_operations_are_freed_by_reference_counting():
    import weakref

    from dlperf.engine import array as dnp

    was_enabled = gc.isenabled()
    gc.disable()  # only reference counting may free them
    try:
        with create_engine("threaded") as eng:
            x = dnp.ones((1, 2), engine=eng)
            y = x + 1
            op = y._var._last_write
            assert op is not None
            ref = weakref.ref(op)
            del op
            y.wait_to_read()
            assert y.tolist() == [[2.0, 2.0]]
            eng.waitall()
            del y
            assert ref() is None
    finally:
        if was_enabled:
            gc.enable()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(3))
def test_threads_mixing_pushes_and_waits_on_napping_workers_get_torch_s_values(seed):
    # Pushes that leave workers asleep, waits that run ops inline or wake the workers, copies
    # between devices: whatever the interleaving, every thread sees what plain torch computes.
    import random

    from dlperf.engine import array as dnp

    def program(eng, rng, results, k):
        x, ref = dnp.ones((1, 2), engine=eng), torch.ones(1, 2)
        for _ in range(300):
            step = rng.random()
            if step < 0.4:
                x, ref = x + 1, ref + 1
            elif step < 0.7:
                x, ref = x * 0.5, ref * 0.5
            elif step < 0.8:
                x = x.copyto(cpu(rng.randrange(3)))
            elif step < 0.95:
                x.wait_to_read()
            else:
                time.sleep(0.003)  # long enough for an idle worker's nap to end
        results[k] = (x.tolist(), ref.tolist())

    with create_engine("threaded") as eng:
        results: dict[int, tuple] = {}
        threads = [threading.Thread(target=program, args=(eng, random.Random(seed * 10 + k), results, k))
                   for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(50)
        assert not any(t.is_alive() for t in threads)
        assert len(results) == 4
        for got, want in results.values():
            assert got == want


def test_running_on_names_the_worker_of_the_calling_thread():
    with create_engine("threaded") as eng:
        assert eng.running_on() is None  # the frontend
        # waited for while cpu(1)'s worker is busy, so that it (not this waiting thread) runs it
        gate = threading.Event()
        eng.push(gate.wait, device=cpu(1))
        op = eng.push(eng.running_on, device=cpu(1))
        opener = threading.Timer(0.05, gate.set)
        opener.start()
        assert op.wait() == (cpu(1), "compute")
        opener.join()
    with create_engine("naive") as eng:
        assert eng.push(eng.running_on).wait() is None


def test_work_pushed_to_the_running_worker_runs_after_the_operation_in_order():
    order = []
    with create_engine("threaded") as eng:
        def first():
            place = eng.running_on()
            eng.push(order.append, args=("second",), device=place[0], kind=place[1])
            eng.push(order.append, args=("third",), device=place[0], kind=place[1])
            order.append("first")
        eng.push(first, device=cpu(1))
        eng.waitall()
    assert order == ["first", "second", "third"]

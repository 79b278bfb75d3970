"""Automatic batches of the threaded engine (EngineConfig.auto_bulk): same values as eager
PyTorch, sent at every point that needs them, and never holding work back."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dlperf.devices import cpu
from dlperf.engine import array as dnp
from dlperf.engine import create_engine
from dlperf.engine.engine import EngineConfig, run_auto
from dlperf.errors import UsageError

pytestmark = pytest.mark.timeout(30)

BUSY_S = 0.3  # how long the worker is kept busy so that pushes after it are collected


def _busy(eng, device=None):
    """Keep the device's worker busy for BUSY_S with an operation nothing else depends on."""
    op = eng.push(time.sleep, args=(BUSY_S,), device=device, name="busy")
    # A worker whose last operation looked long (its first, or one preempted on a loaded machine)
    # batches only records on tiny inputs until it runs a short one; these tests are about batches.
    eng._worker(device or cpu(0), "compute").long_ops = False
    return op


def _ran_dry(eng, device=None) -> None:
    """Wait until the device's worker has finished its batch and found nothing queued: idle, as a push sees it
    (a fixed pause is not enough where a loaded machine has not given the worker a core again yet)."""
    w = eng._worker(device or cpu(0), "compute")
    deadline = time.monotonic() + 10
    while (w.busy or w._q) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not w.busy


def _unsent(a) -> bool:
    last = a._var._last_write
    return last is not None and last.fn is run_auto and last.worker is None


def _pair(eng, shape, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g)
    return dnp.array(t, engine=eng), t


@pytest.fixture
def eng():
    with create_engine("threaded", auto_bulk=8) as e:
        yield e


def test_config_checks_auto_bulk():
    assert EngineConfig().auto_bulk >= 0
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(UsageError, match="auto_bulk"):
            EngineConfig(auto_bulk=bad)


@pytest.mark.parametrize("size", [0, 1, 8, 64])
def test_results_equal_eager_torch(size):
    with create_engine("threaded", auto_bulk=size) as eng:
        x, tx = _pair(eng, (3, 4), seed=size + 1)
        w, tw = _pair(eng, (3, 4), seed=size + 2)
        _busy(eng)
        y, ty = x, tx
        outs = []
        for i in range(100):  # crosses the size bound many times; mixes unary, scalar, binary
            y = (y * 0.5 + w) if i % 3 else -y + 1
            ty = (ty * 0.5 + tw) if i % 3 else -ty + 1
            outs.append((x - i, tx - i))
        torch.testing.assert_close(y.tensor(), ty)
        for a, t in outs:
            torch.testing.assert_close(a.tensor(), t)


@pytest.mark.parametrize("blocker", ["wait_to_read", "tensor", "asnumpy", "item", "float", "tolist", "repr",
                                     "waitall", "module_waitall", "wait_op"])
def test_every_blocker_sends_the_open_batch(eng, blocker):
    x, tx = _pair(eng, (1,), seed=3)
    x.wait_to_read()
    _busy(eng)
    y = x + 1
    z = y * 2
    assert _unsent(z)  # collected: the worker is busy
    want = (tx + 1) * 2
    if blocker == "wait_to_read":
        z.wait_to_read()
    elif blocker == "tensor":
        z.tensor()
    elif blocker == "asnumpy":
        assert z.asnumpy().tolist() == want.tolist()
    elif blocker == "item":
        assert z.item() == pytest.approx(want.item())
    elif blocker == "float":
        assert float(z) == pytest.approx(want.item())
    elif blocker == "tolist":
        assert z.tolist() == pytest.approx(want.tolist())
    elif blocker == "repr":
        assert "array(" in repr(z)
    elif blocker == "waitall":
        eng.waitall()
    elif blocker == "module_waitall":
        dnp.waitall()
    elif blocker == "wait_op":
        z._var._last_write.wait()
    assert not _unsent(z)
    torch.testing.assert_close(z.tensor(), want)


def test_another_threads_wait_sends_the_batch(eng):
    x, tx = _pair(eng, (2,), seed=4)
    x.wait_to_read()
    _busy(eng)
    y = x + 3
    assert _unsent(y)
    got = []
    t = threading.Thread(target=lambda: got.append(y.tensor().clone()))
    t.start()
    t.join(10)  # this thread holds the open batch and does nothing: the waiter must send it
    assert not t.is_alive()
    torch.testing.assert_close(got[0], tx + 3)


def test_a_push_that_uses_a_result_is_ordered_after_its_batch(eng):
    x, tx = _pair(eng, (2,), seed=5)
    x.wait_to_read()
    _busy(eng)
    y = x + 1
    assert _unsent(y)
    seen = []
    t = threading.Thread(target=lambda: eng.push(lambda: seen.append(y._data.clone()), reads=[y._var]).wait())
    t.start()
    t.join(10)
    assert not t.is_alive()
    torch.testing.assert_close(seen[0], tx + 1)


def test_a_write_of_an_input_waits_for_the_batch_reading_it(eng):
    x, tx = _pair(eng, (2,), seed=6)
    x.wait_to_read()
    _busy(eng)
    y = x + 1  # collected; reads x
    assert _unsent(y)

    def overwrite():
        x[:] = 100.0  # another thread's write of x: the batch that reads x goes first

    t = threading.Thread(target=overwrite)
    t.start()
    t.join(10)
    torch.testing.assert_close(y.tensor(), tx + 1)
    torch.testing.assert_close(x.tensor(), torch.full((2,), 100.0))


def test_an_error_fails_only_its_record_and_what_uses_it(eng):
    a = dnp.ones((2, 3), engine=eng)
    b = dnp.ones((4, 5), engine=eng)
    eng.waitall()
    _busy(eng)
    bad = a + b  # shapes do not broadcast: raised inside the batch
    worse = bad + 1
    fine = a + 1
    assert _unsent(bad) and _unsent(worse) and _unsent(fine)
    assert fine.tolist() == [[2.0] * 3] * 2
    with pytest.raises(RuntimeError, match="size"):
        worse.tensor()
    with pytest.raises(RuntimeError, match="size"):
        bad.tensor()
    eng.waitall()  # already reported
    assert (a * 3).tolist() == [[3.0] * 3] * 2  # the engine stays usable


def test_an_unreported_error_surfaces_at_waitall(eng):
    a = dnp.ones((2, 3), engine=eng)
    b = dnp.ones((4, 5), engine=eng)
    eng.waitall()
    _busy(eng)
    _ = a + b
    with pytest.raises(RuntimeError, match="size"):
        eng.waitall()


def test_a_failed_input_from_outside_skips_only_the_records_using_it(eng):
    a = dnp.ones((2, 3), engine=eng)
    bad = a @ a
    with pytest.raises(RuntimeError):
        bad.wait_to_read()
    _busy(eng)
    worse = bad + 1
    fine = a + 2
    assert fine.tolist() == [[3.0] * 3] * 2
    with pytest.raises(RuntimeError, match="shapes"):
        worse.wait_to_read()


def test_a_device_switch_sends_the_batch():
    with create_engine("threaded", auto_bulk=64) as eng:
        x0 = dnp.ones(2, device=cpu(0), engine=eng)
        x1 = dnp.ones(2, device=cpu(1), engine=eng)
        eng.waitall()
        _busy(eng, cpu(0))
        y0 = x0 + 1
        assert _unsent(y0)
        y1 = x1 + 1
        assert not _unsent(y0)  # sent when the thread turned to cpu(1)
        assert y0.tolist() == y1.tolist() == [2.0, 2.0]


def test_the_size_bound_sends_full_batches(eng):
    x = dnp.zeros(1, engine=eng)
    x.wait_to_read()
    _busy(eng)
    ys = [x + i for i in range(20)]
    batches = {id(y._var._last_write): y._var._last_write for y in ys}
    sizes = sorted(len(op.args[0].run) for op in batches.values() if op.fn is run_auto and op.args)
    assert sizes and max(sizes) <= 8  # eng's auto_bulk
    assert [y.item() for y in ys] == list(range(20))


def test_a_matrix_product_is_never_collected(eng):
    a = dnp.ones((2, 2), engine=eng)
    a.wait_to_read()
    _busy(eng)
    y = a @ a
    assert not _unsent(y) and y._var._last_write.fn is not run_auto
    assert y.tolist() == [[2.0, 2.0]] * 2


def test_a_push_to_an_idle_worker_is_not_held_back(eng):
    big = dnp.random.uniform(size=(160, 160), engine=eng)
    eng.waitall()
    _ran_dry(eng)
    y = big @ big
    assert not _unsent(y)  # sent at once: nothing else was running
    op = y._var._last_write
    deadline = time.monotonic() + 10
    while op is not None and not op.done and time.monotonic() < deadline:
        time.sleep(0.005)  # no wait: the worker must start it on its own
    assert op is None or op.done
    torch.testing.assert_close(y.tensor(), big.tensor() @ big.tensor())


def test_the_worker_sends_what_was_collected_for_it_when_it_runs_dry(eng):
    x = dnp.ones(2, engine=eng)
    x.wait_to_read()
    _busy(eng)
    y = x + 1
    op = y._var._last_write
    assert _unsent(y)
    deadline = time.monotonic() + 10
    while not op.done and time.monotonic() < deadline:
        time.sleep(0.005)  # no wait, no further push: the batch must still run
    assert op.done
    assert y.tolist() == [2.0, 2.0]


def test_big_ops_on_two_devices_still_overlap():
    with create_engine("threaded", auto_bulk=64, cpu_threads=1) as eng:
        xs = [dnp.ones(2, device=cpu(i), engine=eng) for i in range(2)]
        eng.waitall()
        busy = [_busy(eng, cpu(i)) for i in range(2)]
        ys = [x + 1 for x in xs]  # collected behind each device's busy op
        t0 = time.perf_counter()
        eng.waitall()
        took = time.perf_counter() - t0
        assert all(op.done for op in busy)
        assert [y.tolist() for y in ys] == [[2.0, 2.0]] * 2
        assert took < 1.8 * BUSY_S  # side by side, not one after the other


def test_off_means_one_operation_per_push():
    with create_engine("threaded", auto_bulk=0) as eng:
        x = dnp.ones(2, engine=eng)
        x.wait_to_read()
        _busy(eng)
        y = x + 1
        assert not _unsent(y) and y._var._last_write.fn is not run_auto
        assert y.tolist() == [2.0, 2.0]


def test_fast_path_arrays_are_complete(eng):
    # x + scalar builds its output without Array() and Var(): every field must still be set, as
    # the constructors set it (apart from the grant to the batch and the record).
    from dlperf.engine.array import Array
    from dlperf.engine.var import Var

    x = dnp.ones(2, engine=eng)
    x.wait_to_read()
    _busy(eng)
    _ = x + 1  # opens the batch
    y = x + 2  # collected by the operator method itself
    assert _unsent(y)
    ref = Array(eng, x.device)
    for obj, plain, cls in ((y, ref, Array), (y._var, ref._var, Var)):
        for slot in cls.__slots__:
            if slot == "__weakref__":
                continue
            got = getattr(obj, slot)  # AttributeError: a field the fast path forgot
            if slot not in ("_var", "_meta", "_writing", "_last_write"):
                assert got == plain.__getattribute__(slot) or got is plain.__getattribute__(slot), slot
    assert y._var._writing and y._var._last_write is y._var._last_write.args[0].op
    assert y.tolist() == [3.0, 3.0]


def _chain_and_share(eng, k: int, seed: int, shared: list) -> None:
    import random

    rng = random.Random(seed * 10 + k)
    x, tx = _pair(eng, (3,), seed=seed * 10 + k)
    mine = []
    y, ty = x * 1.0, tx * 1.0  # never x itself: x is written in place below
    for i in range(300):
        r = rng.random()
        if r < 0.55:
            y, ty = y * 0.5 + i, ty * 0.5 + i
        elif r < 0.7:
            y, ty = -y, -ty
        elif r < 0.8 and shared:
            a, ta = shared[rng.randrange(len(shared))]
            y, ty = y + a, ty + ta
        elif r < 0.87:
            shared.append((y, ty))
        elif r < 0.92 and shared:
            a, ta = shared[rng.randrange(len(shared))]
            torch.testing.assert_close(a.tensor(), ta)
        elif r < 0.96:
            x += 1  # an in-place write of an input that earlier records read
            tx = tx + 1
            y, ty = y + x, ty + tx
        mine.append((y, ty))
    for a, ta in mine[::7]:
        torch.testing.assert_close(a.tensor(), ta)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_threads_sharing_results_see_eager_values(seed):
    # Three threads chain small operations, publish results to each other mid-batch, use and
    # wait on the others' (often still collected in their owner's open batch), and write their
    # own inputs in place: every value must equal eager PyTorch's.
    shared: list = []
    errors: list = []

    def work(eng, k: int) -> None:
        try:
            _chain_and_share(eng, k, seed, shared)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with create_engine("threaded", auto_bulk=16) as eng:
        threads = [threading.Thread(target=work, args=(eng, k)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(25)
        assert not any(t.is_alive() for t in threads), "a thread hung"
        eng.waitall()
    if errors:
        raise errors[0]


def _collected_behind_busy_worker(eng):
    """``ones(2) + 1``, still in this thread's open batch behind a busy worker."""
    x = dnp.ones(2, engine=eng)
    x.wait_to_read()
    _busy(eng)
    y = x + 1
    assert _unsent(y)
    return y


def test_a_push_waiting_inside_for_a_collected_result_does_not_deadlock(eng):
    # Unbatched, y's operation would be queued before the function that waits for it; batched, it
    # must still be: the thread's other pushes send its open batch first.
    y = _collected_behind_busy_worker(eng)
    op = eng.push(lambda: y.tolist())  # reads y without declaring it: waits inside
    assert op.wait() == [2.0, 2.0]


def test_another_threads_push_to_the_worker_goes_after_a_collected_batch(eng):
    y = _collected_behind_busy_worker(eng)
    got = []
    t = threading.Thread(target=lambda: got.append(eng.push(lambda: y.tolist()).wait()))
    t.start()
    t.join(10)
    assert not t.is_alive() and got == [[2.0, 2.0]]


def _held(eng):
    """Keep the worker busy until the returned event is set; the worker looks long meanwhile, as
    after its first operation or one preempted on a loaded machine."""
    release = threading.Event()
    eng.push(release.wait, args=(10,), name="held")
    w = eng._worker(cpu(0), "compute")
    deadline = time.monotonic() + 10
    while not w.busy and time.monotonic() < deadline:
        time.sleep(0.001)
    assert w.busy
    w.long_ops = True
    return release


def test_tiny_records_are_collected_behind_a_worker_that_looked_long(eng):
    x, tx = _pair(eng, (1, 2), seed=11)
    x.wait_to_read()
    release = _held(eng)
    try:
        ys = [x + i for i in range(5)]
        assert all(_unsent(y) for y in ys)  # collected while the worker was busy
        assert len({id(y._var._last_write) for y in ys}) == 1
    finally:
        release.set()
    for i, y in enumerate(ys):  # each blocker sends the batch: nothing waits past it
        torch.testing.assert_close(y.tensor(), tx + i)


def test_big_records_still_go_at_once_behind_a_worker_that_looked_long(eng):
    big, tbig = _pair(eng, (100, 100), seed=12)  # above TINY_NUMEL
    big.wait_to_read()
    release = _held(eng)
    try:
        y = big + 1
        op = y._var._last_write
        assert not _unsent(y) and op.fn is not run_auto and op.worker is not None  # queued on its own
    finally:
        release.set()
    torch.testing.assert_close(y.tensor(), tbig + 1)


def test_a_record_on_an_uncomputed_input_behind_a_worker_that_looked_long_goes_at_once(eng):
    x = dnp.ones((1, 2), engine=eng)
    x.wait_to_read()
    release = _held(eng)
    try:
        pending = x.__class__.__matmul__(x, dnp.ones((2, 1), engine=eng))  # size unknown until it runs
        y = pending + 1
        assert not _unsent(y)
    finally:
        release.set()
    assert y.tolist() == [[3.0]]


def test_a_thread_pushing_tiny_records_to_a_worker_that_looked_long_gets_them_batched(monkeypatch):
    with create_engine("threaded", auto_bulk=64) as eng:
        x, tx = _pair(eng, (1, 2), seed=13)
        x.wait_to_read()
        alone = []
        submit = eng._submit_locked

        def counting(op, worker, switched):
            if op.fn is not run_auto:
                alone.append(op)
            submit(op, worker, switched)

        monkeypatch.setattr(eng, "_submit_locked", counting)
        eng._worker(cpu(0), "compute").long_ops = True  # what its first operation left
        ys = [x + i for i in range(200)]
        eng.waitall()
        # The first starts at once; the next ones find it queued or running and are collected
        # (without the rule, every one went alone until the worker ran again).
        assert 1 <= len(alone) <= 100
        for i, y in enumerate(ys):
            torch.testing.assert_close(y.tensor(), tx + i)


def test_the_engine_counts_records_batched_and_sent_alone(eng):
    x = dnp.ones(2, engine=eng)
    eng.waitall()
    _ran_dry(eng)
    alone, batched = eng.records_alone, eng.records_batched
    y = x + 1  # to an idle worker: alone
    y.wait_to_read()
    assert (eng.records_alone - alone, eng.records_batched - batched) == (1, 0)
    _busy(eng)
    ys = [x + i for i in range(5)]  # collected behind the busy op, sent by the blocker
    eng.waitall()
    assert (eng.records_alone - alone, eng.records_batched - batched) == (1, 5)
    assert [z.tolist() for z in ys] == [[1.0 + i] * 2 for i in range(5)]


# --------------------------------------------- runs of scalar records in one multi-tensor call
@pytest.fixture
def foreach_calls(monkeypatch):
    """Count the records the batches' multi-tensor calls took (see records.group_scalar)."""
    from dlperf.engine import records

    taken = []
    for func, many in list(records.FOREACH_SCALAR.items()):
        def counted(tensors, scalars, _many=many):
            taken.append(len(tensors))
            return _many(tensors, scalars)
        monkeypatch.setitem(records.FOREACH_SCALAR, func, counted)
    return taken


@pytest.mark.parametrize("device_index", [0, 1])
def test_runs_of_scalar_records_equal_eager_torch(foreach_calls, device_index):
    # Each function, with one scalar for the run and mixed ones (1, 1.0 and True give different
    # dtypes on an integer tensor), on float and integer inputs; values and dtypes as eager.
    dev = cpu(device_index)
    g = torch.Generator().manual_seed(7 + device_index)
    tf = torch.rand(3, 4, generator=g) + 0.5
    ti = torch.randint(1, 9, (5,), generator=g)
    with create_engine("threaded", auto_bulk=64) as eng:
        xf = dnp.array(tf, device=dev, engine=eng)
        xi = dnp.array(ti, device=dev, engine=eng)
        eng.waitall()
        cases = []
        for op in (lambda a, s: a + s, lambda a, s: a - s, lambda a, s: a * s, lambda a, s: a / s,
                   lambda a, s: a ** s):
            _busy(eng, dev)  # one busy spell collects both inputs' runs: up to 18 pushes
            for x, t in ((xf, tf), (xi, ti)):
                for scalars in ((2, 2, 2, 2), (1, 1.0, True, -3, 0.5)):
                    for s in scalars:
                        try:
                            want = op(t, s)
                        except RuntimeError:  # tensor - True: torch refuses, tested below
                            continue
                        cases.append((op(x, s), want))
        eng.waitall()
    assert sum(foreach_calls) >= len(cases) // 2  # most of them did go in joint calls
    for got, want in cases:
        out = got.tensor()
        assert out.dtype == want.dtype and got.device == dev
        torch.testing.assert_close(out, want)


def test_a_chain_of_scalar_records_runs_in_order(foreach_calls, eng):
    x, tx = _pair(eng, (4,), seed=11)
    x.wait_to_read()
    _busy(eng)
    y, ty = x, tx
    side = []
    for i in range(7):  # each depends on the one before, with an independent record between
        y, ty = y + i, ty + i
        side.append((x + i, tx + i))
    torch.testing.assert_close(y.tensor(), ty)
    for a, t in side:
        torch.testing.assert_close(a.tensor(), t)


def test_a_record_the_joint_call_refuses_fails_alone(foreach_calls, eng):
    x = dnp.ones(3, engine=eng)
    flags = dnp.array(torch.tensor([True, False]), engine=eng)
    eng.waitall()
    _busy(eng)
    before = x - 1
    bad = flags - 1  # torch refuses to subtract from a bool tensor: only this record fails
    after = x - 2
    assert _unsent(before) and _unsent(bad) and _unsent(after)
    assert before.tolist() == [0.0] * 3 and after.tolist() == [-1.0] * 3
    with pytest.raises(RuntimeError, match="bool"):
        bad.wait_to_read()
    eng.waitall()  # reported above


def test_records_on_inputs_that_need_gradients_run_one_by_one(foreach_calls, eng):
    x = dnp.array(torch.tensor([1.0, 2.0]), engine=eng).attach_grad()
    eng.waitall()
    _busy(eng)
    ys = [x * 3, x * 3, x * 3]
    eng.waitall()
    assert foreach_calls == []  # the autograd graph stays that of one multiplication each
    assert all(type(y.tensor().grad_fn).__name__ == "MulBackward0" for y in ys)

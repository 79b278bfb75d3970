"""d2l §12.2 (asynchronous computation) as a reader writes it with dlperf's names.

MXNet -> dlperf: ``np.random.normal``/``np.dot``/``np.ones`` -> ``dlperf.engine.array`` (imported
as ``np``); ``npx.waitall()`` -> ``dlperf.engine.waitall()``; ``z.wait_to_read()``, ``asnumpy()``,
``item()`` keep their names; ``gluon.Trainer`` -> a torch optimizer; ``gluon.loss.L2Loss`` -> half
the squared error. Engines are made with ``create_engine()`` (closed after each test) rather than
the process-wide default, whose worker threads would outlive a test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import numpy
import pytest
import torch
from torch import nn

from dlperf.devices import cpu
from dlperf.engine import InFlight, create_engine, waitall
from dlperf.engine import array as np


@pytest.fixture
def eng():
    with create_engine(cpu_threads=1) as e:
        yield e


@pytest.mark.timeout(120)
def test_the_frontend_returns_before_the_backend_has_computed(eng):
    # §12.2.1: pushing ten random draws and products takes a fraction of computing them.
    t0 = time.perf_counter()
    for _ in range(10):
        a = np.random.normal(size=(600, 600), engine=eng)
        b = np.dot(a, a)
    pushed = time.perf_counter() - t0
    waitall()
    total = time.perf_counter() - t0
    assert pushed < total / 3, (pushed, total)
    numpy.testing.assert_allclose(b.asnumpy(), a.asnumpy() @ a.asnumpy(), rtol=1e-4, atol=1e-3)


def test_dependencies_x_times_y_plus_2(eng, capsys):
    x = np.ones((1, 2), engine=eng)
    y = np.ones((1, 2), engine=eng)
    z = x * y + 2
    print(z)  # an implicit blocker
    assert capsys.readouterr().out == "array([[3., 3.]], device=cpu(0))\n"


def _gate(eng, x):
    gate = threading.Event()
    eng.push(gate.wait, args=(10,), writes=[x._var], device=x.device, name="gate")
    return gate


@pytest.mark.timeout(60)
def test_barriers_wait_to_read_waits_for_one_variable_waitall_for_everything(eng):
    # §12.2.2: wait_to_read returns once its variable is ready while other work goes on.
    a = np.random.normal(size=(50, 50), engine=eng)
    held = np.ones(3, ctx=cpu(1), engine=eng)
    gate = _gate(eng, held)
    later = held + 1  # stuck behind the gate
    b = np.dot(a, a)
    b.wait_to_read()
    assert not gate.is_set()
    numpy.testing.assert_allclose(b.asnumpy(), a.asnumpy() @ a.asnumpy(), rtol=1e-4, atol=1e-4)
    timer = threading.Timer(0.2, gate.set)
    timer.start()
    waitall()  # waits for the gate and what depends on it
    assert gate.is_set() and later.tolist() == [2.0, 2.0, 2.0]
    timer.join()


def test_implicit_blockers_numpy_and_scalar_conversion(eng):
    a = np.random.normal(size=(40, 40), engine=eng)
    b = np.dot(a, a)
    host = b.asnumpy()
    assert isinstance(host, numpy.ndarray)
    assert b.sum().item() == pytest.approx(float(host.sum()), rel=1e-4, abs=1e-3)


@pytest.mark.timeout(120)
def test_synchronous_and_asynchronous_increments_agree(eng):
    # §12.2.3: y = x + 1 a thousand times, waiting each time or once.
    x = np.ones((1, 2), engine=eng)
    for _ in range(1000):
        y = x + 1
        y.wait_to_read()
    sync = y.tolist()
    for _ in range(1000):
        y = x + 1
    y.wait_to_read()
    assert sync == y.tolist() == [[2.0, 2.0]]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_asynchronous_increments_are_not_slower_than_synchronous():
    with create_engine(cpu_threads=1) as e:
        x = np.ones((1, 2), engine=e)

        def run(sync: bool) -> float:
            t0 = time.perf_counter()
            for _ in range(2000):
                y = x + 1
                if sync:
                    y.wait_to_read()
            y.wait_to_read()
            return time.perf_counter() - t0

        sync_s = min(run(True) for _ in range(3))
        async_s = min(run(False) for _ in range(3))
    assert async_s < 1.2 * sync_s, (sync_s, async_s)


def data_iter(eng, num_batches=12, batch_size=64, features=128):
    for _ in range(num_batches):
        X = np.random.normal(size=(batch_size, features), engine=eng)
        y = np.ones((batch_size,), engine=eng)
        yield X, y


def make_net(features=128):
    return nn.Sequential(nn.Linear(features, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1))


def l2_loss(y, y_hat):
    return ((y_hat.reshape(y.shape) - y) ** 2 / 2).mean()


def get_mem() -> float:
    """Resident memory of this process in MB, read with ``ps`` as the book does."""
    out = subprocess.check_output(["ps", "-o", "rss=", "-p", str(os.getpid())])
    return int(out.split()[0]) / 1e3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("barrier", [True, False], ids=["wait_to_read each batch", "no barrier"])
def test_training_loop_matches_eager_torch_with_or_without_a_barrier(eng, barrier):
    # §12.2.4's loop. The update of every batch must land (no lost updates), whatever the barrier.
    torch.manual_seed(6)
    net = make_net()
    ref = make_net()
    ref.load_state_dict(net.state_dict())
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    batches = []
    for X, y in data_iter(eng):
        batches.append(X)
        loss = l2_loss(y, net(X))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if barrier:
            loss.wait_to_read()
    waitall()
    for X in batches:
        Xt = X.tensor()
        l2_loss(torch.ones(len(Xt)), ref(Xt)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(shutil.which("ps") is None, reason="needs ps")
def test_get_mem_reads_a_plausible_resident_size():
    assert 10 < get_mem() < 1e6


@pytest.mark.timeout(60)
def test_exercise_2_one_minibatch_of_overlap(eng):
    # Batch t must have finished before batch t + 2 is issued: a window of two in flight.
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    window = InFlight(2, engine=eng)
    losses = []
    for t, (X, y) in enumerate(data_iter(eng, num_batches=6)):
        if t >= 2:  # about to issue batch t: batch t - 2 has finished
            assert losses[t - 2]._var._last_write.done
        loss = l2_loss(y, net(X))
        loss.backward(wait=False)
        opt.step()
        losses.append(loss)
        window.submit(loss)
    window.drain()
    assert window.max_seen <= 2


@pytest.mark.timeout(60)
def test_exercise_3_two_devices_at_once_without_syncing_each_batch():
    # With work on two devices, waiting after every batch would idle one of them: wait once.
    with create_engine(cpu_threads=1) as e:
        xs = [np.random.normal(size=(200, 200), ctx=cpu(i), engine=e) for i in (0, 1)]
        outs = [[x.dot(x) for _ in range(3)] for x in xs]
        waitall()
        for x, ys in zip(xs, outs):
            for y in ys:
                numpy.testing.assert_allclose(y.asnumpy(), x.asnumpy() @ x.asnumpy(), rtol=1e-4, atol=1e-3)


@pytest.mark.timeout(60)
def test_exercise_4_wait_to_read_on_an_intermediate_returns_before_waitall_would(eng):
    x = np.ones((8, 8), engine=eng)
    mid = x.dot(x)
    tail = np.ones(2, ctx=cpu(1), engine=eng)
    gate = _gate(eng, tail)
    end = tail * 3
    mid.wait_to_read()  # returns: the gated work is not mid's dependency
    assert not gate.is_set() and mid.tolist()[0][0] == 8.0
    gate.set()
    waitall()
    assert end.tolist() == [3.0, 3.0]

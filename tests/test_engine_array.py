"""The engine array frontend gives the same values as plain torch, and blocks only where documented."""

from __future__ import annotations

import numpy
import pytest
import torch

from dlperf.devices import cpu, device_of
from dlperf.engine import Array, create_engine
from dlperf.engine import array as dnp
from dlperf.errors import DeviceMismatchError


@pytest.fixture(params=["threaded", "naive"])
def eng(request):
    with create_engine(request.param) as e:
        yield e


def _pair(eng, shape=(3, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g)
    return dnp.array(t, engine=eng), t


BINARY = [
    ("add", lambda a, b: a + b),
    ("sub", lambda a, b: a - b),
    ("mul", lambda a, b: a * b),
    ("div", lambda a, b: a / (abs(b) + 1)),
    ("pow", lambda a, b: a.abs() ** b),
    ("lt", lambda a, b: a < b),
    ("ge", lambda a, b: a >= b),
    ("eq", lambda a, b: a == b),
    ("ne", lambda a, b: a != b),
]


@pytest.mark.parametrize("name,f", BINARY, ids=[n for n, _ in BINARY])
def test_binary_ops_match_torch(eng, name, f):
    (a, ta), (b, tb) = _pair(eng, seed=1), _pair(eng, seed=2)
    torch.testing.assert_close(f(a, b).tensor(), f(ta, tb))
    torch.testing.assert_close(f(a, 0.5).tensor(), f(ta, 0.5))


def test_reflected_unary_and_matmul_match_torch(eng):
    a, ta = _pair(eng, (4, 4), seed=3)
    torch.testing.assert_close((2 - a).tensor(), 2 - ta)
    torch.testing.assert_close((3 / (a.abs() + 1)).tensor(), 3 / (ta.abs() + 1))
    torch.testing.assert_close((1 + a * 2).tensor(), 1 + ta * 2)
    torch.testing.assert_close((-a).tensor(), -ta)
    torch.testing.assert_close(abs(a).tensor(), ta.abs())
    torch.testing.assert_close((a @ a).tensor(), ta @ ta)
    torch.testing.assert_close(dnp.dot(a, a).tensor(), ta @ ta)
    torch.testing.assert_close(a.dot(a).tensor(), ta @ ta)
    torch.testing.assert_close((ta @ a).tensor(), ta @ ta)  # tensor @ Array goes through the engine too


def test_torch_functions_and_methods_match_torch(eng):
    a, ta = _pair(eng, (2, 3), seed=4)
    b, tb = _pair(eng, (2, 3), seed=5)
    torch.testing.assert_close(torch.exp(a).tensor(), torch.exp(ta))
    torch.testing.assert_close(torch.cat([a, b], dim=0).tensor(), torch.cat([ta, tb], dim=0))
    torch.testing.assert_close(torch.nn.functional.relu(a).tensor(), torch.relu(ta))
    torch.testing.assert_close(a.sum(dim=1).tensor(), ta.sum(dim=1))
    torch.testing.assert_close(a.reshape(3, 2).tensor(), ta.reshape(3, 2))
    torch.testing.assert_close(a.t().mean().tensor(), ta.t().mean())
    torch.testing.assert_close(a[1, 1:].tensor(), ta[1, 1:])
    assert isinstance(torch.exp(a), Array)
    assert a.sum().item() == pytest.approx(ta.sum().item())


def test_inplace_and_setitem_keep_program_order(eng):
    a, ta = _pair(eng, (3, 3), seed=6)
    before = a * 1
    a += 1
    a *= 2
    a[0] = 0.0
    a.clamp_(min=-1.0)
    expected = ((ta + 1) * 2)
    expected[0] = 0.0
    expected.clamp_(min=-1.0)
    torch.testing.assert_close(a.tensor(), expected)
    torch.testing.assert_close(before.tensor(), ta)  # read before the writes, value from then


def test_creation_functions(eng):
    assert dnp.ones((2, 3), engine=eng).tolist() == [[1.0] * 3] * 2
    assert dnp.zeros(2, engine=eng).tolist() == [0.0, 0.0]
    assert dnp.arange(4, engine=eng).tolist() == [0, 1, 2, 3]
    n = dnp.random.normal(2.0, 0.5, size=(2000,), engine=eng).tensor()
    assert n.shape == (2000,) and abs(n.mean().item() - 2.0) < 0.1 and abs(n.std().item() - 0.5) < 0.1
    u = dnp.random.uniform(1.0, 2.0, size=(500,), engine=eng).tensor()
    assert u.min() >= 1.0 and u.max() < 2.0
    src = numpy.arange(3.0)
    arr = dnp.array(src, engine=eng)
    src[0] = 99.0  # the array holds a copy
    assert arr.tolist() == [0.0, 1.0, 2.0]


def test_blocking_conversions(eng):
    x = dnp.ones((1, 2), engine=eng)
    z = x * x + 2
    assert repr(z) == "array([[3., 3.]], device=cpu(0))"
    numpy.testing.assert_array_equal(z.asnumpy(), numpy.full((1, 2), 3.0, dtype=numpy.float32))
    numpy.testing.assert_array_equal(numpy.asarray(z), numpy.full((1, 2), 3.0))
    assert z.shape == (1, 2) and z.dtype == torch.float32 and len(z) == 1
    assert float(z.sum()) == 6.0 and int(z.sum()) == 6 and bool(z.sum() > 0)
    assert [r.tolist() for r in z] == [[3.0, 3.0]]


def test_copies_between_logical_cpu_devices_are_tagged(eng):
    a, ta = _pair(eng, (2, 2), seed=7)
    b = a.copyto(cpu(1))
    c = b * 2
    assert b.device == cpu(1) and c.device == cpu(1)
    assert device_of(c.tensor()) == cpu(1)
    torch.testing.assert_close(c.tensor(), ta * 2)
    assert b.as_in(cpu(1)) is b and dnp.as_in(a, cpu(0)) is a
    with pytest.raises(DeviceMismatchError, match="cpu\\(0\\) and cpu\\(1\\)"):
        a + b


def test_errors_surface_at_blockers_and_skip_dependents(eng):
    a = dnp.ones((2, 3), engine=eng)
    bad = a @ a  # shape mismatch, raised inside the engine
    worse = bad + 1
    fine = a + 1
    assert fine.tolist() == [[2.0] * 3] * 2
    with pytest.raises(RuntimeError):
        worse.tensor()
    with pytest.raises(RuntimeError):
        print(bad)
    eng.waitall()  # already reported


def test_bulk_gives_same_values(eng):
    x, tx = _pair(eng, (1, 2), seed=8)
    with eng.bulk(16):
        y = x
        for _ in range(100):
            y = y + 1
    torch.testing.assert_close(y.tensor(), tx + 100)


def test_frontend_returns_before_work_is_done():
    import threading

    gate = threading.Event()
    with create_engine() as eng:
        v = eng.new_var()
        x = dnp.ones(2, engine=eng)
        eng.push(gate.wait, args=(10,), reads=[x._var], writes=[v])
        x += 1  # must wait for the gate op, which reads x: still the frontend returns at once
        y = x * 3
        assert not gate.is_set()
        gate.set()
        assert y.tolist() == [6.0, 6.0]


# ------------------------------------------------------------------------------------------ no aliasing
def test_a_slice_read_before_a_write_to_its_base_keeps_its_value(eng):
    for _ in range(20):  # the threaded engine used to race here: the slice shared the base's memory
        a = dnp.ones((4,), engine=eng)
        b = a[0:2]
        c = b * 2
        a += 1
        assert c.tolist() == [2.0, 2.0]
        assert b.tolist() == [1.0, 1.0]
        assert a.tolist() == [2.0] * 4


VIEWS = [
    ("getitem", lambda x: x[1:, ::2]),
    ("getitem_int", lambda x: x[0]),
    ("view", lambda x: x.view(12)),
    ("reshape", lambda x: x.reshape(4, 3)),
    ("t", lambda x: x.t()),
    ("transpose", lambda x: x.transpose(0, 1)),
    ("permute", lambda x: x.permute(1, 0)),
    ("narrow", lambda x: x.narrow(1, 1, 2)),
    ("expand", lambda x: x[:1].expand(3, 4)),
    ("unsqueeze", lambda x: x.unsqueeze(0)),
    ("flatten", lambda x: x.flatten()),
    ("diagonal", lambda x: x.diagonal()),
    ("detach", lambda x: x.detach()),
    ("contiguous", lambda x: x.contiguous()),  # returns its input itself when already contiguous
    ("to_same_dtype", lambda x: x.to(torch.float32)),
    ("torch_select", lambda x: torch.select(x, 0, 1)),
    ("split", lambda x: x.split(2, dim=1)),
    ("unbind", lambda x: x.unbind(0)),
]


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


@pytest.mark.parametrize("name,f", VIEWS, ids=[n for n, _ in VIEWS])
def test_view_results_are_independent_of_their_base_in_both_directions(eng, name, f):
    for seed in range(5):
        a, ta = _pair(eng, (3, 4), seed=seed)
        r = f(a)
        first = [t.clone() for t in _as_tuple(f(ta))]  # value when r was taken: NumPy-copy semantics
        a += 1
        a[0] = 7.0
        a.mul_(2)
        base = ta + 1
        base[0] = 7.0
        base *= 2
        if len(first) == 1:
            r.add_(100)  # a write to the result must not reach its base either
            first = [t + 100 for t in first]
        got = _as_tuple(r.tensor())
        assert len(got) == len(first)
        for g, want in zip(got, first):
            torch.testing.assert_close(g, want)
        torch.testing.assert_close(a.tensor(), base)
        base_ptr = a.tensor().untyped_storage().data_ptr()
        assert all(g.untyped_storage().data_ptr() != base_ptr for g in got)


# ------------------------------------------------------------------------------------------ torch readers
def _gated(eng, x):
    """Hold every operation on ``x`` behind an event that opens 0.2 s later (join the timer)."""
    import threading

    gate = threading.Event()
    timer = threading.Timer(0.2, gate.set)
    timer.start()  # before the push: the naive engine runs the gate in the pushing thread
    eng.push(gate.wait, args=(10,), writes=[x._var], name="gate")
    return gate, timer


def _twin(net):
    import copy

    return copy.deepcopy(net)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wait", [True, False], ids=["backward", "backward(wait=False)"])
def test_optimizer_step_after_engine_backward_matches_eager(eng, wait):
    # The reported lost update: step() ran before the gradients existed and silently did nothing.
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    ref = _twin(net)
    opt, ref_opt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        X = torch.randn(16, 64)
        x = dnp.array(X, engine=eng)
        gate, timer = _gated(eng, x)
        loss = net(x).pow(2).mean()
        loss.backward(wait=wait)
        opt.step()  # must wait for the pending backward
        opt.zero_grad()
        timer.join()
        assert gate.is_set()
        ref(X).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.timeout(60)
def test_grad_read_right_after_backward_is_the_finished_gradient(eng):
    torch.manual_seed(2)
    net = torch.nn.Linear(20, 5)
    ref = _twin(net)
    X = torch.randn(8, 20)
    x = dnp.array(X, engine=eng)
    _, timer = _gated(eng, x)
    net(x).tanh().sum().backward()  # raw .grad access cannot be intercepted: backward waits itself
    grad = net.weight.grad.clone()
    timer.join()
    ref(X).tanh().sum().backward()
    torch.testing.assert_close(grad, ref.weight.grad)


@pytest.mark.timeout(60)
def test_state_dict_and_eager_forward_wait_for_pending_engine_writes(eng):
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4))
    ref = _twin(net)
    X = torch.randn(10, 6)
    x = dnp.array(X, engine=eng)
    _, timer = _gated(eng, x)
    y = net(x)  # train mode: BatchNorm updates its running statistics on the worker
    state = {k: v.clone() for k, v in net.state_dict().items()}
    timer.join()
    ref_y = ref(X)
    torch.testing.assert_close(y.tensor(), ref_y)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, msg=k)
    new_w = torch.randn(4, 6)
    w = dnp.array(new_w, engine=eng)
    _, timer = _gated(eng, w)
    with torch.no_grad():
        net[0].weight.copy_(w)  # an engine write of a parameter
    Z = torch.randn(3, 6)
    out = net[0](Z)  # an eager call with plain tensors waits for it
    timer.join()
    torch.testing.assert_close(out, torch.nn.functional.linear(Z, new_w, net[0].bias))


@pytest.mark.timeout(60)
def test_a_failed_backward_is_reported_once_and_training_goes_on(eng):
    torch.manual_seed(4)
    net = torch.nn.Linear(5, 1)
    ref = _twin(net)
    opt, ref_opt = torch.optim.SGD(net.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    X = torch.randn(4, 5)
    loss = net(dnp.array(X, engine=eng)).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    opt.zero_grad()
    net(dnp.array(X, engine=eng)).sum().backward(wait=False)
    opt.step()
    ref(X).sum().backward()
    ref_opt.step()
    torch.testing.assert_close(net.weight, ref.weight)


def test_no_grad_at_push_time_is_the_mode_the_operation_runs_in(eng):
    net = torch.nn.Linear(3, 2)
    x = dnp.ones((1, 3), engine=eng)
    with torch.no_grad():
        y = net(x)
        z = x * 2
    assert not y.tensor().requires_grad and not z.tensor().requires_grad
    assert net(x).tensor().requires_grad


def test_attach_grad_leaf_gets_its_gradient(eng):
    X = torch.randn(3, 2)
    x = dnp.array(X, engine=eng)
    assert x.grad is None  # MXNet: no gradient before attach_grad
    x.attach_grad()
    assert x.grad.tolist() == [[0.0, 0.0]] * 3  # MXNet: zeros before any backward
    (x * x).sum().backward(wait=False)
    torch.testing.assert_close(x.grad.tensor(), 2 * X)


@pytest.mark.timeout(60)
def test_hooks_leave_once_no_open_engine_tracks_a_tensor():
    from dlperf.engine.external import hooks_installed

    net = torch.nn.Linear(2, 2)
    with create_engine() as e:
        net(dnp.ones((1, 2), engine=e)).sum().backward()
        assert hooks_installed()
    net(torch.ones(1, 2))  # the first outside reader after the close removes them
    assert not hooks_installed()


# ------------------------------------------------------------------------------------------ waitall
@pytest.mark.timeout(60)
def test_module_waitall_waits_for_engines_made_with_create_engine():
    import threading

    from dlperf.engine import waitall

    gate, box = threading.Event(), []
    with create_engine() as a, create_engine() as b:
        a.push(gate.wait, args=(10,))
        b.push(lambda: (gate.wait(10), box.append("b")))
        closed = create_engine()
        closed.close()  # closed engines are skipped, not an error
        timer = threading.Timer(0.2, gate.set)
        timer.start()
        waitall()
        assert box == ["b"]
        dnp.waitall()  # the array namespace's barrier is the same
        timer.join()


# ------------------------------------------------------------------------------------------ NumPy/MXNet names
def test_ctx_is_device_and_context_ctx_properties(eng):
    a = dnp.ones((2, 3), ctx=cpu(1), engine=eng)
    assert a.context == a.ctx == a.device == cpu(1)
    assert dnp.random.uniform(size=(2, 2), ctx="cpu:1", engine=eng).device == cpu(1)
    assert dnp.array([1.0], ctx=cpu(1), device="cpu:1", engine=eng).device == cpu(1)
    with pytest.raises(dlperf_usage_error(), match="ctx"):
        dnp.zeros(2, device=cpu(0), ctx=cpu(1), engine=eng)


def dlperf_usage_error():
    from dlperf.errors import UsageError

    return UsageError


def test_namespace_functions_match_numpy(eng):
    g = numpy.random.default_rng(5)
    A, B = g.normal(size=(3, 4)).astype("float32"), g.normal(size=(3, 4)).astype("float32")
    a, b = dnp.array(A, engine=eng), dnp.array(B, engine=eng)
    checks = {
        "exp": (dnp.exp(a), numpy.exp(A)),
        "sum": (dnp.sum(a), A.sum()),
        "sum axis": (dnp.sum(a, axis=1), A.sum(axis=1)),
        "sum keepdims": (dnp.sum(a, keepdims=True), A.sum(keepdims=True)),
        "mean axis": (dnp.mean(a, axis=0, keepdims=True), A.mean(axis=0, keepdims=True)),
        "max": (dnp.max(a, axis=1), A.max(axis=1)),
        "min": (dnp.min(a), A.min()),
        "maximum": (dnp.maximum(a, b), numpy.maximum(A, B)),
        "maximum scalar": (dnp.maximum(0, a), numpy.maximum(0, A)),
        "minimum": (dnp.minimum(a, 0.5), numpy.minimum(A, 0.5)),
        "relu": (dnp.relu(a), numpy.maximum(A, 0)),
        "concatenate": (dnp.concatenate([a, b], axis=1), numpy.concatenate([A, B], axis=1)),
        "stack": (dnp.stack([a, b]), numpy.stack([A, B])),
        "T": (a.T, A.T),
        "transpose": (dnp.transpose(a, (1, 0)), A.transpose(1, 0)),
        "reshape": (dnp.reshape(a, (4, 3)), A.reshape(4, 3)),
        "full": (dnp.full((2, 2), 7.5, engine=eng), numpy.full((2, 2), 7.5, dtype="float32")),
        "ones_like": (dnp.ones_like(a), numpy.ones_like(A)),
        "zeros_like": (dnp.zeros_like(a), numpy.zeros_like(A)),
        "abs sqrt log": (dnp.log(dnp.sqrt(dnp.abs(a) + 1)), numpy.log(numpy.sqrt(numpy.abs(A) + 1))),
    }
    for name, (got, want) in checks.items():
        assert got.shape == want.shape, name
        numpy.testing.assert_allclose(got.asnumpy(), want, rtol=1e-5, atol=1e-6, err_msg=name)
    assert dnp.empty((2, 5), engine=eng).shape == (2, 5)


def test_copyto_an_array_overwrites_it(eng):
    a = dnp.array([[1.0, 2.0]], engine=eng)
    b = dnp.zeros((1, 2), ctx=cpu(1), engine=eng)
    assert a.copyto(b) is b
    a += 1  # after the copy was pushed: b keeps the old values
    assert b.tolist() == [[1.0, 2.0]] and b.device == cpu(1)
    with pytest.raises(dlperf_usage_error(), match="same shape"):
        a.copyto(dnp.zeros(3, engine=eng)).tensor()


@pytest.mark.timeout(60)
def test_shape_dtype_ndim_len_do_not_wait_for_the_value():
    import threading

    gate = threading.Event()
    with create_engine() as eng:
        x = dnp.random.normal(size=(5, 7), engine=eng)
        eng.push(gate.wait, args=(10,), writes=[x._var])
        w = torch.nn.Linear(7, 3)
        y = dnp.concatenate([w(x).T, dnp.sum(x, axis=0, keepdims=True)[:, :5]], axis=0)
        z = (y.dot(x) > 0).T
        # None of these may block: the gate is still closed.
        assert y.shape == (4, 5) and z.shape == (7, 4) and z.dtype == torch.bool
        assert z.ndim == 2 and len(z) == 7 and x.shape == (5, 7)
        assert not gate.is_set()
        gate.set()
        assert tuple(z.tensor().shape) == (7, 4)


def test_shape_after_an_inplace_reshape_waits_for_the_value(eng):
    a = dnp.ones((2, 3), engine=eng)
    a.resize_(3, 3)
    assert a.shape == (3, 3)
    b = dnp.ones((2, 3), engine=eng)
    assert b.unsqueeze(0).shape == (1, 2, 3)


@pytest.mark.timeout(60)
def test_a_hybridized_module_on_engine_arrays_is_one_operation_and_readers_wait_for_it(eng):
    from dlperf.hybrid import hybridize

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU())
    ref = _twin(model)
    net = hybridize(model, backend="graph")
    opt, ref_opt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        X = torch.randn(8, 6)
        x = dnp.array(X, engine=eng)
        _, timer = _gated(eng, x)
        y = net(x)
        state = {k: v.clone() for k, v in net.state_dict().items()}  # waits for the pending call
        y.sum().backward()
        opt.step()
        timer.join()
        ref_y = ref(X)
        ref_state = {k: v.clone() for k, v in ref.state_dict().items()}
        ref_y.sum().backward()
        ref_opt.step()
        torch.testing.assert_close(y.tensor(), ref_y)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, msg=k)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_the_array_namespace_keeps_every_public_name():
    from dlperf.engine import ndarray

    for name in dnp.__all__:
        assert getattr(dnp, name) is not None, name
    assert dnp.Array is Array is ndarray.Array
    assert dnp.call_module is not None  # hybridize's entry point
    for dunder in ("__add__", "__rsub__", "__lt__", "__eq__", "__iadd__", "__matmul__"):
        assert getattr(Array, dunder).__name__ == dunder


def test_operator_methods_label_their_operations_as_before(eng):
    eng.start_trace()
    a = dnp.ones(2, engine=eng)
    b = a + 1  # noqa: F841
    c = 2 - a  # noqa: F841
    d = a < a  # noqa: F841
    a += 1
    eng.waitall()
    names = [e.name for e in eng.stop_trace().events]
    assert names == ["ones", "add", "sub", "lt", "add_"]

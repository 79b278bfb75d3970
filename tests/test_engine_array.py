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

"""What MXNet 1.9.1's test_engine.py, test_exc_handling.py and the array tests expect, asked of dlperf's engine
arrays (``dlperf.engine.array``, d2l's ``mxnet.np`` with dlperf's names).

MXNet raises an operation's runtime error where its value is waited for (``asnumpy``, ``wait_to_read``,
``waitall``), but a shape that cannot be at the call, because it infers shapes as it pushes. Iterating an
array is one of the blockers listed in dlperf's own module docstring: it waits for the value.
"""

from __future__ import annotations

import pytest
import torch

from dlperf.engine import array as dnp
from dlperf.engine import create_engine
from dlperf.errors import ShapeError


@pytest.fixture
def eng():
    with create_engine() as e:
        yield e


# -- test_engine.py: test_bulk ----------------------------------------------------------------------------
def test_bulk(eng):
    with eng.bulk(10):
        x = dnp.ones((10,), engine=eng)
        x *= 2
        x += 1
        x.wait_to_read()
        x += 1
        assert (x.asnumpy() == 4).all()
        for _ in range(100):
            x += 1
    assert (x.asnumpy() == 104).all()


# -- test_exc_handling.py ---------------------------------------------------------------------------------
def test_np_reshape_exception(eng):
    a = dnp.ones((10, 10), engine=eng)
    a.reshape((-1,)).asnumpy()  # no raise
    for bad in (lambda: a.reshape((1,)), lambda: dnp.reshape(a, (1,)), lambda: dnp.reshape(a, (-1, 3)),
                lambda: a.view(3, 3), lambda: (a * 2).reshape(7)):  # a pending result's shape is inferred
        with pytest.raises(ShapeError, match="cannot give an array of shape \\(10, 10\\) \\(100 elements\\)") as info:
            bad()
        assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)
    eng.waitall()  # nothing was pushed that fails later


def test_a_shape_known_only_from_the_value_fails_where_the_value_is_waited_for(eng):
    a = dnp.ones((2, 3), engine=eng)
    a.resize_(3, 4)  # an in-place change of shape: known from the value only
    b = a.reshape(5)  # not waited for at the call
    with pytest.raises(RuntimeError, match="invalid for input of size 12"):
        b.wait_to_read()


def test_exc_imperative(eng):
    def imperative(exec_numpy: bool) -> None:
        a = dnp.random.normal(0, 1, (2, 2), engine=eng)
        b = dnp.random.normal(0, -1, (2, 2), engine=eng)  # a negative scale fails when it runs
        c = dnp.dot(a, b)
        if exec_numpy:
            c.asnumpy()

    imperative(exec_numpy=False)  # pushing raises nothing
    with pytest.raises(RuntimeError):
        imperative(exec_numpy=True)
    with pytest.raises(RuntimeError):
        eng.waitall()  # the first call's failure, reported by the wait for everything


def test_np_random_incorrect_named_arguments():
    for op_name in ("uniform", "normal", "randint", "choice"):
        op = getattr(dnp.random, op_name, None)
        assert op is not None, op_name
        with pytest.raises(TypeError):
            op(shape=())
        with pytest.raises(TypeError):
            op(shape=None)


# -- np.random.randint and np.random.choice ----------------------------------------------------------------
def test_randint_draws_from_the_half_open_range(eng):
    x = dnp.random.randint(3, 7, size=(50, 4), engine=eng)
    assert x.shape == (50, 4) and x.dtype == torch.int64
    values = x.tensor()
    assert int(values.min()) >= 3 and int(values.max()) <= 6 and len(values.unique()) == 4
    y = dnp.random.randint(2, size=1000, engine=eng, dtype=torch.int32)  # [0, 2), as NumPy's randint(2)
    assert y.dtype == torch.int32 and set(y.tolist()) == {0, 1}
    with pytest.raises(ValueError, match="low=5 >= high=5"):
        dnp.random.randint(5, 5)


def test_choice_of_an_integer_and_of_an_array(eng):
    assert sorted(dnp.random.choice(6, size=6, replace=False, engine=eng).tolist()) == list(range(6))
    values = dnp.array([10.0, 20.0, 30.0], engine=eng)
    drawn = dnp.random.choice(values, size=(20, 2))
    assert drawn.shape == (20, 2) and set(drawn.tensor().flatten().tolist()) <= {10.0, 20.0, 30.0}
    assert set(dnp.random.choice(3, size=50, p=[0.0, 0.0, 1.0], engine=eng).tolist()) == {2}
    assert dnp.random.choice(4, engine=eng).shape == ()  # one draw, as NumPy's choice(4)


@pytest.mark.parametrize("call,match", [
    (lambda: dnp.random.choice(3, size=4, replace=False), "4 samples without replacement from 3 elements"),
    (lambda: dnp.random.choice(3, p=[0.5, 0.5]), "is not 3 probabilities"),
    (lambda: dnp.random.choice(3, p=[0.5, 0.6, -0.1]), "is not 3 probabilities"),
    (lambda: dnp.random.choice(0), "a has 0 elements"),
    (lambda: dnp.random.choice("abc"), "a is str"),
])
def test_choice_refuses_what_numpy_refuses_at_the_call(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# -- .grad ---------------------------------------------------------------------------------------------
def test_grad_is_none_unless_attach_grad_made_a_leaf(eng):
    x = dnp.array([[1.0, 2.0]], engine=eng)
    assert x.grad is None  # MXNet: NDArray.grad is None before attach_grad
    y = x * 2
    assert y.grad is None
    x.attach_grad()
    assert x.grad.tolist() == [[0.0, 0.0]]  # attach_grad gives zeros until a backward
    z = (x * x).sum()
    z.backward()
    assert x.grad.tolist() == [[2.0, 4.0]]
    assert z.grad is None  # computed, not a leaf


# -- iteration ------------------------------------------------------------------------------------------
def test_iterating_gives_the_rows_of_the_value(eng):
    x = dnp.array([[1, 2], [3, 4], [5, 6]], engine=eng) * 2
    assert [row.tolist() for row in x] == [[2, 4], [6, 8], [10, 12]]


def test_iterating_waits_for_the_value_and_raises_its_error_there(eng):
    x = dnp.random.normal(0, -1, (2, 2), engine=eng)  # fails when it runs
    with pytest.raises(RuntimeError):
        iter(x)  # the iteration itself, before any row is read

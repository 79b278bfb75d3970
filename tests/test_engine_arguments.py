"""Misuse of the engine's public calls gives one clear error naming the argument, and changes nothing."""

from __future__ import annotations

import time

import numpy
import pytest

from dlperf.devices import cpu
from dlperf.engine import (
    EngineArgumentError,
    EngineConfig,
    InFlight,
    bounded,
    create_engine,
    register_engine,
)
from dlperf.engine import array as dnp
from dlperf.engine.threaded import ThreadedEngine
from dlperf.errors import UsageError

KINDS = ["threaded", "naive"]


@pytest.fixture(params=KINDS)
def eng(request):
    with create_engine(request.param) as e:
        yield e


def _refused(call, *words):
    with pytest.raises(EngineArgumentError) as info:
        call()
    err = info.value
    assert isinstance(err, TypeError) and isinstance(err, ValueError) and isinstance(err, UsageError)
    text = str(err)
    assert "\n" not in text
    for word in words:
        assert word in text, (word, text)
    return text


def test_push_refuses_names_instead_of_variables(eng):
    text = _refused(lambda: eng.push(print, writes=["x"]), "push", "writes[0]", "'x'", "new_var")
    assert text.startswith("push: writes[0] is str 'x'; expected")
    _refused(lambda: eng.push(print, reads=[eng.new_var(), 3]), "reads[1]", "int 3")


def test_push_refuses_a_single_variable_or_array_where_a_collection_goes(eng):
    v = eng.new_var("v")
    _refused(lambda: eng.push(print, writes=v), "writes", "not a collection", "writes=[v]")
    a = dnp.ones(2, engine=eng)
    _refused(lambda: eng.push(print, reads=a), "reads", "not a collection")
    _refused(lambda: eng.push(print, reads="ab"), "reads", "'ab'")
    _refused(lambda: eng.push(print, reads=5), "reads", "int 5", "not iterable")


def test_push_refuses_an_op_handle_as_a_variable(eng):
    op = eng.push(lambda: 1)
    _refused(lambda: eng.push(print, reads=[op]), "reads[0]", "operation handle", "op.wait()")


def test_push_refuses_bad_fn_args_priority_and_name(eng):
    _refused(lambda: eng.push("f"), "push", "fn", "'f'", "cannot be called")
    _refused(lambda: eng.push(None), "fn", "None")
    _refused(lambda: eng.push(print, args=3), "args=3", "tuple")
    _refused(lambda: eng.push(print, priority=1.5), "priority", "1.5", "integer")
    _refused(lambda: eng.push(print, priority=True), "priority", "True")
    _refused(lambda: eng.push(print, priority="high"), "priority", "'high'")
    _refused(lambda: eng.push(print, name=7), "name=7", "string")


def test_a_bad_device_or_kind_is_a_usage_error(eng):
    with pytest.raises(UsageError, match="device 'tpu'"):
        eng.push(print, device="tpu")
    with pytest.raises(UsageError, match="operation kind 'fast'"):
        eng.push(print, kind="fast")


def test_a_refused_push_changes_nothing(eng):
    v = eng.new_var("v")
    box = []
    eng.push(box.append, args=(1,), writes=[v])
    _refused(lambda: eng.push(box.append, args=(2,), reads=[v], writes=[v, "x"]), "writes[1]")
    eng.push(box.append, args=(3,), writes=[v])
    eng.wait_to_read(v)
    eng.waitall()
    assert box == [1, 3]
    assert repr(v).endswith("idle)")


def test_push_accepts_what_it_accepted_and_arrays_for_their_variables(eng):
    v, w = eng.new_var("v"), eng.new_var("w")
    out = []
    assert eng.push(out.append, args=[1], reads=(v,), writes=[w]).wait() is None  # args as a list
    assert eng.push(out.append, args=(2,), reads=(x for x in [v]), writes={w: None}).wait() is None
    assert eng.push(out.append, args=(3,), reads=[v], writes=[v]).wait() is None  # read and written: a write
    assert eng.push(out.append, args=(4,), priority=numpy.int64(2), device="cpu(0)").wait() is None
    a = dnp.ones(2, engine=eng)
    assert eng.push(lambda: a.tensor().sum().item(), reads=[a]).wait() == 2.0
    # A push that writes an array is ordered with the array's own operations: a wait for it waits.
    b = a + 1
    eng.push(lambda: (time.sleep(0.05), out.append(5)), reads=[a], writes=[b])
    eng.wait_to_read(b)
    assert out == [1, 2, 3, 4, 5]


def test_push_refuses_an_array_of_another_engine(eng):
    with create_engine("naive") as other:
        a = dnp.ones(2, engine=other)
        _refused(lambda: eng.push(print, reads=[a]), "reads[0]", "another engine")


def test_waits_refuse_what_is_not_a_variable_array_or_op(eng):
    _refused(lambda: eng.wait_to_read("x"), "wait_to_read", "'x'")
    _refused(lambda: eng.wait_to_write(3), "wait_to_write", "int 3")
    _refused(lambda: eng.wait_op(None), "wait_op", "NoneType")
    a = dnp.ones(2, engine=eng)
    eng.wait_to_write(a)  # an array stands for its variable
    eng.wait_to_read(a)


@pytest.mark.parametrize("size", [0, -1, 2.5, True, "8", None])
def test_bulk_refuses_a_size_that_is_not_a_positive_integer(eng, size):
    def enter():
        with eng.bulk(size):
            pass

    _refused(enter, "bulk", "size")
    with eng.bulk(2):  # still usable
        op = eng.push(lambda: 9)
    assert op.wait() == 9


@pytest.mark.parametrize("k", [0, -3, 1.0, False, "2", None])
def test_in_flight_refuses_a_bad_bound(eng, k):
    _refused(lambda: InFlight(k, engine=eng), "InFlight", "k")


def test_in_flight_refuses_a_bad_engine_and_marker(eng):
    _refused(lambda: InFlight(2, engine="threaded"), "InFlight", "engine", "str")
    window = InFlight(2, engine=eng)
    _refused(lambda: window.submit("loss"), "InFlight.submit", "marker", "'loss'")
    window.submit(eng.push(lambda: 1))  # an op, a variable and an array still count
    window.submit(eng.new_var())
    window.submit(dnp.ones(1, engine=eng))
    window.drain()


def test_bounded_refuses_a_step_that_cannot_be_called(eng):
    _refused(lambda: list(bounded(range(3), "step", 2, eng)), "bounded", "step")


def test_new_var_refuses_a_name_that_is_not_a_string(eng):
    _refused(lambda: eng.new_var(3), "new_var", "name=3")


def test_create_engine_refuses_unknown_settings_and_a_bad_config():
    text = _refused(lambda: create_engine(cpu_thread=2), "create_engine", "'cpu_thread'")
    assert "cpu_threads" in text  # lists what exists
    _refused(lambda: create_engine(config={"trace": True}), "create_engine", "config", "dict")
    _refused(lambda: ThreadedEngine("fast"), "ThreadedEngine", "config", "str")


@pytest.mark.parametrize("field, value", [("cpu_threads", True), ("cpu_threads", 0), ("max_queued", 1.5),
                                          ("batch_latency_us", float("nan")), ("batch_latency_us", "50"),
                                          ("batch_latency_us", -1), ("trace", "yes"), ("auto_bulk", -1)])
def test_engine_config_refuses_bad_fields(field, value):
    with pytest.raises(UsageError, match=field):
        EngineConfig(**{field: value})


def test_register_engine_refuses_what_is_not_an_engine_class():
    _refused(lambda: register_engine("mine", object), "register_engine", "subclass of Engine")
    _refused(lambda: register_engine("mine", "threaded"), "register_engine", "'threaded'")


def test_push_still_runs_on_a_logical_device_given_by_name(eng):
    assert eng.push(lambda: 2, device=cpu(1)).wait() == 2


def test_wait_for_refuses_one_tensor_and_what_is_not_a_tensor():
    import torch

    from dlperf.engine import wait_for

    p = torch.ones(3)
    _refused(lambda: wait_for(p), "wait_for", "one tensor", "wait_for([p])")
    _refused(lambda: wait_for(5), "wait_for", "int")
    _refused(lambda: wait_for([p, "w"]), "wait_for", "tensors[1]", "str")
    _refused(lambda: wait_for([p], write="yes"), "wait_for", "write='yes'")
    wait_for([p])
    wait_for(torch.nn.Linear(2, 2), write=False)


@pytest.mark.parametrize("shape", ["x", (2, "3"), (2, -1), 2.5, True, [[2]]])
def test_array_factories_refuse_a_bad_shape_at_the_call(eng, shape):
    _refused(lambda: dnp.ones(shape, engine=eng), "ones", "shape")
    _refused(lambda: dnp.random.normal(size=shape, engine=eng), "random.normal", "shape")


def test_array_factories_take_the_shapes_they_took(eng):
    assert dnp.zeros((2, 3), engine=eng).shape == (2, 3)
    assert dnp.ones(numpy.int64(4), engine=eng).shape == (4,)
    assert dnp.empty([1, numpy.int32(2)], engine=eng).shape == (1, 2)
    assert dnp.full(None, 7.0, engine=eng).tolist() == 7.0
    assert dnp.reshape(dnp.ones(6, engine=eng), (2, -1)).shape == (2, 3)  # -1: inferred, as NumPy's


def test_array_functions_refuse_what_is_not_an_engine_array_or_engine(eng):
    _refused(lambda: dnp.ones(2, engine="threaded"), "ones", "engine", "str")
    _refused(lambda: dnp.copy_to(3, "cpu"), "copy_to", "int")
    _refused(lambda: dnp.waitall("all"), "waitall", "str")
    with pytest.raises(UsageError, match="dot got no engine array"):
        dnp.dot(1, 2)
    a = dnp.array([1.0, 2.0], engine=eng)
    assert dnp.dot(a, a).item() == 5.0

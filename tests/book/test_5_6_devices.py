"""d2l 5.6 (GPUs) with dlperf's names.

MXNet's ``npx.cpu()``/``npx.gpu(i)`` are ``cpu()``/``gpu(i)``; ``ctx=`` is ``device=``; an
``ndarray`` is a ``dlperf.engine.array`` array (asynchronous, like MXNet's) or a torch tensor placed
with ``as_in``/``copy_to``; ``copyto`` is ``copy_to`` and ``as_in_ctx`` is ``as_in``. The section
needs two GPUs; ``try_all_gpus(2)`` stands in for ``[try_gpu(0), try_gpu(1)]`` and gives logical
CPU devices on a machine without them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dlperf.devices import as_in, copy_to, cpu, device_of, gpu, num_gpus, try_all_gpus, try_gpu
from dlperf.engine import array as np
from dlperf.engine import create_engine
from dlperf.errors import DeviceMismatchError


@pytest.fixture
def engine():
    with create_engine() as eng:
        yield eng


def test_devices_print_as_in_the_book():
    assert (cpu(), gpu(), gpu(1)) == (cpu(0), gpu(0), gpu(1))
    assert repr((cpu(), gpu(), gpu(1))) == "(cpu(0), gpu(0), gpu(1))"
    assert num_gpus() == torch.cuda.device_count()


def test_try_gpu_and_try_all_gpus_fall_back_to_the_cpu():
    n = num_gpus()
    assert try_gpu() == (gpu(0) if n else cpu(0))
    assert try_gpu(3) == (gpu(3) if n > 3 else cpu(0))
    assert try_all_gpus() == ([gpu(i) for i in range(n)] or [cpu(0)])
    # the book's list of k devices repeats cpu(0) without GPUs; try_all_gpus(k) never does
    assert len(set(try_all_gpus(2))) == 2


def test_arrays_are_created_on_the_cpu_by_default(engine):
    x = np.array([1, 2, 3], engine=engine)
    assert x.device == cpu(0)


def test_storage_on_a_device_and_adding_across_devices_fails(engine):
    d0, d1 = try_all_gpus(2)
    x = np.ones((2, 3), device=d0, engine=engine)
    y = np.random.uniform(size=(2, 3), device=d1, engine=engine)
    assert (x.device, y.device) == (d0, d1)
    assert repr(x).startswith("array([[1., 1., 1.],") and repr(x).endswith(f"device={d0})")
    with pytest.raises(DeviceMismatchError, match="as_in"):
        x + y  # noqa: B018  the engine does not know where to compute it


def test_copyto_then_add_on_the_second_device(engine):
    d0, d1 = try_all_gpus(2)
    x = np.ones((2, 3), device=d0, engine=engine)
    y = np.random.uniform(size=(2, 3), device=d1, engine=engine)
    z = x.copyto(d1)
    assert z.device == d1 and x.device == d0
    s = y + z  # the result is where its operands are
    assert s.device == d1
    torch.testing.assert_close(s.tensor().cpu(), y.tensor().cpu() + 1)


def test_as_in_ctx_is_a_no_op_when_already_there_and_copyto_always_copies(engine):
    d1 = try_all_gpus(2)[1]
    y = np.random.uniform(size=(2, 3), device=d1, engine=engine)
    assert y.as_in(d1) is y
    assert y.copyto(d1) is not y
    z = np.ones((2, 3), engine=engine).as_in(d1)
    assert z.device == d1


def test_the_same_rules_for_torch_tensors():
    d0, d1 = try_all_gpus(2)
    x = copy_to(torch.ones(2, 3), d0)
    y = copy_to(torch.rand(2, 3), d1)
    z = copy_to(x, d1)
    assert device_of(y + z) == d1  # MXNet places the result with its operands; so does dlperf
    assert as_in(y, d1) is y and copy_to(y, d1) is not y
    shared = as_in(y, d1)
    shared[0, 0] = 7.0
    assert y[0, 0] == 7.0  # as_in_ctx shares the memory when nothing moves


def test_a_model_on_a_device_computes_there():
    dev = try_all_gpus(2)[1]  # the book uses try_gpu(); the second device shows the placement
    torch.manual_seed(0)
    net = as_in(nn.Sequential(nn.Linear(3, 1)), dev)  # net.initialize(ctx=...)
    x = copy_to(torch.ones(2, 3), dev)
    out = net(x)
    assert out.shape == (2, 1) and device_of(out) == dev
    assert device_of(net[0].weight.data) == dev  # the parameters are stored on the same device
    out.sum().backward()
    assert device_of(net[0].weight.grad) == dev


def test_logging_on_the_device_then_one_transfer():
    # exercise 3's advice: keep the log where the work is and move it once
    dev = try_all_gpus(2)[1]
    ms = [copy_to(torch.eye(4) * (i + 1), dev) for i in range(3)]
    log = torch.stack([torch.trace(m @ m.T) for m in ms])
    assert device_of(log) == dev
    assert log.tolist() == [4.0, 16.0, 36.0]

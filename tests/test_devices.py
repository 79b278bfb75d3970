from __future__ import annotations

import pytest
import torch
from torch import nn

import dlperf
from dlperf.devices import (
    Device,
    as_in,
    check_same_device,
    copy_to,
    cpu,
    device_of,
    gpu,
    num_gpus,
    require_available,
    tag,
    to_device,
    try_all_gpus,
    try_gpu,
)
from dlperf.errors import DeviceMismatchError, DeviceUnavailableError, UsageError


@pytest.mark.parametrize("spec, expected", [
    ("cpu", cpu(0)), ("cpu:1", cpu(1)), ("cpu(2)", cpu(2)), ("CPU", cpu(0)),
    ("gpu", gpu(0)), ("gpu(1)", gpu(1)), ("gpu:3", gpu(3)), ("cuda:1", gpu(1)), ("cuda", gpu(0)),
    (torch.device("cpu"), cpu(0)), (torch.device("cuda", 2), gpu(2)), (cpu(4), cpu(4)),
])
def test_device_specs_parse(spec, expected):
    assert to_device(spec) == expected


@pytest.mark.parametrize("bad", ["xpu", "gpu(-1)", "cpu:x", "", "cuda:1:2", 3, "gpu(1", "cpu:1)"])
def test_bad_device_spec_names_the_value_and_the_valid_forms(bad):
    with pytest.raises(UsageError) as err:
        to_device(bad)
    assert repr(bad) in str(err.value) and "cpu:N" in str(err.value)


def test_repr_uses_d2l_names():
    assert repr(cpu()) == "cpu(0)" and str(gpu(1)) == "gpu(1)"
    assert cpu(1).torch_device == torch.device("cpu")
    assert gpu(1).torch_device == torch.device("cuda", 1)


def test_logical_cpu_devices_are_distinct():
    assert cpu(0) != cpu(1)
    assert len({cpu(0), cpu(1), cpu(0)}) == 2


def test_each_device_is_one_object_however_named():
    # The engine compares devices by identity on its hot paths.
    import copy
    import pickle

    for dev, names in ((cpu(1), (Device("cpu", 1), "cpu:1", "cpu(1)", torch.device("cpu", 1))),
                       (gpu(2), (Device("gpu", 2), "cuda:2", "gpu:2", torch.device("cuda", 2)))):
        for name in names:
            assert to_device(name) is dev
        assert pickle.loads(pickle.dumps(dev)) is dev
        assert copy.copy(dev) is dev and copy.deepcopy([dev])[0] is dev
    # stand-ins equal to an index are refused, and leave the shared object as it was
    for bad in (True, 1.0):
        with pytest.raises(UsageError, match="index"):
            Device("cpu", bad)
    assert type(cpu(1).index) is int and cpu(1).index == 1


def test_try_gpu_falls_back_to_cpu():
    assert try_gpu(num_gpus()) == cpu()
    assert try_gpu(10_000) == cpu()
    assert try_all_gpus() == ([gpu(i) for i in range(num_gpus())] or [cpu()])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without GPUs")
def test_absent_gpu_is_a_clear_error():
    with pytest.raises(DeviceUnavailableError, match=r"gpu\(0\) was requested but this machine has 0 GPUs"):
        require_available("gpu")
    with pytest.raises(DeviceUnavailableError, match="try_gpu"):
        copy_to(torch.ones(1), gpu(0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without GPUs")
def test_plain_cuda_device_without_cuda_is_a_clear_error():
    assert to_device(torch.device("cuda")) == gpu(0)
    with pytest.raises(DeviceUnavailableError):
        require_available(torch.device("cuda"))


def test_as_in_returns_the_same_tensor_when_already_there():
    x = torch.arange(3.0)
    y = as_in(x, cpu(0))
    assert y is x
    y[0] = 7.0
    assert x[0] == 7.0  # shares storage: nothing was copied


def test_copy_to_always_copies():
    x = torch.arange(3.0)
    y = copy_to(x, "cpu")
    assert y is not x and torch.equal(x, y)
    y[0] = 7.0
    assert x[0] == 0.0


def test_as_in_moves_to_another_logical_cpu_and_tags_it():
    x = torch.arange(3.0)
    y = as_in(x, cpu(1))
    assert y is not x and device_of(y) == cpu(1) and device_of(x) == cpu(0)
    assert as_in(y, "cpu:1") is y


def test_modules_follow_the_same_rules():
    net = nn.Linear(3, 2)
    assert as_in(net, cpu()) is net
    other = copy_to(net, cpu(1))
    assert other is not net and device_of(other) == cpu(1)
    assert all(p is not q for p, q in zip(net.parameters(), other.parameters()))
    assert as_in(other, cpu(1)) is other
    other.weight.data.fill_(1.0)
    assert not torch.equal(net.weight, other.weight)


def test_check_same_device_passes_and_allows_scalars():
    a, b = torch.ones(2), torch.ones(2)
    assert check_same_device(a, b, torch.tensor(3.0)) == cpu(0)
    c = copy_to(a, cpu(1))
    assert check_same_device(c, torch.tensor(2.0)) == cpu(1)


def test_mixed_device_error_names_each_operand_and_the_fix():
    x = torch.ones(2)
    y = copy_to(torch.ones(2), cpu(1))
    with pytest.raises(DeviceMismatchError) as err:
        check_same_device(x, y, names=("x", "y"), op="x + y")
    msg = str(err.value)
    assert "x on cpu(0)" in msg and "y on cpu(1)" in msg
    assert "dlperf.as_in(y, cpu(0))" in msg


def test_top_level_reexports():
    assert dlperf.try_gpu is try_gpu and dlperf.as_in is as_in and isinstance(dlperf.cpu(), Device)


@pytest.mark.gpu
def test_gpu_tensor_semantics():
    x = torch.ones(3)
    g = copy_to(x, gpu(0))
    assert g.is_cuda and device_of(g) == gpu(0) and as_in(g, "cuda:0") is g
    with pytest.raises(DeviceMismatchError, match="gpu\\(0\\)"):
        check_same_device(x, g, names=("x", "g"))


def test_tag_marks_a_logical_cpu_device_without_moving_data():
    from dlperf.devices import tag

    t = torch.arange(4.0)
    part = tag(t.view(t.shape), cpu(3))
    assert device_of(part) == cpu(3) and device_of(t) == cpu(0)
    assert part.data_ptr() == t.data_ptr()  # same memory: a tag is not a copy
    net = nn.BatchNorm1d(2)
    assert tag(net, "cpu(2)") is net
    assert {device_of(v) for v in (*net.parameters(), *net.buffers())} == {cpu(2)} and device_of(net) == cpu(2)
    assert device_of(tag(torch.ones(1), gpu(1))) == cpu(0)  # a CUDA device is the tensor's own: nothing to record
    tag(part, cpu(1))  # a new tag replaces the old one
    assert device_of(part) == cpu(1)


def test_results_of_operations_stay_on_the_logical_device():
    x = copy_to(torch.arange(6.0).reshape(2, 3), cpu(1))
    assert device_of(x * 2) == cpu(1)  # the reported case
    assert device_of(torch.relu(x @ x.T).sum()) == cpu(1)
    assert {device_of(t) for t in x.split(1)} == {cpu(1)}
    assert device_of(x.max(dim=1).values) == cpu(1) and device_of(x[0]) == cpu(1)
    assert device_of(torch.ones(2, 3) + x) == cpu(0)  # the first operand decides, as torch does for real devices
    assert device_of(x + torch.tensor(1.0)) == cpu(1)  # a 0-d host tensor is a scalar
    plain = torch.zeros(2, 3)
    assert plain.add_(x) is plain and device_of(plain) == cpu(0)  # in place: the target keeps its device
    assert torch.equal(x * 2, torch.arange(6.0).reshape(2, 3) * 2)  # the values are torch's own


def test_gradients_are_on_the_device_of_their_parameter():
    w = copy_to(torch.randn(3), cpu(2)).requires_grad_()  # d2l's get_params: copy, attach_grad
    x = copy_to(torch.ones(3), cpu(2))
    (w * x).sum().backward()
    assert device_of(w.grad) == cpu(2) and torch.equal(w.grad, torch.ones(3))
    net = copy_to(nn.Linear(3, 2), cpu(1))
    net(torch.ones(4, 3)).sum().backward()  # even from an input that was never placed
    assert isinstance(net.weight, nn.Parameter)
    assert {device_of(p.grad) for p in net.parameters()} == {cpu(1)}
    net.zero_grad(set_to_none=True)
    net(torch.ones(4, 3)).sum().backward()
    assert device_of(net.bias.grad) == cpu(1)


def test_untagged_tensors_are_left_plain():
    x = torch.ones(3)
    assert type(x * 2) is torch.Tensor and type(as_in(x, cpu(0))) is torch.Tensor
    assert type(copy_to(copy_to(x, cpu(1)), cpu(0))) is torch.Tensor  # back on cpu(0): plain again
    net = nn.Linear(2, 2)
    net(torch.ones(1, 2)).sum().backward()
    assert type(net.weight.grad) is torch.Tensor and type(net.weight) is nn.Parameter
    part = tag(x.view(3), cpu(1))
    assert part._base is x and type(x) is torch.Tensor  # reading a view's base does not move the base
    assert type(part.as_subclass(torch.Tensor)) is torch.Tensor
    assert part.tolist() == [1.0, 1.0, 1.0] and tuple(part.shape) == (3,)


def test_tagged_tensors_save_load_copy_and_print():
    import copy
    import io
    import pickle

    w = copy_to(torch.arange(3.0), cpu(1)).requires_grad_()
    (w * 2).sum().backward()
    buf = io.BytesIO()
    torch.save({"w": w}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["w"]  # saved as a plain tensor: safe to load anywhere
    assert type(loaded) is torch.Tensor and torch.equal(loaded, w.detach())
    assert type(pickle.loads(pickle.dumps(w.detach()))) is torch.Tensor
    twin = copy.deepcopy(w)
    assert device_of(twin) == cpu(1) and twin.data_ptr() != w.data_ptr() and torch.equal(twin.grad, w.grad)
    assert repr(w.detach()) == "tensor([0., 1., 2.], device=cpu(1))"


def test_try_all_gpus_with_a_count_gives_distinct_devices_anywhere():
    for k in (1, 2, 3):
        devs = try_all_gpus(k)
        assert len(set(devs)) == k
        assert devs == ([gpu(i) for i in range(k)] if num_gpus() >= k else [cpu(i) for i in range(k)])
    assert [try_gpu(i) for i in range(2)] == [try_gpu(0), try_gpu(1)]  # d2l's semantics are unchanged
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(UsageError, match="expected a number of devices >= 1"):
            try_all_gpus(bad)

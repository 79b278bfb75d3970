"""The examples of the lecture "Using GPUs" (EE-559 6.6), written with dlperf's names.

Each test is one example as a reader would translate it: ``torch.device('cuda:1')`` becomes
``gpu(1)``, ``t.to(device)`` becomes ``as_in`` (itself when already there) or ``copy_to`` (always
a copy), and ``nn.DataParallel`` becomes ``dlperf.parallel.DataParallel``. Where the lecture needs
two GPUs, ``try_all_gpus(2)`` gives two GPUs when the machine has them and the logical CPU devices
``cpu(0)``, ``cpu(1)`` otherwise, so every example runs here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dlperf.devices import as_in, check_same_device, copy_to, cpu, device_of, gpu, to_device, try_all_gpus, try_gpu
from dlperf.errors import DeviceMismatchError
from dlperf.parallel import DataParallel


def test_a_device_is_given_as_a_device_or_a_string():
    # torch.zeros(10, 10, device=...) with torch.device('cuda'), 'cuda:1' or 'cuda:0'
    assert to_device(torch.device("cuda")) == gpu(0)
    assert to_device(torch.device("cuda:1")) == to_device("cuda:1") == gpu(1)
    assert to_device("cuda:0") == gpu(0) and to_device("cpu") == cpu(0)
    x = torch.zeros(10, 10)
    assert device_of(x) == cpu(0) and x.device == torch.device("cpu")
    dev = try_gpu()
    y = torch.zeros(10, 10, device=dev.torch_device)  # a creation op takes the torch device
    assert device_of(y) == dev


def test_moving_copies_unless_already_there():
    u = torch.tensor([1, 2, 3])
    v = copy_to(u, try_all_gpus(2)[1])  # u.to('cuda'): a copy
    v[0] = 5
    assert u.tolist() == [1, 2, 3]
    w = as_in(u, cpu())  # u.to('cpu'): u itself
    assert w is u
    w[0] = 5
    assert u.tolist() == [5, 2, 3]


def test_an_operation_runs_where_its_operands_are():
    m, x = torch.randn(10, 10), torch.randn(10, 100)
    assert device_of(m @ x) == cpu(0)
    dev = try_all_gpus(2)[1]
    m, x = as_in(m, dev), as_in(x, dev)
    q = m @ x  # done on the second device
    assert device_of(q) == dev and q.shape == (10, 100)


def test_new_methods_keep_dtype_and_device():
    u = torch.randn(3, 5, dtype=torch.float64)
    v = u.new_zeros(1, 2)
    assert v.dtype == torch.float64 and torch.equal(v, torch.zeros(1, 2, dtype=torch.float64))
    dev = try_all_gpus(2)[1]
    w = copy_to(torch.empty(3, 5, dtype=torch.float16).fill_(1.0), dev)
    full = w.new_full((2, 3), 1.4)
    assert full.dtype == torch.float16 and device_of(full) == dev
    assert torch.equal(full, torch.full((2, 3), 1.4, dtype=torch.float16, device=full.device))


def test_only_copy_mixes_devices():
    d0, d1 = try_all_gpus(2)
    x = copy_to(torch.randn(3, 5), d0)
    y = copy_to(torch.randn(3, 5), d1)
    x.copy_(y)  # copy_ may read from another device
    assert torch.equal(x.cpu(), y.cpu()) and device_of(x) == d0
    # x + y: torch refuses it across GPUs; logical CPU devices share memory, so dlperf's check says it
    with pytest.raises(DeviceMismatchError, match=r"x on .*\(0\), y on .*\(1\)"):
        check_same_device(x, y, names=("x", "y"), op="x + y")
    if d0.is_gpu:
        with pytest.raises(RuntimeError):
            x + y  # noqa: B018


def test_a_module_moves_in_place_and_the_usual_setup_code():
    device = try_gpu()  # the lecture's "cuda if available, else cpu"
    model = nn.Linear(4, 2)
    assert model.to(device.torch_device) is model  # Module.to works in place
    criterion = nn.MSELoss()
    train_input, train_target = as_in(torch.randn(8, 4), device), as_in(torch.randn(8, 2), device)
    loss = criterion(model(train_input), train_target)
    assert device_of(loss) == device and device_of(model) == device


class Dummy(nn.Module):
    """The lecture's module that prints each call of forward."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        print("Dummy.forward", tuple(x.size()), device_of(x))
        return self.m(x)


def test_data_parallel_splits_the_batch_across_devices(capsys):
    x = torch.empty(50, 10).normal_()
    model = Dummy(nn.Linear(10, 5))
    y_plain = model(x)
    assert capsys.readouterr().out.splitlines() == ["Dummy.forward (50, 10) cpu(0)"]
    devices = try_all_gpus(2)
    x, model = as_in(x, devices[0]), as_in(model, devices[0])
    with DataParallel(model, devices, threads=None if devices[0].is_gpu else [1, 1]) as parallel_model:
        y = parallel_model(x)
    lines = sorted(capsys.readouterr().out.splitlines())
    assert lines == [f"Dummy.forward (25, 10) {d}" for d in devices]
    assert device_of(y) == devices[0]
    torch.testing.assert_close(y.cpu(), y_plain, rtol=1e-5, atol=1e-6)  # same outputs, concatenated


def test_data_parallel_is_autograd_compliant():
    torch.manual_seed(0)
    model = nn.Linear(10, 5)
    ref = copy_to(model, cpu())
    x = torch.randn(6, 10)
    ref(x).pow(2).sum().backward()
    devices = try_all_gpus(2)
    model, x = as_in(model, devices[0]), as_in(x, devices[0])
    with DataParallel(model, devices) as parallel_model:
        parallel_model(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-6)


def test_data_parallel_without_a_device_list(capsys):
    model = Dummy(nn.Linear(10, 5))
    if torch.cuda.is_available():
        model.to("cuda")
    with DataParallel(model) as parallel_model:  # nn.DataParallel(model): every GPU
        parallel_model(torch.randn(50, 10, device=parallel_model.devices[0].torch_device))
    assert len(capsys.readouterr().out.splitlines()) == max(torch.cuda.device_count(), 1)

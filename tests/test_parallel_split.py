from __future__ import annotations

import pytest
import torch

from dlperf.devices import cpu, device_of, gpu, num_gpus
from dlperf.errors import DeviceUnavailableError, UsageError
from dlperf.parallel import check_devices, split_and_load, split_batch, split_sizes


@pytest.mark.parametrize("n,k", [(1, 1), (4, 2), (5, 2), (7, 3), (256, 3), (10, 4)])
def test_split_sizes_cover_batch_evenly(n, k):
    sizes = split_sizes(n, k)
    assert sum(sizes) == n and len(sizes) == k
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_split_and_load_keeps_order_and_tags_devices():
    x = torch.arange(35).reshape(7, 5)
    devs = [cpu(0), cpu(1), cpu(2)]
    parts = split_and_load(x, devs, even_split=False)
    assert [p.shape[0] for p in parts] == [3, 2, 2]
    assert torch.equal(torch.cat(parts), x)
    assert [device_of(p) for p in parts] == devs
    assert device_of(x) == cpu(0)  # the caller's tensor is not retagged


def test_split_batch_splits_features_and_labels_alike():
    X, y = torch.randn(9, 3), torch.arange(9)
    Xs, ys = split_batch(X, y, [cpu(0), cpu(1)], even_split=False)
    for a, b in zip(Xs, ys):
        assert a.shape[0] == b.shape[0]
    assert torch.equal(torch.cat(ys), y)


def test_uneven_split_is_one_line_error_naming_sizes_and_fix():
    with pytest.raises(UsageError) as err:
        split_and_load(torch.zeros(5, 2), [cpu(0), cpu(1)])
    msg = str(err.value)
    assert "\n" not in msg and "5 examples" in msg and "(3 + 2)" in msg and "even_split=False" in msg
    with pytest.raises(UsageError, match="even_split=False"):
        split_batch(torch.zeros(7, 2), torch.zeros(7), [cpu(0), cpu(1), cpu(2)])
    assert [len(p) for p in split_and_load(torch.zeros(6, 2), [cpu(0), cpu(1), cpu(2)])] == [2, 2, 2]


def test_parts_keep_their_device_through_operations_and_autograd():
    w = torch.ones(3, requires_grad=True)
    parts = split_and_load(torch.arange(12.0).reshape(4, 3), [cpu(0), cpu(1)])
    losses = [(p @ w).relu().sum() for p in parts]
    assert [device_of(loss) for loss in losses] == [cpu(0), cpu(1)]
    assert [device_of(t) for t in parts[1].unbind(0)] == [cpu(1), cpu(1)]


def test_batch_smaller_than_device_count_is_an_error():
    with pytest.raises(UsageError, match="cannot be split across 3 devices"):
        split_and_load(torch.zeros(2, 4), [cpu(0), cpu(1), cpu(2)])


def test_mismatched_features_and_labels():
    with pytest.raises(UsageError, match="must match"):
        split_batch(torch.zeros(4, 2), torch.zeros(3), [cpu(0)])


def test_device_listed_twice():
    with pytest.raises(UsageError, match="listed twice"):
        check_devices([cpu(0), "cpu:0"])


def test_empty_device_list():
    with pytest.raises(UsageError, match="empty"):
        check_devices([])


def test_absent_gpu_is_one_clear_error():
    with pytest.raises(DeviceUnavailableError, match=f"gpu\\({num_gpus()}\\) was requested"):
        split_and_load(torch.zeros(4, 2), [cpu(0), gpu(num_gpus())])


@pytest.mark.gpu
def test_split_to_gpu_from_pinned_memory():
    x = torch.randn(8, 3).pin_memory()
    parts = split_and_load(x, [gpu(0)])
    assert parts[0].is_cuda and torch.equal(parts[0].cpu(), x)

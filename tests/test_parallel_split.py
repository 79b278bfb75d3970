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


# --- batches as PyTorch users write them: tuples, lists and dicts of tensors of any dtype --------------

def _structured(n, g):
    return {"ids": torch.randint(0, 100, (n, 6), generator=g), "mask": torch.rand(n, 6, generator=g) > 0.5,
            "pair": (torch.randn(n, 3, generator=g), [torch.arange(n)]), "scale": torch.tensor(2.0), "lang": "en"}


def test_split_and_load_splits_every_tensor_of_a_structure_and_shares_plain_values():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    batch = _structured(7, g)
    devs = [cpu(0), cpu(1), cpu(2)]
    parts = split_and_load(batch, devs, even_split=False)
    assert [p["ids"].shape[0] for p in parts] == [3, 2, 2]
    for key in ("ids", "mask"):
        assert torch.equal(torch.cat([p[key] for p in parts]), batch[key])
        assert [p[key].dtype for p in parts] == [batch[key].dtype] * 3
    assert torch.equal(torch.cat([p["pair"][0] for p in parts]), batch["pair"][0])
    assert torch.equal(torch.cat([p["pair"][1][0] for p in parts]), batch["pair"][1][0])
    assert all(p["lang"] == "en" and float(p["scale"]) == 2.0 for p in parts)
    for p, d in zip(parts, devs):  # every tensor of part i, the shared 0-d one too, is on device i
        assert {device_of(t) for t in (p["ids"], p["mask"], p["pair"][0], p["pair"][1][0], p["scale"])} == {d}
    assert device_of(batch["ids"]) == cpu(0)  # the caller's tensors are not retagged


def test_split_batch_of_structures_keeps_inputs_and_targets_aligned():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    X = (torch.randint(0, 9, (6, 4), generator=g), torch.randn(6, 2, generator=g))
    y = {"label": torch.arange(6), "weight": torch.rand(6, generator=g)}
    Xs, ys = split_batch(X, y, [cpu(0), cpu(1)])
    assert isinstance(Xs[0], tuple) and isinstance(ys[1], dict)
    assert torch.equal(torch.cat([x[0] for x in Xs]), X[0])
    assert torch.equal(torch.cat([t["label"] for t in ys]), y["label"])


def test_structure_errors_name_the_structure():
    ids = torch.zeros(4, 3, dtype=torch.int64)
    with pytest.raises(UsageError, match=r"dict\{ids: int64\[4,3\], mask: float32\[5,3\]\} mixes batch sizes 4 and 5"):
        split_and_load({"ids": ids, "mask": torch.zeros(5, 3)}, [cpu(0), cpu(1)])
    with pytest.raises(UsageError, match=r"dict\{lang: str, scale: float32\[\]\} has no tensor with a batch"):
        split_and_load({"lang": "en", "scale": torch.tensor(1.0)}, [cpu(0), cpu(1)])
    with pytest.raises(UsageError, match=r"features have 4 examples but labels have 3.*inputs tuple\(int64\[4,3\]\)"):
        split_batch((ids,), {"y": torch.zeros(3)}, [cpu(0)])
    with pytest.raises(UsageError, match="cannot split 5 examples evenly"):
        split_and_load([torch.zeros(5, 2)], [cpu(0), cpu(1)])


def test_split_step_takes_presplit_structures_only_when_placed_per_device():
    from dlperf.errors import DeviceMismatchError
    from dlperf.parallel.split import split_step

    devs = [cpu(0), cpu(1)]
    X = {"ids": torch.zeros(4, 3, dtype=torch.int64)}
    Xs, ys, n = split_step(X, torch.arange(4), devs)
    assert n == 4 and [device_of(x["ids"]) for x in Xs] == devs
    # a tuple of inputs on one device is one batch, not two parts
    pair = (torch.zeros(4, 3), torch.ones(4, 3))
    Xs, ys, n = split_step(pair, torch.arange(4), devs)
    assert n == 4 and [len(x) for x in Xs] == [2, 2] and Xs[1][0].shape == (2, 3)
    # parts placed by split_and_load are taken as they are; misplaced ones are refused
    parts, labels = split_and_load(X, devs), split_and_load(torch.arange(4), devs)
    Xs, ys, n = split_step(parts, labels, devs)
    assert n == 4 and Xs[1] is parts[1]
    with pytest.raises(DeviceMismatchError, match=r"input part 0 is on cpu\(1\)"):
        split_step(parts[::-1], labels, devs)
    # across processes: this process's slice of the global structure
    Xs, ys, n = split_step(X, torch.arange(4), [cpu(0)], world=2, rank=1)
    assert n == 4 and torch.equal(ys[0], torch.tensor([2, 3])) and Xs[0]["ids"].shape == (2, 3)


@pytest.mark.gpu
@pytest.mark.skipif(num_gpus() < 2, reason="needs 2 CUDA GPUs")
def test_a_host_tuple_batch_is_one_batch_on_gpus():
    from dlperf.parallel.split import split_step

    X = (torch.zeros(4, 3), torch.ones(4, 3))
    Xs, ys, n = split_step(X, (torch.arange(4), torch.arange(4)), [gpu(0), gpu(1)])
    assert n == 4 and [x[0].device for x in Xs] == [torch.device("cuda:0"), torch.device("cuda:1")]


def test_a_tuple_batch_elsewhere_than_the_devices_is_one_batch():
    from dlperf.parallel.split import split_step

    # on cpu(2), devices cpu(0), cpu(1): every tensor in one place, so one batch, not two misplaced parts
    X = tuple(split_and_load(torch.zeros(4, 3), [cpu(2)])) + tuple(split_and_load(torch.ones(4, 3), [cpu(2)]))
    Xs, ys, n = split_step(X, (torch.arange(4), torch.arange(4)), [cpu(0), cpu(1)])
    assert n == 4 and [device_of(x[1]) for x in Xs] == [cpu(0), cpu(1)]


@pytest.mark.parametrize("n,world,rank,k", [(10, 2, 1, 2), (10, 2, 0, 2), (7, 3, 2, 1), (9, 2, 1, 3)])
def test_split_step_across_processes_takes_the_local_parts_of_a_structure(n, world, rank, k):
    from dlperf.parallel.communication.process_group import local_parts
    from dlperf.parallel.split import split_step

    X = {"ids": torch.arange(n * 2).reshape(n, 2), "tag": "t"}
    y = (torch.arange(n), torch.tensor(1.0))
    devs = [cpu(i) for i in range(k)]
    Xs, ys, total = split_step(X, y, devs, world=world, rank=rank)
    start, sizes = local_parts(n, world, rank, k)
    assert total == n and [x["ids"].shape[0] for x in Xs] == sizes
    assert torch.equal(torch.cat([t[0] for t in ys]), torch.arange(start, start + sum(sizes)))
    assert [device_of(x["ids"]) for x in Xs] == devs and all(x["tag"] == "t" for x in Xs)
    assert [device_of(t[1]) for t in ys] == devs

from __future__ import annotations

import pytest
import torch

from dlperf.devices import copy_to, cpu
from dlperf.errors import UsageError
from dlperf.parallel import algorithm_names, allreduce, engine_lanes, get_algorithm
from dlperf.parallel.allreduce import DEFAULT_ALGORITHM, chunk_bounds

ALGORITHMS = ["naive", "cpu", "sharded", "ring", "auto"]


def _per_device(k: int, shape, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [copy_to(torch.randn(shape, generator=g, dtype=dtype), cpu(i)) for i in range(k)]


def test_all_algorithms_are_registered_and_default_exists():
    assert set(ALGORITHMS) <= set(algorithm_names())
    assert DEFAULT_ALGORITHM in algorithm_names()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(1,), (2,), (7,), (5, 3), (1001,), (3, 0)])
def test_allreduce_equals_sum_on_every_device(algorithm, k, shape):
    xs = _per_device(k, shape, seed=k * 31 + len(shape))
    expected = torch.stack([x.clone() for x in xs]).sum(0)
    out = allreduce(xs, algorithm=algorithm)
    assert out is not xs and len(out) == k
    for x in xs:
        torch.testing.assert_close(x, expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(x, xs[0])  # bit-identical copies on every device


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_with_device_workers_matches(algorithm):
    k = 3
    xs = _per_device(k, (3 * 1024 * 1024 + 7,), seed=5)  # more than one 1 MiB block per shard
    expected = torch.stack([x.clone() for x in xs]).sum(0)
    with engine_lanes([cpu(i) for i in range(k)], cpu_threads=1) as workers:
        allreduce(xs, algorithm=algorithm, workers=workers)
    for x in xs:
        torch.testing.assert_close(x, expected)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_invariant_x_times_world(algorithm):
    for k in (2, 3, 5):
        xs = [copy_to(torch.full((11,), 2.5), cpu(i)) for i in range(k)]
        allreduce(xs, algorithm=algorithm)
        assert all(torch.equal(x, torch.full((11,), 2.5 * k)) for x in xs)


def test_allreduce_non_contiguous_and_integer_tensors():
    from dlperf.devices import tag

    base = [torch.arange(12).reshape(3, 4) * (i + 1) for i in range(2)]
    xs = []
    for i, b in enumerate(base):
        view = b.t()  # non-contiguous
        tag(view, cpu(i))
        xs.append(view)
    allreduce(xs, algorithm="ring")
    assert not xs[0].is_contiguous()
    for x in xs:
        assert torch.equal(x, 3 * torch.arange(12).reshape(3, 4).t())
    assert torch.equal(base[1], 3 * torch.arange(12).reshape(3, 4))  # written through to the storage


def test_chunk_bounds_cover_range():
    for n in range(0, 12):
        for k in range(1, 5):
            b = chunk_bounds(n, k)
            assert b[0][0] == 0 and b[-1][1] == n and all(b[i][1] == b[i + 1][0] for i in range(k - 1))


def test_unknown_algorithm_lists_choices():
    with pytest.raises(UsageError, match="unknown allreduce algorithm 'tree'.*naive.*ring"):
        get_algorithm("tree")


def test_two_tensors_on_one_device_is_an_error():
    with pytest.raises(UsageError, match="two tensors on cpu\\(0\\)"):
        allreduce([torch.ones(2), torch.ones(2)])


def test_shape_mismatch_is_an_error():
    with pytest.raises(UsageError, match="equal shapes"):
        allreduce([copy_to(torch.ones(2), cpu(0)), copy_to(torch.ones(3), cpu(1))])


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_on_gpus(algorithm):
    from dlperf.devices import gpu, num_gpus

    k = num_gpus()
    devs = [gpu(i) for i in range(k)] if k > 1 else [gpu(0), cpu(0)]
    xs = [copy_to(torch.randn(1001), d) for d in devs]
    expected = sum(x.cpu() for x in xs)
    allreduce(xs, algorithm=algorithm)
    for x in xs:
        torch.testing.assert_close(x.cpu(), expected)


def test_run_schedule_waits_for_the_whole_phase_before_raising():
    import threading
    import time

    from dlperf.parallel.allreduce import run_schedule

    finished = threading.Event()

    def fail():
        raise RuntimeError("task 0 failed")

    def slow():
        time.sleep(0.3)
        finished.set()

    with engine_lanes([cpu(0), cpu(1)], cpu_threads=1) as w:
        with pytest.raises(RuntimeError, match="task 0 failed"):
            run_schedule([[fail, slow]], w)
        assert finished.is_set(), "returned while another task of the phase still ran"

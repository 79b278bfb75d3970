"""``auto`` allreduce: the cost model's choice on given hardware, its reason, its sums, and `train --algorithm auto`."""

from __future__ import annotations

import logging

import pytest
import torch

from dlperf.devices import Device, copy_to, cpu
from dlperf.errors import UsageError
from dlperf.parallel import algorithm_names, allreduce, engine_lanes
from dlperf.parallel.allreduce import choose_algorithm
from dlperf.parallel.allreduce.auto import TaskCost, handoff_steps, predict, schedule_costs
from dlperf.probe.cost import Hardware, Link

KB, MB = 1024, 1024 * 1024


def _hardware(alpha_s: float, device_bw: float, host_bw: float | None = None, dispatch_s: float = 0.0) -> Hardware:
    device = Link(alpha_s, device_bw)
    host = Link(alpha_s, host_bw or device_bw)
    return Hardware("synthetic", {"float32": 1e12}, 2 * device_bw, dispatch_s,
                    {"copy": host, "host": host, "device": device, "network": host})


def _gpus(k: int) -> list[Device]:
    return [Device("gpu", i) for i in range(k)]  # only named: with hardware given nothing touches them


def test_auto_is_registered():
    assert "auto" in algorithm_names()


@pytest.mark.parametrize(("k", "steps"), [(2, {"naive": 0, "cpu": 1, "sharded": 1, "ring": 2}),
                                          (4, {"naive": 1, "cpu": 1, "sharded": 1, "ring": 6})])
def test_handoff_steps_are_the_schedules_multi_task_phases(k, steps):
    assert {name: handoff_steps(name, k) for name in steps} == steps


def test_naive_schedule_is_one_add_then_one_copy_at_k2():
    # d2l 12.5.4: add the other tensor on the first device, copy the sum back; each reads and writes 3n
    assert schedule_costs("naive", 2) == [[TaskCost(1, 3.0)], [TaskCost(1, 3.0)]]


def _by_hand(name: str, nbytes: float, k: int, alpha: float, rate: float, dispatch: float, cores: int,
             workers: bool) -> float:
    total = 0.0
    for row in schedule_costs(name, k):
        times = [t.ops * dispatch + t.traffic * nbytes / rate for t in row]
        if len(row) == 1 or not workers:
            total += sum(times)
        else:
            lat = [t.ops * dispatch for t in row]
            xfer = [t.traffic * nbytes / rate for t in row]
            share = max(1.0, len(row) / cores)
            total += alpha + max(max(lat), sum(lat) / len(row) * share) + max(max(xfer), sum(xfer) / len(row) * share)
    return total


@pytest.mark.parametrize("workers", [True, False])
@pytest.mark.parametrize(("k", "cores"), [(2, 2), (4, 2), (4, 1), (3, 64)])
def test_shared_memory_prediction_follows_the_schedules(k, cores, workers):
    hw = _hardware(20e-6, 10e9, dispatch_s=1e-6)
    got = {p.algorithm: p.seconds for p in predict(MB, k, hw, shared_memory=True, cores=cores, workers=workers)}
    assert got == pytest.approx({n: _by_hand(n, MB, k, 20e-6, 10e9, 1e-6, cores, workers) for n in got})


def test_logical_cpus_small_tensor_is_latency_bound_and_goes_to_naive():
    # 20 us per worker hand-off, 1 us per operator, 10 GB/s: naive's two operators on the calling
    # thread cost far less than the hand-off every other algorithm needs at k = 2
    hw = _hardware(20e-6, 10e9, dispatch_s=1e-6)
    name, reason = choose_algorithm(4 * KB, 2, hardware=hw)
    runner = predict(4 * KB, 2, hw, shared_memory=True)[1].algorithm
    assert name == "naive" and runner != "naive"
    assert "naive [" in reason and f"next {runner} [" in reason and "4 KB" in reason
    assert "2 logical CPU devices" in reason


def test_logical_cpus_large_tensor_is_bandwidth_bound_and_goes_to_sharded():
    hw = _hardware(20e-6, 10e9, dispatch_s=1e-6)
    name, reason = choose_algorithm(64 * MB, 2, hardware=hw)
    assert name == "sharded"  # each core moves half the traffic naive's one core does; one hand-off is nothing
    assert "sharded [" in reason and "next ring [" in reason and "64 MB" in reason


def test_without_workers_nothing_runs_in_parallel_and_the_fewest_operators_win():
    hw = _hardware(20e-6, 10e9, dispatch_s=1e-6)
    assert choose_algorithm(64 * MB, 2, hardware=hw, workers=True)[0] == "sharded"
    name, reason = choose_algorithm(64 * MB, 2, hardware=hw, workers=False)
    assert name == "naive" and "calling thread" in reason


def test_small_tensors_in_cache_move_at_the_cache_rate():
    hw = _hardware(0.0, 1e9, dispatch_s=0.0)
    slow = predict(MB, 2, hw, shared_memory=True, cache=(MB, 100e9))  # 2 MB do not fit in 1 MB
    fast = predict(MB, 2, hw, shared_memory=True, cache=(4 * MB, 100e9))
    assert {p.algorithm: p.seconds / 100 for p in slow} == pytest.approx({p.algorithm: p.seconds for p in fast})


def test_gpus_follow_the_textbook_formulas():
    # device links 10x slower than the host link: large tensors go through host memory, small ones
    # pay the fewest latencies (sharded 2, ring 2(k-1), the host route 2k)
    hw = _hardware(10e-6, 1e9, host_bw=10e9)
    small, small_reason = choose_algorithm(1 * KB, _gpus(4), hardware=hw)
    large, large_reason = choose_algorithm(256 * MB, _gpus(4), hardware=hw)
    assert (small, large) == ("sharded", "cpu")
    assert "ring" in small_reason and "sharded" in large_reason  # the runners-up: 6a, and 1.5 n b at 1 GB/s
    assert {p.algorithm: p.seconds for p in predict(256 * MB, 4, hw, shared_memory=False)}["cpu"] == \
        pytest.approx(2 * 4 * (10e-6 + 256 * MB / 10e9))


def test_ties_go_to_the_default():
    name, reason = choose_algorithm(64 * MB, _gpus(2), hardware=_hardware(5e-6, 16e9))
    assert name == "sharded" and "ties with ring" in reason  # 2a + n b for both at k = 2


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "64", True])
def test_bad_sizes_are_usage_errors(bad):
    with pytest.raises(UsageError, match="nbytes"):
        choose_algorithm(bad, 2, hardware=_hardware(1e-6, 1e9))


def test_one_device_needs_nothing():
    assert choose_algorithm(MB, 1)[0] in algorithm_names()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("numel", [1, 1000, 300_000])
def test_auto_allreduce_equals_plain_sum(k, numel):
    g = torch.Generator().manual_seed(k * numel)
    fresh = [torch.randn(numel, generator=g) for _ in range(k)]
    expected = torch.stack(fresh).sum(0)
    xs = [copy_to(t, cpu(i)) for i, t in enumerate(fresh)]
    allreduce(xs, "auto")
    for x in xs:
        torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)
    ys = [copy_to(t, cpu(i)) for i, t in enumerate(fresh)]
    with engine_lanes([cpu(i) for i in range(k)], cpu_threads=1) as workers:
        allreduce(ys, "auto", workers=workers)
    for y in ys:
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(60)
def test_each_new_decision_is_logged_once(caplog):
    numel = 12_345  # a size no other test uses, so this is a new decision
    with caplog.at_level(logging.INFO, logger="dlperf.parallel.allreduce"):
        for _ in range(3):
            allreduce([copy_to(torch.ones(numel), cpu(i)) for i in range(2)], "auto")
    lines = [r.getMessage() for r in caplog.records if "48 KB" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("allreduce: ")


@pytest.mark.timeout(120)
def test_train_algorithm_auto_prints_the_choice_once(capsys):
    from dlperf.cli import main

    assert main(["train", "--devices", "cpu:0,cpu:1", "--algorithm", "auto", "--epochs", "1", "--train-size", "64",
                 "--test-size", "32", "--batch-size", "32", "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    chosen = [line for line in out if line.startswith("allreduce: auto chose ")]
    assert len(chosen) == 1 and out[0] == chosen[0]
    name = chosen[0].split()[3]
    assert name in algorithm_names() and name != "auto"
    assert "2 logical CPU devices" in chosen[0] and out[-1].startswith("test acc: ")

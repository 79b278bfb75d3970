"""``auto`` allreduce: the cost model's choice on given hardware, its reason, its sums, and `train --algorithm auto`."""

from __future__ import annotations

import logging

import pytest
import torch

from dlperf.devices import Device, copy_to, cpu
from dlperf.errors import UsageError
from dlperf.parallel import DeviceWorkers, algorithm_names, allreduce
from dlperf.parallel.allreduce import choose_algorithm
from dlperf.parallel.allreduce.auto import handoff_steps, operator_steps, predict, schedule_ops
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


def test_naive_dispatches_one_add_then_one_copy_at_k2():
    assert schedule_ops("naive", 2) == [[1], [1]]


@pytest.mark.parametrize("name", ["naive", "cpu", "sharded", "ring"])
def test_operator_steps_take_the_longest_task_or_share_the_cores(name):
    rows = schedule_ops(name, 3)
    assert operator_steps(name, 3, cores=1) == pytest.approx(sum(map(sum, rows)))  # one core runs everything
    assert operator_steps(name, 3, cores=64) == pytest.approx(sum(max(r) for r in rows))


def test_dispatch_cost_ranks_tiny_tensors_when_links_are_free():
    hw = _hardware(0.0, 1e18, dispatch_s=1e-6)
    got = {p.algorithm: p.seconds for p in predict(4, 4, hw, shared_memory=True, cores=2)}
    assert got == pytest.approx({n: operator_steps(n, 4, 2) * 1e-6 for n in got}, rel=1e-6)


def test_logical_cpus_small_tensor_is_latency_bound_and_goes_to_naive():
    # 20 us per worker hand-off, 10 GB/s: 4 KB costs 0.8 us to move twice, far below one hand-off
    hw = _hardware(20e-6, 10e9)
    name, reason = choose_algorithm(4 * KB, 2, hardware=hw)
    assert name == "naive"
    assert "naive" in reason and "sharded" in reason and "4 KB" in reason and "2 logical CPU devices" in reason
    by_hand = {"naive": 2 * 4 * KB / 10e9, "sharded": 20e-6 + 4 * KB / 10e9, "ring": 2 * 20e-6 + 4 * KB / 10e9,
               "cpu": 20e-6 + 4 * 4 * KB / 10e9}
    got = {p.algorithm: p.seconds for p in predict(4 * KB, 2, hw, shared_memory=True, cores=2)}
    assert got == pytest.approx(by_hand)


def test_logical_cpus_large_tensor_is_bandwidth_bound_and_goes_to_sharded():
    hw = _hardware(20e-6, 10e9)
    name, reason = choose_algorithm(64 * MB, 2, hardware=hw)
    assert name == "sharded"  # moves n once where naive moves it twice; one hand-off is nothing beside 6.7 ms
    assert "sharded" in reason and "ring" in reason and "64 MB" in reason


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
    with DeviceWorkers([cpu(i) for i in range(k)], threads=[1] * k) as workers:
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

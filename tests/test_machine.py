from __future__ import annotations

import platform

import pytest
import torch

from dlperf._threads import intra_op_threads
from dlperf.inventory import inventory
from dlperf.machine import cpu_model, host_memory
from dlperf.probe.result import machine


def test_cpu_model_reads_cpuinfo_and_falls_back(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Example CPU @ 2.00GHz\nflags\t: fpu\n")
    assert cpu_model(str(info)) == "Example CPU @ 2.00GHz"
    assert cpu_model(str(tmp_path / "missing")) == (platform.processor() or platform.machine())


def test_host_memory_is_total_and_total_less_available(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       16000 kB\nMemFree:         1000 kB\nMemAvailable:    6000 kB\n")
    assert host_memory(str(info)) == (16000 * 1024, 10000 * 1024)
    info.write_text("MemTotal: 16000 kB\n")  # an old kernel without MemAvailable
    assert host_memory(str(info)) == (None, None)
    assert host_memory(str(tmp_path / "missing")) == (None, None)


def test_bench_probe_and_inventory_describe_the_host_alike():
    from dlperf.bench.runner import machine_info

    cpu = inventory()[0]
    assert cpu["name"] == machine()["cpu"] == machine_info()["cpu"] == cpu_model()
    assert cpu["memory_total_bytes"] == machine()["memory_bytes"] == host_memory()[0]


def test_intra_op_threads_restores_the_count_even_after_an_error():
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with pytest.raises(RuntimeError), intra_op_threads(other):
        assert torch.get_num_threads() == other
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with intra_op_threads(None):
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before

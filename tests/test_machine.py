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


def test_meminfo_is_read_in_one_place(tmp_path, monkeypatch):
    import dlperf._cliargs as cliargs
    from dlperf.machine import read_meminfo

    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       16000 kB\nMemAvailable:    6000 kB\nHugePages_Total:       4\nbroken line\n")
    assert read_meminfo(str(info)) == {"MemTotal": 16000 * 1024, "MemAvailable": 6000 * 1024, "HugePages_Total": 4}
    assert read_meminfo(str(tmp_path / "missing")) == {}
    monkeypatch.setattr(cliargs, "read_meminfo", lambda: read_meminfo(str(info)))
    assert cliargs.available_memory_bytes() == 6000 * 1024  # what a request is checked against


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

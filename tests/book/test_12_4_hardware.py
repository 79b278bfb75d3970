"""d2l §12.4 (hardware): the section's arithmetic and its measurable exercises, with dlperf's probe.

The section has no program to translate; ``dlperf probe`` measures this machine's rows of its
Tables 12.4.1/12.4.2 (``dlperf.probe.run_probe``, figures in ``dlperf.probe.reference.SEED``).
These tests check the worked numbers of the text and the exercises that are experiments.
"""

from __future__ import annotations

import time

import pytest
import torch

from dlperf.probe.hardware import cache_sizes
from dlperf.probe.reference import EXAMPLE_CLOCK_GHZ, EXAMPLE_LANES, SEED, mm_seed


def test_the_example_cpu_starves_without_caches():
    # 12.4.4: 4 cores consuming 256 bits each per clock at 2 GHz need 2e9 * 128 B/s = 256 GB/s,
    # an order of magnitude above a 20-40 GB/s memory interface.
    bits_per_clock = 4 * 256
    assert bits_per_clock == 1024  # "1 kbit"
    need_bytes_per_s = EXAMPLE_CLOCK_GHZ * 1e9 * bits_per_clock / 8
    assert need_bytes_per_s == 256e9
    assert need_bytes_per_s / 40e9 > 6 and need_bytes_per_s / 20e9 > 10


def test_the_probe_compares_with_the_sections_example_core():
    # float32: 8 AVX2 lanes at 2 GHz with IPC 1 is 16 GFLOP/s per thread (the probe's mm row).
    assert EXAMPLE_LANES["float32"] * EXAMPLE_CLOCK_GHZ == mm_seed("float32", 1) == 16.0
    assert mm_seed("float32", 4) == 4 * mm_seed("float32", 1)
    assert SEED["l1"].value < SEED["l2"].value < SEED["l3"].value < SEED["dram64"].value


def test_exercise_3_cache_sizes_of_this_cpu():
    sizes, source = cache_sizes()
    assert sizes["L1"] < sizes["L2"], (sizes, source)
    assert all(v > 0 for v in sizes.values())


def test_exercise_3_unreadable_sysfs_falls_back_to_stated_defaults(tmp_path):
    sizes, source = cache_sizes(str(tmp_path))
    assert source.startswith("defaults") and sizes["L1"] < sizes["L2"]


def _per_element_ns(x: torch.Tensor, reps: int = 7) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return best / x.numel() * 1e9


@pytest.mark.slow  # a timing: another program streaming memory on the other core narrows the gap
@pytest.mark.timeout(60)
def test_exercise_2_strided_reads_cost_more_per_element_than_sequential():
    # Every 16th float32 is one element per 64-byte cache line: the line is fetched for one value.
    base = torch.ones(1 << 24)  # 64 MB, beyond the caches of the development machine
    sequential = _per_element_ns(base)
    strided = _per_element_ns(base[::16])
    assert strided > 2 * sequential, (sequential, strided)


def test_exercise_5_hdd_worst_case_rotational_wait():
    # 10,000 rpm: in the worst case the sector just passed the head, one full turn away.
    turn_ms = 60 / 10_000 * 1e3
    assert turn_ms == pytest.approx(6.0)


def test_exercise_15_shortest_round_trip_san_francisco_amsterdam():
    # 10,000 km each way at the speed of light in vacuum; fibre (about 2/3 c) makes it 100 ms.
    c = 299_792_458
    assert 2 * 10_000e3 / c * 1e3 == pytest.approx(66.7, abs=0.1)
    assert 2 * 10_000e3 / (2 / 3 * c) * 1e3 == pytest.approx(100.1, abs=0.1)

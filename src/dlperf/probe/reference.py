"""The book's figures (d2l section 12.4, Tables 12.4.1 and 12.4.2 and the text around them).

Each probe row is compared with one figure from the book, in the row's unit: nanoseconds for
times, GB/s for bandwidths, GFLOP/s for arithmetic throughput. Where the tables have no entry for
what a row measures, the nearest figure the section gives is used and ``source`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

NS = "ns"
MS = "ms"
GBPS = "GB/s"
GFLOPS = "GFLOP/s"


# What any machine can show, per unit, with margin on both sides: a figure outside is not a measurement
# (a cache or file holding 0, 5e-324 or 1e308 is refused, not turned into a floor of 0 or inf).
# Times from a tenth of a picosecond to a day (in ns, or in ms for step times); bandwidths from 1 KB/s to
# 1 PB/s; FLOP/s from 1 kFLOP/s to 1 EFLOP/s. Every cache of figures (probe, links, plans) is checked here.
PLAUSIBLE: dict[str, tuple[float, float]] = {NS: (1e-4, 86_400e9), MS: (1e-10, 86_400e3), GBPS: (1e-6, 1e6),
                                             GFLOPS: (1e-6, 1e9)}


def implausible(value: object, unit: str) -> str | None:
    """Why ``value`` cannot be a figure in ``unit`` (not a number, not finite, out of :data:`PLAUSIBLE`), or None."""
    import math

    lo, hi = PLAUSIBLE[unit]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{type(value).__name__}, not a number"
    if not math.isfinite(value):
        return f"{value!r}, not a finite number"
    if not lo <= value <= hi:
        return f"{value:g} {unit}, outside what any machine shows ({lo:g} to {hi:g} {unit})"
    return None


@dataclass(frozen=True)
class SeedFigure:
    value: float
    unit: str
    source: str


_US = 1e3
_MS = 1e6

# Per-core arithmetic throughput of the section's example CPU (12.4.4: 2 GHz, one instruction per
# clock, 256-bit AVX2 units): lanes per vector times clock, scaled by the threads a row uses.
EXAMPLE_CLOCK_GHZ = 2.0
EXAMPLE_LANES = {"float32": 8, "bfloat16": 16, "float64": 4}

SEED: dict[str, SeedFigure] = {
    "fadd": SeedFigure(1.5, NS, "Floating-point add/mult/FMA: 1.5 ns (4 cycles)"),
    "l1": SeedFigure(1.5, NS, "L1 cache reference/hit: 1.5 ns (4 cycles)"),
    "l2": SeedFigure(5.0, NS, "L2 cache reference/hit: 5 ns (12~17 cycles)"),
    "l3": SeedFigure(16.0, NS, "L3 cache hit (unshared cache): 16 ns (42 cycles)"),
    "dram64": SeedFigure(46.0, NS, "64MB memory ref. (local CPU): 46 ns (TinyMemBench, Broadwell E5-2690v4)"),
    "dram256": SeedFigure(75.0, NS, "256MB memory ref. (local CPU): 75 ns (TinyMemBench, Broadwell E5-2690v4)"),
    "mutex": SeedFigure(25.0, NS, "Mutex lock/unlock: 25 ns"),
    "handoff": SeedFigure(29.0, NS, "nearest entry: L3 cache hit (modified in another core), 29 ns, the least "
                                    "a hand-off between cores can cost"),
    "stream": SeedFigure(40.0, GBPS, "12.4.2: 2~4 channels of 20~25 GB/s DDR4 give 40~100 GB/s; the low end"),
    "tcp_send_4k": SeedFigure(10 * _US, NS, "Send 4KB over 10 Gbps ethernet: 10 us"),
    "tcp_rtt": SeedFigure(500 * _US, NS, "Round trip within same datacenter: 500 us"),
    "disk_seq_1m": SeedFigure(208 * _US, NS, "Read 1MB sequentially from NVMe SSD: 208 us (~4.8 GB/s)"),
    "disk_rand_4k": SeedFigure(120 * _US, NS, "Read 4KB randomly from NVMe SSD: 120 us"),
    "mm": SeedFigure(EXAMPLE_CLOCK_GHZ, GFLOPS, "12.4.4's example core: 2 GHz x IPC 1 x AVX2 lanes "
                                                "(8 float32, 16 bfloat16, 4 float64) per thread"),
    "py_call": SeedFigure(1.5, NS, "no entry; beside the machine operation a call wraps, a floating-point "
                                   "add: 1.5 ns"),
    "torch_dispatch": SeedFigure(10 * _US, NS, "no CPU entry; the host-side cost of one GPU op, Launch CUDA "
                                               "kernel: 10 us"),
    "gpu_launch": SeedFigure(10 * _US, NS, "Launch CUDA kernel on GPU: 10 us"),
    "gpu_copy_1m": SeedFigure(80 * _US, NS, "Transfer 1MB to/from PCI-E GPU: 80 us (~12 GB/s)"),
    "gpu_d2d": SeedFigure(500.0, GBPS, "12.4.2: GDDR6 gives over 500 GB/s aggregate bandwidth"),
    "gpu_peer_1m": SeedFigure(30 * _US, NS, "Transfer 1MB to/from NVLink GPU: 30 us (~33 GB/s)"),
}


def mm_seed(dtype: str, threads: int) -> float:
    """GFLOP/s of the section's example CPU for ``threads`` cores at ``dtype``."""
    return EXAMPLE_CLOCK_GHZ * EXAMPLE_LANES[dtype] * threads

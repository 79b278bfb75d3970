"""The probe's figures beside reference tools run on this machine in the same run.

    PYTHONPATH=src python benchmarks/bench_probe.py [--rounds 5] [--full]

References, each written independently of the probe's kernels:

* STREAM triad: a plain C program (OpenMP, one thread and all cores) compiled here into a private
  temporary directory and run as a separate process, arrays of the same size as the probe's.
* pointer chase: the same plain C program, one random cycle over the probe's L1 and memory working
  sets (huge pages requested, as the probe does, so both see the same TLB).
* matrix product: torch.mm float32 on all cores timed by torch.utils.benchmark.Timer (its fastest
  block), at the probe's size.

Probe and reference alternate within each round (the order flips every round) and each side keeps its
best round. The target is every ratio within 10% of 1. The run counts as contended when the load
average exceeds the core count or a multi-threaded phase (both matrix products, the reference triad's
timed loops) got less than 0.8 x wall x threads of CPU.
The last stdout line is one JSON object: stream_triad_ratio, stream_triad_1t_ratio, mm_peak_ratio,
chase_ratio, chase_l1_ratio, contended, loadavg and the raw figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import tempfile
import time

import torch
from torch.utils import benchmark

from dlperf.probe import hardware
from dlperf.probe.kernels import find_compiler, kernels

REFERENCE_C = r"""
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double clock_s(clockid_t id) { struct timespec t; clock_gettime(id, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static double now(void) { return clock_s(CLOCK_MONOTONIC); }

static void *big(size_t bytes) {
    void *p = NULL;
    size_t rounded = (bytes + 4095) / 4096 * 4096;
    if (posix_memalign(&p, 2u << 20, rounded)) { perror("posix_memalign"); exit(1); }
    madvise(p, rounded, MADV_HUGEPAGE);
    return p;
}

static int triad(long n, int reps) {
    double *a = big(n * sizeof(double)), *b = big(n * sizeof(double)), *c = big(n * sizeof(double));
    long j;
#pragma omp parallel for schedule(static)
    for (j = 0; j < n; j++) { a[j] = 1.0; b[j] = 2.0; c[j] = 0.0; }
    double best = 1e30, s = 3.0, wall = now(), cpu = clock_s(CLOCK_PROCESS_CPUTIME_ID);
    for (int r = 0; r < reps; r++) {
        double t = now();
#pragma omp parallel for schedule(static)
        for (j = 0; j < n; j++) a[j] = b[j] + s * c[j];
        t = now() - t;
        if (t < best) best = t;
    }
    wall = now() - wall;
    cpu = clock_s(CLOCK_PROCESS_CPUTIME_ID) - cpu;
    printf("%.6f %.6f %.6f\n", 24.0 * n / best / 1e9, cpu, wall);  /* GB/s, CPU s and wall s timed */
    return a[n / 2] == 2.0 ? 0 : 1;
}

static int chase(long bytes, long loads, int reps) {
    long n = bytes / 64;
    char *mem = big(n * 64);
    long *perm = malloc(n * sizeof(long));
    for (long i = 0; i < n; i++) perm[i] = i;
    srand(12345);
    for (long i = n - 1; i > 0; i--) {  /* Sattolo's shuffle: a single cycle */
        long j = (long)(((unsigned long)rand() << 31 ^ (unsigned long)rand()) % (unsigned long)i);
        long t = perm[i]; perm[i] = perm[j]; perm[j] = t;
    }
    for (long i = 0; i < n; i++) *(char **)(mem + i * 64) = mem + perm[i] * 64;
    char **p = (char **)mem;
    for (long i = 0; i < n; i++) p = (char **)*p;
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t = now();
        for (long i = 0; i < loads; i++) p = (char **)*p;
        t = now() - t;
        if (t < best) best = t;
    }
    printf("%.6f\n", best / loads * 1e9);
    return p == NULL;
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "triad")) return triad(atol(argv[2]), atoi(argv[3]));
    if (argc == 5 && !strcmp(argv[1], "chase")) return chase(atol(argv[2]), atol(argv[3]), atoi(argv[4]));
    fprintf(stderr, "usage: ref triad N REPS | ref chase BYTES LOADS REPS\n");
    return 2;
}
"""


def build_reference(workdir: str) -> tuple[str, bool]:
    """The reference program's path, and whether it was built with OpenMP."""
    compiler = find_compiler()
    if compiler is None:
        raise SystemExit("bench_probe: no C compiler on PATH; install gcc")
    source = os.path.join(workdir, "ref.c")
    with open(source, "w") as f:
        f.write(REFERENCE_C)
    exe = os.path.join(workdir, "ref")
    for flags, openmp in ((["-O3", "-fopenmp"], True), (["-O3"], False)):
        out = subprocess.run([compiler, *flags, "-o", exe, source], capture_output=True, text=True, timeout=300)
        if out.returncode == 0:
            return exe, openmp
    raise SystemExit(f"bench_probe: cannot compile the reference: {out.stderr.strip()[:300]}")


def run_reference(exe: str, args: list[str], threads: int) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "false"}
    out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, env=env, check=True)
    return [float(x) for x in out.stdout.split()]


def reference_triad(exe: str, n: int, reps: int, threads: int, watch: CpuWatch) -> float:
    gbs, cpu, wall = run_reference(exe, ["triad", str(n), str(reps)], threads)
    watch.check(f"reference triad, {threads} threads", threads, cpu, wall)
    return gbs


class CpuWatch:
    """Process CPU time over a phase against wall x threads: a shortfall means other work took the cores."""

    def __init__(self):
        self.shortfalls: list[str] = []

    def check(self, name: str, threads: int, cpu: float, wall: float) -> None:
        if threads > 1 and cpu < 0.8 * wall * threads:
            self.shortfalls.append(f"{name}: {cpu:.2f} s CPU in {wall:.2f} s wall x {threads} threads")

    def run(self, name: str, threads: int, fn):
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        value = fn()
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - start
        self.check(name, threads, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall)
        return value


def probe_stream(lib, plan) -> dict[str, float]:
    rows = hardware._stream_rows(lib, plan)
    return {r.key: r.value for r in rows if r.key.startswith("stream_triad")}


def probe_chase(lib, plan) -> dict[str, float]:
    return {r.key: r.value for r in hardware._latency_rows(lib, plan) if r.key in ("l1", "dram64")}


def stream_elems(plan) -> int:
    caches, _ = hardware.cache_sizes()
    return max(plan.stream_min_elems, 4 * max(caches.values()) // 8)


def chase_sizes() -> dict[str, int]:
    caches, _ = hardware.cache_sizes()
    return {"l1": caches["L1"] // 2, "dram64": max(64 << 20, 4 * max(caches.values()))}


def mm_reference(n: int, threads: int) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    timer = benchmark.Timer("torch.mm(a, b)", globals={"a": a, "b": b, "torch": torch}, num_threads=threads)
    measurement = timer.blocked_autorange(min_run_time=1.0)
    return 2.0 * n ** 3 / min(measurement.times) / 1e9


def one_round(r: int, lib, exe: str, plan, cores: int, watch: CpuWatch, results: dict) -> None:
    n = stream_elems(plan)
    sizes = chase_sizes()
    before = torch.get_num_threads()

    def mm_probe_all():
        torch.set_num_threads(cores)
        try:
            return hardware._time_mm(torch, plan.mm_n, torch.float32, plan.mm_min_s, plan.reps)
        finally:
            torch.set_num_threads(before)

    tasks = {
        "probe": [
            lambda: results["probe_stream"].append(probe_stream(lib, plan)),
            lambda: results["probe_chase"].append(probe_chase(lib, plan)),
            lambda: results["probe_mm"].append(watch.run("probe mm", cores, mm_probe_all)),
        ],
        "reference": [
            lambda: results["ref_stream"].append({
                f"stream_triad_{t}t": reference_triad(exe, n, plan.stream_reps, t, watch) for t in sorted({1, cores})}),
            lambda: results["ref_chase"].append({
                key: run_reference(exe, ["chase", str(size), str(plan.chase_loads), str(plan.reps)], 1)[0]
                for key, size in sizes.items()}),
            lambda: results["ref_mm"].append(watch.run("Timer mm", cores, lambda: mm_reference(plan.mm_n, cores))),
        ],
    }
    order = ("probe", "reference") if r % 2 == 0 else ("reference", "probe")
    for i in range(3):
        for side in order:
            tasks[side][i]()


def best_of(rounds: list[dict], key: str, lower_is_better: bool) -> float:
    values = [d[key] for d in rounds if d.get(key) is not None]
    return min(values) if lower_is_better else max(values)


def summarize(results: dict, cores: int) -> dict:
    triad_key = f"stream_triad_{cores}t"
    figures = {
        "stream_triad": (best_of(results["probe_stream"], triad_key, False),
                         best_of(results["ref_stream"], triad_key, False), "GB/s"),
        "stream_triad_1t": (best_of(results["probe_stream"], "stream_triad_1t", False),
                            best_of(results["ref_stream"], "stream_triad_1t", False), "GB/s"),
        "mm_peak": (max(results["probe_mm"]), max(results["ref_mm"]), "GFLOP/s"),
        "chase": (best_of(results["probe_chase"], "dram64", True), best_of(results["ref_chase"], "dram64", True),
                  "ns"),
        "chase_l1": (best_of(results["probe_chase"], "l1", True), best_of(results["ref_chase"], "l1", True), "ns"),
    }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--full", action="store_true", help="the probe's full plan instead of --quick's")
    args = parser.parse_args()
    # STREAM's own default of 10 repetitions on both sides: three are too few on a shared machine.
    plan = hardware.FULL if args.full else dataclasses.replace(hardware.QUICK, stream_reps=10)
    cores = hardware.cores()
    lib = kernels()
    loads = [os.getloadavg()[0]]
    watch = CpuWatch()
    results: dict[str, list] = {k: [] for k in ("probe_stream", "ref_stream", "probe_chase", "ref_chase",
                                                "probe_mm", "ref_mm")}
    workdir = tempfile.mkdtemp(prefix="dlperf-bench-probe-")
    try:
        exe, openmp = build_reference(workdir)
        start = time.perf_counter()
        for r in range(max(args.rounds, 1)):
            one_round(r, lib, exe, plan, cores, watch, results)
            loads.append(os.getloadavg()[0])
        elapsed = time.perf_counter() - start
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    figures = summarize(results, cores)
    print(f"probe vs references on {cores} cores, {args.rounds} alternating rounds, {elapsed:.0f} s, "
          f"load average {min(loads):.2f}..{max(loads):.2f}{'' if openmp else ' (reference built without OpenMP)'}")
    print(f"{'figure':<18}{'probe':>12}{'reference':>12}{'unit':>9}{'ratio':>8}")
    summary: dict = {}
    for name, (probe, ref, unit) in figures.items():
        ratio = probe / ref if ref else None
        summary[f"{name}_ratio"] = ratio
        summary[name] = {"probe": probe, "reference": ref, "unit": unit}
        print(f"{name:<18}{probe:>12.2f}{ref:>12.2f}{unit:>9}{ratio:>8.3f}")
    for line in watch.shortfalls:
        print(f"contended phase: {line}")
    contended = max(loads) > cores or bool(watch.shortfalls)
    summary.update({"contended": contended, "loadavg": [round(x, 2) for x in loads], "cores": cores,
                    "rounds": args.rounds, "plan": "full" if args.full else "quick", "openmp_reference": openmp,
                    "within_10pct": all(abs(summary[f"{k}_ratio"] - 1) <= 0.10 for k in figures),
                    "rounds_raw": results})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

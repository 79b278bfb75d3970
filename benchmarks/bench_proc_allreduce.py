"""Allreduce between 2 processes of one host: the shared-memory path against gloo, 4 KB to 64 MB.

Run under the machine's benchmark lock so nothing else competes for the cores:

    flock /tmp/dlperf-cpu.lock .venv/bin/python benchmarks/bench_proc_allreduce.py

Two worker processes (ProcessLauncher, gloo process group, one intra-op thread each) allreduce float32
tensors of every size in the sweep, in place, with

* ``shm``: :class:`dlperf.parallel.allreduce.shm.ShmAllreduce` (reduce-scatter + all-gather through a
  shared-memory segment);
* ``gloo``: ``torch.distributed.all_reduce`` on the gloo process group (loopback TCP);
* ``copy``: no exchange at all, each rank copying its tensor into another buffer at the same time: the
  memory traffic an in-place allreduce cannot avoid (read the tensor, write the result), so its "bus
  bandwidth" is the ceiling this machine puts on any allreduce between 2 processes of these sizes.

gloo's own shared-memory allreduce (pytorch/gloo #458) was merged upstream in January 2026 and
reverted in February (#490); the gloo inside this torch has none of its code, so there is no third
column: the JSON says so in ``gloo_shm``.

Timing: one step is ``reps`` allreduces back to back (enough to fill a few milliseconds at small
sizes), bracketed by a one-element shared-memory allreduce on both ranks so they start together;
the shared timer (:func:`dlperf.timing.time_steps`) takes the median step and watches the machine
for contention. The two paths run in alternating rounds and the least disturbed round (lowest
median) of each is reported; every round's figure is printed too. A step ends when the slower
rank ends, so each figure is the slower rank's. Bus bandwidth = size / time * 2(k-1)/k (k = 2: size /
time). The target is ``proc_allreduce_busbw_gbs`` >= 8 GB/s at 64 MB.

The last stdout line is one JSON object: proc_allreduce_busbw_gbs (shm, 64 MB), gloo_busbw_gbs,
speedup_vs_gloo, the sweep (per size: both paths' microseconds and GB/s, every round, contention),
and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from dlperf.parallel.allreduce.shm import DEFAULT_CHUNK_BYTES, ShmAllreduce
from dlperf.parallel.launchers import ProcessLauncher, rank_info
from dlperf.timing import time_steps

SIZES = tuple(4096 * 4 ** i for i in range(8))  # 4 KB .. 64 MB
HEADLINE_BYTES = 64 * 1024 * 1024
TARGET_GBS = 8.0
STEP_BYTES = 64 * 1024 * 1024  # bytes allreduced per timed step at small sizes (so a step is not all timer)
MAX_REPS = 256
TIMEOUT_S = 600
PATHS = ("shm", "gloo", "copy")


def _reps(nbytes: int) -> int:
    return max(1, min(MAX_REPS, STEP_BYTES // nbytes // 8))


def _worker(rounds: int, steps: int, warmup: int, chunk_bytes: int) -> dict:
    import torch.distributed as dist

    rank, world, _ = rank_info()
    torch.set_num_threads(1)
    out: dict = {}
    with ShmAllreduce(chunk_bytes=chunk_bytes) as shm:
        tick = torch.zeros(1)

        def together() -> None:  # a few microseconds: both ranks leave it within one barrier of each other
            shm.allreduce_(tick)

        for nbytes in SIZES:
            x = torch.ones(nbytes // 4)
            y = torch.empty_like(x)
            paths = {"shm": shm.allreduce_, "gloo": dist.all_reduce, "copy": y.copy_}
            reps = _reps(nbytes)
            cell: dict = {"bytes": nbytes, "reps": reps}
            for name in paths:
                cell[name] = []
            for _ in range(rounds):
                for name, fn in paths.items():
                    def step(fn=fn, x=x, reps=reps) -> None:
                        for _ in range(reps):
                            fn(x)
                    t = time_steps(step, warmup=warmup, steps=steps, synchronize=together, threads=1)
                    cell[name].append({"s": t.median_s / reps, "q1_s": t.q1_s / reps, "q3_s": t.q3_s / reps,
                                       "contended": t.contended, "noisy": t.noisy})
                    x.fill_(1.0)  # repeated sums grow: keep the values finite
            out[str(nbytes)] = cell
    dist.barrier()
    return {"rank": rank, "world": world, "cells": out}


def _merge(results: list[dict]) -> list[dict]:
    """Per size and path: the slower rank's time in each round, then the least disturbed round."""
    rows = []
    for key in results[0]["cells"]:
        cells = [r["cells"][key] for r in results]
        nbytes = cells[0]["bytes"]
        row: dict = {"bytes": nbytes, "reps": cells[0]["reps"]}
        for name in PATHS:
            per_round = [max(c[name][i]["s"] for c in cells) for i in range(len(cells[0][name]))]
            best = min(range(len(per_round)), key=per_round.__getitem__)
            row[name] = {
                "us": per_round[best] * 1e6,
                "busbw_gbs": nbytes / per_round[best] / 1e9,  # k = 2
                "rounds_us": [s * 1e6 for s in per_round],
                "contended": any(c[name][best]["contended"] for c in cells),
                "noisy": any(c[name][best]["noisy"] for c in cells),
            }
        row["speedup"] = row["gloo"]["us"] / row["shm"]["us"]
        row["of_copy"] = row["copy"]["us"] / row["shm"]["us"]
        rows.append(row)
    return rows


def _label(nbytes: int) -> str:
    for unit, size in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the least disturbed counts")
    ap.add_argument("--steps", type=int, default=7, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                    help="ShmAllreduce's bytes per rank per chunk")
    args = ap.parse_args(argv)
    for name in ("rounds", "steps", "chunk_bytes"):
        if getattr(args, name) < 1:
            print(f"--{name.replace('_', '-')}={getattr(args, name)}: expected a positive integer", file=sys.stderr)
            return 2

    results = ProcessLauncher(2, backend="gloo", join_timeout_s=TIMEOUT_S).launch(
        _worker, args.rounds, args.steps, args.warmup, args.chunk_bytes)
    rows = _merge(results)
    head = next(r for r in rows if r["bytes"] == HEADLINE_BYTES)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"allreduce of float32 between 2 processes of one host, 1 thread each (best of {args.rounds} alternating "
          f"rounds, median of {args.steps} steps; {os.cpu_count()} cores, load {load:.1f}; torch {torch.__version__})")
    print(f"shm chunk: {args.chunk_bytes} bytes per rank; '*' marks a contended cell, '~' a noisy one")
    print(f"{'size':>7} {'reps':>5} | {'shm us':>9} {'GB/s':>6} | {'gloo us':>9} {'GB/s':>6} | {'copy us':>9} "
          f"{'GB/s':>6} | {'vs gloo':>7} | shm rounds us / gloo rounds us")
    print("-" * 120)
    for r in rows:
        cells = []
        for n in PATHS:
            mark = ("*" if r[n]["contended"] else "") + ("~" if r[n]["noisy"] else "")
            cells.append(f"{r[n]['us']:>9.1f} {r[n]['busbw_gbs']:>6.2f}{mark:<2}")
        rounds = " ".join(f"{u:.0f}" for u in r["shm"]["rounds_us"]) + " / " + \
            " ".join(f"{u:.0f}" for u in r["gloo"]["rounds_us"])
        print(f"{_label(r['bytes']):>7} {r['reps']:>5} | " + "| ".join(cells) + f"| {r['speedup']:>6.1f}x | {rounds}")
    busbw = head["shm"]["busbw_gbs"]
    verdict = "meets" if busbw >= TARGET_GBS else "misses"
    print(f"\n64 MB: shm {busbw:.2f} GB/s bus bandwidth ({verdict} the {TARGET_GBS:g} GB/s target), gloo "
          f"{head['gloo']['busbw_gbs']:.2f} GB/s ({head['speedup']:.1f}x); both ranks merely copying 64 MB at once: "
          f"{head['copy']['busbw_gbs']:.2f} GB/s, the ceiling here (shm reaches {head['of_copy']:.0%} of it)")
    contended = any(r[n]["contended"] for r in rows for n in PATHS)
    if contended:
        print("WARNING: other work competed for the cores during marked cells; rerun on a quiet machine")
    result = {
        "proc_allreduce_busbw_gbs": busbw,
        "gloo_busbw_gbs": head["gloo"]["busbw_gbs"],
        "speedup_vs_gloo": head["speedup"],
        "copy_ceiling_gbs": head["copy"]["busbw_gbs"],
        "fraction_of_copy_ceiling": head["of_copy"],
        "target_gbs": TARGET_GBS,
        "meets_target": busbw >= TARGET_GBS,
        "gloo_shm": None,
        "gloo_shm_note": "pytorch/gloo #458 (shm allreduce) was reverted by #490; absent from this torch's gloo",
        "chunk_bytes": args.chunk_bytes,
        "sweep": rows,
        "contended": contended,
        "cores": os.cpu_count(),
        "load1": load,
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

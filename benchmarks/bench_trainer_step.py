"""The Trainer's own training step under a pinned plan against the plain PyTorch loop making the same choices.

    flock /tmp/dlperf-cpu.lock .venv/bin/python benchmarks/bench_trainer_step.py
    .venv/bin/python benchmarks/bench_trainer_step.py --rows lenet-1x2,mlp-1x1 --rounds 3

``bench_plan.py`` sets the planner's pick against the best hand-written peer; this script isolates what the
Trainer adds once the choices are the same. Each row is a model and batch, a plan, and the plain loop with
the plan's intra-op threads and layout (``bench_plan``'s peer: model and batch converted to the layout
once, ``zero_grad(set_to_none=True)``, forward, loss, backward, SGD step):

* ``lenet-1x2``: LeNet b256, ``1x2,channels-last,eager,caller`` against the plain loop at 2 threads, channels-last;
* ``resnet56-1x2``: Shi et al.'s ResNet-56 b128, the same plan and peer;
* ``lenet-2x1``: LeNet b256, ``2x1,channels-last`` (two replicas on engine workers, one thread each,
  gradients summed) against the plain loop at 2 threads, channels-last;
* ``mlp-1x1``: d2l's MLP b64, ``1x1,contiguous,eager,caller`` against the plain loop at 1 thread.

The Trainer takes the batch as a user's loader gives it (contiguous): a channels-last plan converts it each
step, as a plain loop over fresh batches would. The two sides of a row are timed in alternating rounds with
the shared timer (warm-up, then the median of single steps, a contention mark per timing); the least
disturbed round of each counts. ``trainer_over_plain`` is the Trainer's step over the plain loop's (target
<= 1.0: a plan costs nothing beyond its choices). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dlperf._hostmem import host_malloc_state, keep_freed_host_memory
from dlperf.machine import usable_cores
from dlperf.parallel import Trainer
from dlperf.parallel.planning.plan import parse_plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_plan import LR, alternate, plain_step, workload  # noqa: E402  (the peers bench_plan times, written once)


@dataclass(frozen=True)
class Row:
    model: str
    """A name of bench_plan's MODELS (its batch too)."""
    plan: str
    """The plan the Trainer is pinned to."""
    steps_scale: int = 1
    """Steps per timing as a multiple of --steps (short steps need more for a steady median)."""


ROWS: dict[str, Row] = {
    "lenet-1x2": Row("lenet", "1x2,channels-last,eager,caller", 2),
    "resnet56-1x2": Row("resnet-56", "1x2,channels-last,eager,caller"),
    "lenet-2x1": Row("lenet", "2x1,channels-last,eager", 2),
    "mlp-1x1": Row("mlp", "1x1,contiguous,eager,caller", 50),
}


def measure_row(row: Row, args: argparse.Namespace) -> dict:
    plan = parse_plan(row.plan)
    model, (X, y), loss = workload(row.model)
    trainer = Trainer(model, plan.devices_for([]), "sgd", {"lr": LR}, loss=loss, plan=plan, processes=None)
    threads = plan.replicas * plan.threads
    configs: dict[str, tuple[Callable[[], object], int]] = {
        "trainer": (lambda: trainer.train_step(X, y), threads),
        "plain": (plain_step(row.model, plan.memory_format == "channels_last"), threads),
    }
    try:
        # the Trainer's plan sets its own threads
        rounds, contended = alternate(configs, args.rounds, args.steps * row.steps_scale,
                                      args.warmup * row.steps_scale, later_warmup=1,
                                      sets_own_threads=lambda key: key != "plain")
    finally:
        trainer.close()
    best = {k: min(v) for k, v in rounds.items()}
    return {"model": row.model, "plan": plan.name, "trainer_ms": best["trainer"], "plain_ms": best["plain"],
            "trainer_over_plain": best["trainer"] / best["plain"], "rounds_ms": rounds, "contended": contended}


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round (short models take a multiple)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds; the least disturbed counts")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; valid: {', '.join(ROWS)}")
    keep_freed_host_memory()  # as dlperf's commands (and bench_plan.py) allocate
    results: dict[str, dict] = {}
    for name in names:
        load_before = load_average()
        results[name] = measure_row(ROWS[name], args)
        results[name]["load"] = [load_before, load_average()]
    print(f"one training step, ms (median of --steps {args.steps} x scale, best of {args.rounds} alternating rounds; "
          f"{usable_cores()} cores; torch {torch.__version__}; host memory: {host_malloc_state()})")
    print(f"{'row':<14} {'plan':<34} {'trainer':>9} {'plain':>9} {'ratio':>7}  load   rounds (trainer | plain)")
    for name, r in results.items():
        mark = " contended" if any(r["contended"].values()) else ""
        rounds = " ".join(f"{v:.2f}" for v in r["rounds_ms"]["trainer"]) + " | " + \
            " ".join(f"{v:.2f}" for v in r["rounds_ms"]["plain"])
        load = "/".join(f"{v:.1f}" for v in r["load"] if v is not None)
        print(f"{name:<14} {r['plan']:<34} {r['trainer_ms']:>9.3f} {r['plain_ms']:>9.3f} "
              f"{r['trainer_over_plain']:>7.3f}  {load}  {rounds}{mark}")
    doc = {"rows": results, "trainer_over_plain": {n: r["trainer_over_plain"] for n, r in results.items()},
           "contended": any(any(r["contended"].values()) for r in results.values()),
           "host_malloc": host_malloc_state(), "cores": usable_cores(), "torch": torch.__version__}
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

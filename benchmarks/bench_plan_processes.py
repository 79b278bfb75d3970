"""dlperf's Trainer across processes against PyTorch DDP, both 2 gloo processes x 1 thread, in the same processes.

    flock /tmp/dlperf-cpu.lock .venv/bin/python benchmarks/bench_plan_processes.py --models lenet,lstm,resnet-56

What a ``2x1,processes`` plan runs (``dlperf train --nproc-per-node 2``: a Trainer in each process with the
``processes`` strategy, each on its slice of the global batch) against DDP on the same slices, same model,
batch and SGD step (bench_plan.py's workloads; channels-last where the model has 2-D convolutions, as both
would pick on CPU). Both run in the same two processes, in alternating rounds; a barrier around each step,
so a step ends with the slower rank. ``dlperf_over_ddp`` per model: the median over rounds of dlperf's step
over DDP's in the same round. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from bench_plan import LR, MODELS, layouts, plain_step, workload
from dlperf.parallel.launchers import ProcessLauncher
from dlperf.timing import time_steps


def _time_model(name: str, steps: int, warmup: int, rounds: int) -> dict[str, list]:
    """This rank's alternating rounds of dlperf's Trainer and DDP on ``name``."""
    import torch.distributed as dist

    from dlperf.devices import cpu
    from dlperf.parallel import Trainer

    model, (X, y), loss = workload(name)
    cl = layouts(model, X)[-1]
    trainer = Trainer(model, [cpu(0)], "sgd", {"lr": LR}, loss=loss, threads=[1],
                      memory_format="channels_last" if cl else "contiguous")
    ddp_step = plain_step(name, cl, ddp=True)

    steps_of = {"dlperf": lambda: trainer.train_step(X, y), "ddp": ddp_step}
    res: dict[str, list] = {"dlperf": [], "ddp": [], "contended": []}
    try:
        for i in range(rounds):
            for key in (("dlperf", "ddp") if i % 2 == 0 else ("ddp", "dlperf")):
                t = time_steps(steps_of[key], warmup=warmup if i < 2 else 0, steps=steps, synchronize=dist.barrier,
                               threads=1)
                res[key].append(t.median_s * 1e3)
                res["contended"].append(t.contended)
    finally:
        trainer.close()
    return res


def _worker(names: list[str], steps: int, warmup: int, rounds: int) -> dict[str, dict[str, list]]:
    torch.set_num_threads(1)
    return {name: _time_model(name, steps, warmup, rounds) for name in names}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="lenet,lstm,resnet-56")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; valid: {', '.join(MODELS)}")
    results = ProcessLauncher(2, backend="gloo", join_timeout_s=1800).launch(_worker, names, args.steps,
                                                                             args.warmup, args.rounds)
    print(f"one training step, ms (2 gloo processes x 1 thread; median of {args.steps} steps per round, "
          f"{args.rounds} alternating rounds; the slower rank's)")
    doc: dict[str, dict] = {}
    for name in names:
        rows = {k: [max(a, b) for a, b in zip(results[0][name][k], results[1][name][k], strict=True)]
                for k in ("dlperf", "ddp")}
        contended = any(results[0][name]["contended"]) or any(results[1][name]["contended"])
        ratio = statistics.median(a / b for a, b in zip(rows["dlperf"], rows["ddp"], strict=True))
        print(f"{name:<10} dlperf {' '.join(f'{v:8.1f}' for v in rows['dlperf'])}   best {min(rows['dlperf']):8.1f}")
        print(f"{'':<10} ddp    {' '.join(f'{v:8.1f}' for v in rows['ddp'])}   best {min(rows['ddp']):8.1f}"
              f"   dlperf/ddp {ratio:.3f}{' (contended)' if contended else ''}")
        doc[name] = {"dlperf_ms": rows["dlperf"], "ddp_ms": rows["ddp"], "dlperf_over_ddp": ratio,
                     "contended": contended}
    print(json.dumps({"models": doc, "dlperf_over_ddp": {n: d["dlperf_over_ddp"] for n, d in doc.items()},
                      "contended": any(d["contended"] for d in doc.values()), "torch": torch.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

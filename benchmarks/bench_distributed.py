"""Data parallelism across processes: the dlperf Trainer against PyTorch DDP, both as 2 gloo processes.

Run under the machine's benchmark lock so nothing else competes for the cores:

    flock /tmp/dlperf-cpu.lock .venv/bin/python benchmarks/bench_distributed.py

LeNet, global batch 256, one training step (forward, backward, gradient sum across the processes, SGD
update), 2 processes on 127.0.0.1 with one intra-op thread each, started once by
:class:`~dlperf.parallel.launchers.ProcessLauncher`:

* dlperf Trainer, one device per process: each process is given the global batch and trains on its
  128 examples; gradient buckets are summed across the processes (``allreduce_across_processes``:
  shared memory between the processes of this host) while backward runs; a second row sends the
  same sums through gloo (``DLPERF_PROCESS_ALLREDUCE=gloo``). It picks channels-last activations for conv nets on CPU.
* PyTorch DistributedDataParallel on each process's 128 examples, as is (contiguous), and with the
  same channels-last layout as the Trainer, to separate the layout's gain from the machinery's.

The configurations alternate step by step, in the same processes (each with a process group of its
own), so a disturbance of the shared machine hits them alike; a step ends when the slower process ends
(a barrier brackets each step). Every round builds the models afresh; the least disturbed round (lowest
median) of each configuration is reported, with every round's median. Each round is watched for other
work on the CPUs (:mod:`dlperf.timing`'s rule); a round that any process saw contended is marked ``!``.

The last stdout line is one JSON object: ratio_vs_ddp_procs (the Trainer's step time over DDP's, as
is: below 1 is faster; ratio_vs_ddp_procs_by_round: the same within each round),
ratio_vs_ddp_procs_channels_last, the times, each round's medians and the
contention per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from dlperf.devices import cpu
from dlperf.models import get_spec
from dlperf.parallel import Trainer
from dlperf.parallel.communication.process_group import PROCESS_ALLREDUCE_ENV
from dlperf.parallel.launchers import ProcessLauncher, rank_info
from dlperf.timing import ContentionMonitor, Timing

BATCH = 256
PROCESSES = 2
TIMEOUT_S = 600
LR = 0.1

# (key, label) of every row, in table order; a measurement returns {key: (median_s, contended)} per round
ROWS = (
    ("ddp", "PyTorch DDP, 2 processes x 1 thread"),
    ("ddp_channels_last", "PyTorch DDP, same, channels-last"),
    ("trainer_gloo", "dlperf Trainer, same, sums through gloo"),
    ("trainer", "dlperf Trainer, 2 processes x 1 thread"),
)


def _batch():
    spec = get_spec("lenet")
    X, y = spec.input.make_batch(BATCH, generator=torch.Generator().manual_seed(1))
    return spec, X, y


def _trainer_step(group, transport: str = "auto") -> Callable[[], object]:
    spec, X, y = _batch()
    torch.manual_seed(0)
    trainer = Trainer(spec.build(), [cpu(0)], "sgd", {"lr": LR}, loss=spec.loss, threads=[1], processes=group)
    step = partial(_with_transport, transport, trainer.train_step, X, y)
    step.close = trainer.close  # type: ignore[attr-defined]
    return step


def _with_transport(transport: str, fn: Callable[..., object], *args: object) -> object:
    """Run one step with the cross-process sums on ``transport`` (train_step returns once they are done)."""
    saved = os.environ.get(PROCESS_ALLREDUCE_ENV)
    os.environ[PROCESS_ALLREDUCE_ENV] = transport
    try:
        return fn(*args)
    finally:
        if saved is None:
            del os.environ[PROCESS_ALLREDUCE_ENV]
        else:
            os.environ[PROCESS_ALLREDUCE_ENV] = saved


def _ddp_step(group, channels_last: bool) -> Callable[[], object]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    spec, X, y = _batch()
    rank, world, _ = rank_info()
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    Xr, yr = X[mine], y[mine]
    torch.manual_seed(0)
    net = spec.build()
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
        Xr = Xr.contiguous(memory_format=torch.channels_last)
    model = DDP(net, process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        spec.loss(model(Xr), yr).backward()  # DDP averages gradients over the processes during backward
        opt.step()

    return step


# how each configuration's step is built on its own process group, by ROWS key, in the order they are built
# and stepped within a round
STEP_BUILDERS: dict[str, Callable[..., Callable[[], object]]] = {
    "trainer": _trainer_step,
    "trainer_gloo": partial(_trainer_step, transport="gloo"),
    "ddp": partial(_ddp_step, channels_last=False),
    "ddp_channels_last": partial(_ddp_step, channels_last=True),
}


def _worker(steps: int, warmup: int, rounds: int,
            keys: Sequence[str] | None = None) -> list[dict[str, tuple[float, bool]]]:
    """One process: per round, the configurations ``keys`` (default: every row) interleaved step by step.

    Each configuration has a process group of its own, so their collectives never pair with each other's.
    """
    import torch.distributed as dist

    keys = list(STEP_BUILDERS) if keys is None else list(keys)
    torch.set_num_threads(1)
    world = dist.get_world_size()
    groups = {key: dist.new_group(list(range(world))) for key in keys}
    out = []
    for _ in range(rounds):
        steps_by_key = {key: STEP_BUILDERS[key](groups[key]) for key in keys}
        try:
            out.append(_interleaved(steps_by_key, steps, warmup))
        finally:
            for step in steps_by_key.values():
                if hasattr(step, "close"):  # a Trainer's engine threads
                    step.close()
    return out


def _interleaved(steps_by_key: dict[str, Callable[[], object]], steps: int,
                 warmup: int) -> dict[str, tuple[float, bool]]:
    """Median seconds per step of each configuration, stepping them in turn so a disturbance hits all."""
    import torch.distributed as dist

    for _ in range(warmup):
        for step in steps_by_key.values():
            step()
    samples: dict[str, list[float]] = {key: [] for key in steps_by_key}
    monitor = ContentionMonitor(threads=1)
    monitor.start()
    for _ in range(steps):
        for key, step in steps_by_key.items():
            # a barrier on each side: both processes start together and a step ends with the slower one
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            samples[key].append(time.perf_counter() - t0)
            monitor.sample()
    contended = monitor.stop().contended
    return {key: (Timing.from_samples(s).median_s, contended) for key, s in samples.items()}


def by_config(per_rank: list[list[dict[str, tuple[float, bool]]]],
              keys: Sequence[str]) -> dict[str, list[tuple[float, bool]]]:
    """The ranks' rounds merged: per configuration, each round's (slower rank's median, any rank contended)."""
    rounds = len(per_rank[0])
    out: dict[str, list[tuple[float, bool]]] = {key: [] for key in keys}
    for r in range(rounds):
        for key in keys:
            samples = [rank_rounds[r][key] for rank_rounds in per_rank]
            out[key].append((max(s[0] for s in samples), any(s[1] for s in samples)))
    return out


def measure(steps: int, warmup: int, rounds: int,
            keys: Sequence[str] | None = None) -> dict[str, list[tuple[float, bool]]]:
    """Per configuration, each round's (slower process's median seconds, any process contended)."""
    keys = [key for key, _ in ROWS] if keys is None else list(keys)
    launcher = ProcessLauncher(PROCESSES, backend="gloo", join_timeout_s=TIMEOUT_S)
    return by_config(launcher.launch(_worker, steps, warmup, rounds, keys), keys)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the least disturbed counts")
    args = ap.parse_args(argv)

    rounds = measure(args.steps, args.warmup, args.rounds)
    best = {key: min(rs, key=lambda r: r[0]) for key, rs in rounds.items()}

    print(f"LeNet, global batch {BATCH}, one training step, {PROCESSES} gloo processes on 127.0.0.1 x 1 thread "
          f"(median of {args.steps} steps, best of {args.rounds} alternating rounds; {os.cpu_count()} cores; "
          f"torch {torch.__version__})")
    print(f"{'configuration':<48} {'ms/step':>8}  {'each round':<24}")
    print("-" * 84)
    for key, label in ROWS:
        ms, contended = best[key][0] * 1e3, best[key][1]
        each = " ".join(f"{s * 1e3:.1f}{'!' if c else ''}" for s, c in rounds[key])
        print(f"{label:<48} {ms:>8.1f}{'!' if contended else ' '} {each}")
    contended = any(best[key][1] for key, _ in ROWS)
    if contended:
        print("! other work competed for the CPUs while this was timed (dlperf.timing's rule); rerun on a quiet "
              "machine")
    ours = best["trainer"][0]
    # the same ratio within each round (the configurations stepped in turn there): how steady it is
    paired = [t[0] / d[0] for t, d in zip(rounds["trainer"], rounds["ddp"])]
    print(f"Trainer / DDP: {ours / best['ddp'][0]:.2f} (best rounds); within each round: "
          + " ".join(f"{r:.2f}" for r in paired))
    result = {
        "ratio_vs_ddp_procs": ours / best["ddp"][0],
        "ratio_vs_ddp_procs_by_round": paired,
        "ratio_vs_ddp_procs_channels_last": ours / best["ddp_channels_last"][0],
        "ratio_shm_vs_gloo_sums": ours / best["trainer_gloo"][0],
        **{f"{key}_ms": best[key][0] * 1e3 for key, _ in ROWS},
        "rounds_ms": {key: [s * 1e3 for s, _ in rs] for key, rs in rounds.items()},
        "contended_by_config": {key: best[key][1] for key, _ in ROWS},
        "contended": contended,
        "processes": PROCESSES, "threads_per_process": 1, "batch": BATCH,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

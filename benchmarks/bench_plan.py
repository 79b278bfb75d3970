"""dlperf's planned training step against the peers a practitioner writes by hand, per model, in one run.

    flock /tmp/dlperf-cpu.lock .venv/bin/python benchmarks/bench_plan.py            # every model
    .venv/bin/python benchmarks/bench_plan.py --quick --models lenet,mlp            # a few minutes

For each model and batch (LeNet b256, ResNet-18 on 28x28 b128, Shi et al.'s fcn-s b64 and ResNet-56 b128,
the zoo's LSTM b128, a small Transformer-encoder classifier b64, d2l's MLP b64):

* **planning**: :func:`dlperf.parallel.training.planned.plan_for` on the machine's cores with a fresh plan cache
  (``planning_s``), then again with the decision cached (``cached_planning_s``); ``--run-steps N`` plans for
  a run of N steps, as ``dlperf train`` does (budget 10% of it, at most 30 s; ``torch.compile`` weighed
  against it), else the run's length is unknown (budget 30 s, compile not tried);
* **dlperf planned**: a Trainer following the chosen plan, one training step on the whole batch; a plan whose
  replicas are processes runs as those processes (a Trainer in each, on its slice, as ``dlperf train`` starts
  them), started once and stepped from here in the same alternating rounds (one local store round trip a step);
* **peers**: a plain PyTorch loop (zero_grad, forward, loss, backward, SGD step) with 1 and with 2 intra-op
  threads, each contiguous and, for models with 2-D convolutions, channels-last; and PyTorch DDP with 2 gloo
  processes of 1 thread each on 127.0.0.1, each layout, started once for every model. These are
  ``bench_data_parallel.py``'s peers (there for LeNet only), written here for any model.

The in-process configurations are timed in alternating rounds with the shared timer (warm-up, then the median
of single steps; each timing carries a contention mark); the least disturbed round of each counts.
``plan_vs_best_peer`` is the planned step over the fastest peer's (<= 1.0: never slower than the best
hand-tuned peer). On the small models (MLP, Transformer) a Trainer pinned to the plain loop's choices (one
replica, one thread, on the calling thread, eager) runs beside them: ``trainer_overhead`` is its step over
``plain_1t``'s, the Trainer's own bookkeeping. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dlperf._hostmem import host_malloc_state, keep_freed_host_memory
from dlperf.devices import cpu
from dlperf.machine import usable_cores
from dlperf.models import get_spec
from dlperf.parallel import Trainer
from dlperf.parallel.launchers import ProcessLauncher, rank_info
from dlperf.parallel.planning.plan import uses_conv2d
from dlperf.parallel.planning.records import PlannerOptions
from dlperf.parallel.training.planned import plan_for, start_candidate
from dlperf.parallel.training.trainer_config import TrainerConfig
from dlperf.timing import time_steps

DDP_TIMEOUT_S = 600
LR = 0.01


class TransformerClassifier(nn.Module):
    """A small Transformer-encoder classifier on token ids: embedding, 2 encoder layers, mean pool, linear."""

    def __init__(self, vocab: int = 1000, d_model: int = 64, heads: int = 4, layers: int = 2, classes: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def _transformer_batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 1000, (n, 32), generator=g), torch.randint(0, 4, (n,), generator=g)


# name -> (zoo name or None, batch)
MODELS: dict[str, tuple[str | None, int]] = {
    "lenet": ("lenet", 256), "resnet18": ("resnet18", 128), "fcn-s": ("fcn-s", 64), "resnet-56": ("resnet-56", 128),
    "lstm": ("lstm", 128), "transformer": (None, 64), "mlp": ("mlp", 64),
}


SMALL = ("mlp", "transformer")
BOOKKEEPING_PLAN = "1x1,contiguous,eager,caller"
"""The plain loop's choices inside the Trainer: ``trainer_1x1_eager`` over ``plain_1t`` is its bookkeeping."""


def workload(name: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], Callable]:
    """(model, (inputs, targets), loss) with fixed seeds: every process and configuration gets the same."""
    zoo, batch = MODELS[name]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if zoo is None:
        return TransformerClassifier(), _transformer_batch(batch, g), nn.functional.cross_entropy
    spec = get_spec(zoo)
    return spec.build(), spec.input.make_batch(batch, generator=g), spec.loss


def layouts(model: nn.Module, X: torch.Tensor) -> list[bool]:
    return [False, True] if uses_conv2d(model) and X.dim() == 4 else [False]


def plain_step(name: str, channels_last: bool, ddp: bool = False) -> Callable[[], None]:
    """The hand-written loop: one model, SGD, the whole batch; with ``ddp`` the model wrapped in PyTorch's
    DistributedDataParallel on this rank's slice of the batch (inside a launched process group)."""
    model, (X, y), loss = workload(name)
    if ddp:
        rank, world, _ = rank_info()
        mine = slice(rank * X.shape[0] // world, (rank + 1) * X.shape[0] // world)
        X, y = X[mine], y[mine]
    if channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        X = X.contiguous(memory_format=torch.channels_last)
    if ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss(model(X), y).backward()  # under DDP the gradients are averaged over ranks during backward
        opt.step()
    return step


def _ddp_worker(names: list[str], steps: int, warmup: int, rounds: int) -> dict[str, float]:
    """One DDP rank: each model's steps on its half of the batch, both layouts where they apply."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    out: dict[str, float] = {}
    for name in names:
        model0, (X, _), _ = workload(name)
        for cl in layouts(model0, X):
            step = plain_step(name, cl, ddp=True)
            # a barrier around each step: both ranks start together, a step ends with the slower
            best = min(time_steps(step, warmup=warmup, steps=steps, synchronize=dist.barrier, threads=1).median_s
                       for _ in range(rounds))
            out[f"{name}/ddp{'_channels_last' if cl else ''}"] = best * 1e3
    return out


def measure_ddp(names: list[str], steps: int, warmup: int, rounds: int) -> dict[str, float]:
    launcher = ProcessLauncher(2, backend="gloo", join_timeout_s=DDP_TIMEOUT_S)
    results = launcher.launch(_ddp_worker, names, steps, warmup, rounds)
    return {k: max(r[k] for r in results) for k in results[0]}  # a step ends when the slower rank ends


def alternate(configs: dict[str, tuple[Callable[[], object], int]], rounds: int, steps: int, warmup: int,
              later_warmup: int = 0, sets_own_threads: Callable[[str], bool] = lambda key: False
              ) -> tuple[dict[str, list[float]], dict[str, bool]]:
    """Each config's median ms per step in every round, and whether any of its timings was contended.

    ``configs`` maps a name to (step, threads); the order is reversed every other round so drift hits all
    alike. A plain loop runs at its thread count; a config that ``sets_own_threads`` (a Trainer under a plan)
    is left at what it sets. ``warmup`` steps precede the first round, ``later_warmup`` each later one.
    """
    by_round: dict[str, list[float]] = {k: [] for k in configs}
    contended = dict.fromkeys(configs, False)
    for i in range(rounds):
        for key in (configs if i % 2 == 0 else dict(reversed(configs.items()))):
            step, threads = configs[key]
            before = torch.get_num_threads()
            torch.set_num_threads(before if sets_own_threads(key) else threads)
            try:
                t = time_steps(step, warmup=warmup if i == 0 else later_warmup, steps=steps, threads=threads)
            finally:
                torch.set_num_threads(before)
            by_round[key].append(t.median_s * 1e3)
            contended[key] |= t.contended
    return by_round, contended


def measure_model(name: str, args: argparse.Namespace, cache_dir: str) -> dict:
    model, (X, y), loss = workload(name)
    # a fresh plan cache: planning_s is a first run's (the compiled native interpreter stays cached)
    options = PlannerOptions(steps=args.plan_steps, rounds=args.plan_rounds, run_steps=args.run_steps,
                             cache_path=os.path.join(cache_dir, "plans.json"))
    t0 = time.perf_counter()
    decision = plan_for(model, (X, y), optimizer_params={"lr": LR}, loss=loss, options=options, processes=True)
    planning_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cached = plan_for(model, (X, y), optimizer_params={"lr": LR}, loss=loss, options=options, processes=True)
    cached_s = time.perf_counter() - t0
    assert cached.cached and cached.plan == decision.plan
    plan = decision.plan
    if plan.launcher == "processes":  # as dlperf train runs it: the plan's processes, each a Trainer on its slice
        trainer: Any = start_candidate(plan, workload(name)[0], (X, y),
                                       TrainerConfig("sgd", {"lr": LR}, loss=loss, processes=None))
        planned: Callable[[], object] = trainer.step
    else:
        trainer = Trainer(workload(name)[0], plan.devices_for([cpu(0)]), "sgd", {"lr": LR}, loss=loss, plan=plan,
                          processes=None)
        planned = lambda: trainer.train_step(X, y)  # noqa: E731
    configs: dict[str, tuple[Callable[[], object], int]] = {"dlperf_planned": (planned, plan.replicas * plan.threads)}
    for threads in (1, 2):
        for cl in layouts(model, X):
            configs[f"plain_{threads}t{'_channels_last' if cl else ''}"] = (plain_step(name, cl), threads)
    bookkeeping = None
    if name in SMALL:  # the Trainer's own cost per step, where a step is short enough to show it
        bookkeeping = Trainer(workload(name)[0], [cpu(0)], "sgd", {"lr": LR}, loss=loss, plan=BOOKKEEPING_PLAN,
                              processes=None)
        configs["trainer_1x1_eager"] = (lambda: bookkeeping.train_step(X, y), 1)
    try:
        rounds, contended = alternate(configs, args.rounds, args.steps, args.warmup,
                                      sets_own_threads=lambda key: key.startswith(("dlperf", "trainer")))
    finally:
        trainer.close()
        if bookkeeping is not None:
            bookkeeping.close()
    return {"plan": plan.name, "plan_line": plan.line(), "reasons": list(plan.reasons), "planning_s": planning_s,
            "cached_planning_s": cached_s, "skipped": decision.skipped, "candidates": decision.to_dict()["candidates"],
            "ms": {k: min(v) for k, v in rounds.items()}, "rounds_ms": rounds, "contended": contended}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the least disturbed counts")
    ap.add_argument("--plan-steps", type=int, default=3, help="the planner's timed steps per candidate and round")
    ap.add_argument("--plan-rounds", type=int, default=3)
    ap.add_argument("--run-steps", type=int, default=None,
                    help="the length of the run the planner plans for (its budget is 10%% of it, at most 30 s, and "
                         "torch.compile is weighed against it); default: unknown (30 s, compile not tried)")
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds (a few minutes for every model)")
    ap.add_argument("--no-ddp", action="store_true", help="skip the DDP peers (no process launch)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds, args.plan_steps, args.plan_rounds = 3, 1, 2, 2, 2
    spelled = {k.replace("-", ""): k for k in MODELS}  # resnet-18 or resnet18, as the zoo or this table spells it
    names = [spelled.get(n.strip().lower().replace("-", ""), n.strip()) for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if args.run_steps is not None and args.run_steps < 1:
        ap.error(f"--run-steps {args.run_steps}: expected a number of steps >= 1")
    if unknown:
        ap.error(f"unknown models {unknown}; valid: {', '.join(MODELS)}")
    keep_freed_host_memory()  # as dlperf's commands (and bench_data_parallel.py) allocate
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as cache_dir:
        for name in names:
            started = time.perf_counter()
            results[name] = measure_model(name, args, cache_dir)
            print(f"{name}: {results[name]['plan']} ({time.perf_counter() - started:.0f} s)", file=sys.stderr,
                  flush=True)
    ddp = {} if args.no_ddp else measure_ddp(names, args.steps, args.warmup, args.rounds)

    print(f"one training step per model, ms (median of {args.steps} steps, best of {args.rounds} alternating rounds; "
          f"{usable_cores()} cores; torch {torch.__version__}; host memory: {host_malloc_state()})")
    summary: dict[str, dict] = {}
    for name in names:
        r = results[name]
        peers = {k: v for k, v in r["ms"].items() if k not in ("dlperf_planned", "trainer_1x1_eager")}
        peers.update({k.split("/", 1)[1]: v for k, v in ddp.items() if k.startswith(name + "/")})
        best_peer = min(peers, key=peers.__getitem__)
        ratio = r["ms"]["dlperf_planned"] / peers[best_peer]
        print(f"\n{name} ({MODELS[name][1]} examples): {r['plan_line']}")
        print(f"  planning {r['planning_s']:.1f} s, cached {r['cached_planning_s']:.2f} s"
              + (f"; skipped: {'; '.join(r['skipped'])}" if r["skipped"] else ""))
        rows = {"dlperf_planned": r["ms"]["dlperf_planned"], **peers}
        overhead = None
        if "trainer_1x1_eager" in r["ms"]:
            rows["trainer_1x1_eager"] = r["ms"]["trainer_1x1_eager"]
            overhead = r["ms"]["trainer_1x1_eager"] / r["ms"]["plain_1t"]
        for key, ms in rows.items():
            mark = " (contended)" if r["contended"].get(key) else ""
            print(f"  {key:<34} {ms:>9.2f}{mark}")
        print(f"  plan_vs_best_peer {ratio:.3f} (best peer: {best_peer})"
              + (f"; trainer_overhead {overhead:.3f} (trainer_1x1_eager / plain_1t)" if overhead else ""))
        summary[name] = {"plan": r["plan"], "plan_vs_best_peer": ratio, "best_peer": best_peer,
                         "planned_ms": r["ms"]["dlperf_planned"], "peers_ms": peers, "planning_s": r["planning_s"],
                         "cached_planning_s": r["cached_planning_s"], "skipped": r["skipped"],
                         "contended": any(r["contended"].values()), "rounds_ms": r["rounds_ms"],
                         "candidates": r["candidates"], "trainer_overhead": overhead}
    ratios = [s["plan_vs_best_peer"] for s in summary.values()]
    doc = {"models": summary, "plan_vs_best_peer": {n: s["plan_vs_best_peer"] for n, s in summary.items()},
           "planning_s": {n: s["planning_s"] for n, s in summary.items()},
           "cached_planning_s": {n: s["cached_planning_s"] for n, s in summary.items()},
           "trainer_overhead": {n: s["trainer_overhead"] for n, s in summary.items() if s["trainer_overhead"]},
           "at_most_1": sum(r <= 1.0 for r in ratios), "at_most_0_9": sum(r <= 0.9 for r in ratios),
           "contended": any(s["contended"] for s in summary.values()), "host_malloc": host_malloc_state(),
           "cores": usable_cores(), "torch": torch.__version__, "run_steps": args.run_steps}
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Your own loop under dlperf.Loop against the same loop written plainly, in the same run.

    flock /tmp/dlperf-cpu.lock .venv/bin/python benchmarks/bench_your_loop.py
    .venv/bin/python benchmarks/bench_your_loop.py --models mlp,gru --rounds 3 --steps 10

Four models, each trained by the loop users write (``zero_grad``, forward, their loss, backward, step) on
fresh random batches:

* ``mlp``: d2l's MLP 512-256-128-2, batch 64, cross-entropy, SGD with momentum;
* ``transformer``: a HuggingFace-style classifier (2 encoder layers, width 64, 4 heads) on token ids, batch 32 of
  32 tokens, the batch a dict ``{input_ids, attention_mask, labels}`` passed as ``model(**batch)``, its own loss
  from ``outputs["loss"]``, AdamW;
* ``lenet``: d2l's LeNet, batch 128 of 28x28, cross-entropy, SGD with momentum;
* ``gru``: a GRU regressor (16 features, 64 hidden, 20 steps) with a ``[B, 1]`` head, batch 64, MSE, AdamW.

Each model's loop runs three ways, each on its own copy of the model: plain, through ``dlperf.Loop()`` with no
plan, and through ``dlperf.Loop(plan="auto")``. Every comparison steps two loops in turn, step by step
(a, b, b, a, ...) for ``--rounds`` rounds of ``--steps`` each, so the machine's load moves both alike within
milliseconds, with dlperf's contention check over each round; a ratio is the median over the rounds of the two
loops' median steps in that round (``best_rounds_*``: the ratio of their least disturbed rounds instead):

* the plain loop at 1 against 2 intra-op threads: the faster (by its median round) is the peer, the plain loop
  at its best thread count (``best_plain_threads`` says which);
* ``own_loop_overhead``: the loop through ``dlperf.Loop()`` with no plan over the plain loop, both at 1 thread
  (target <= 1.03: the wrapper costs nearly nothing); ``own_loop_overhead_cpu`` the same from the calling
  thread's CPU time per step, which other processes' load does not inflate;
* ``own_loop_auto_vs_plain``: the loop through ``dlperf.Loop(plan="auto")``, started at torch's default threads
  (the loop as the user wrote it) and tuned on its own first steps (``tuning_steps``, ``tuning_s``: what tuning
  took, untimed here), then at what it chose, over the plain loop at its best thread count (target <= 1.0 on
  every model).

A table for people, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import dlperf
from dlperf._hostmem import host_malloc_state, keep_freed_host_memory
from dlperf.models import get_model
from dlperf.parallel.planning.planner import usable_cores
from dlperf.timing import ContentionMonitor


class HFClassifier(nn.Module):
    """A HuggingFace-style sequence classifier: keyword forward, ``labels=None``, a dict with ``loss`` and
    ``logits``."""

    def __init__(self, vocab: int = 1000, width: int = 64, layers: int = 2, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, input_ids, attention_mask, labels=None):
        hidden = self.encoder(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        logits = self.head((hidden * mask).sum(1) / mask.sum(1).clamp(min=1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


class GRURegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(16, 64, batch_first=True)
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        out, _ = self.gru(x)
        return self.head(out[:, -1])


@dataclass(frozen=True)
class Workload:
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Any]
    """One fresh batch: ``(inputs, targets)`` or a dict the model takes as keywords."""
    loss: Callable[[Any, Any], torch.Tensor] | None
    """The user's loss on (outputs, targets); None: the model's own (``outputs["loss"]``)."""
    optimizer: Callable[[Any], torch.optim.Optimizer]
    description: str


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _tokens(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1000, (32, 32), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones(32, 32, dtype=torch.int64),
            "labels": torch.randint(0, 4, (32,), generator=g)}


MODELS: dict[str, Workload] = {
    "mlp": Workload(lambda: get_model("mlp"),
                    lambda g: (torch.randn(64, 512, generator=g), torch.randint(0, 2, (64,), generator=g)),
                    nn.functional.cross_entropy, _sgd, "d2l MLP 512-256-128-2, b64, CE, SGD"),
    "transformer": Workload(HFClassifier, _tokens, None, _adamw,
                            "HF-style encoder 2x64, b32x32 tokens, dict batch, own loss, AdamW"),
    "lenet": Workload(lambda: get_model("lenet"),
                      lambda g: (torch.randn(128, 1, 28, 28, generator=g), torch.randint(0, 10, (128,), generator=g)),
                      nn.functional.cross_entropy, _sgd, "d2l LeNet, b128, CE, SGD"),
    "gru": Workload(GRURegressor, lambda g: (torch.randn(64, 20, 16, generator=g), torch.randn(64, 1, generator=g)),
                    nn.functional.mse_loss, _adamw, "GRU 16-64 over 20 steps, [B,1] head, b64, MSE, AdamW"),
}


class UsersLoop:
    """The loop as users write it, one step per call; with ``loop``, the same lines through dlperf.Loop."""

    def __init__(self, work: Workload, model: nn.Module, batches: list[Any], loop: dlperf.Loop | None) -> None:
        self.work, self.loop = work, loop
        opt = work.optimizer(model.parameters())
        if loop is not None:
            model, opt = loop.setup(model, opt)
        self.model, self.opt = model, opt
        data = loop.setup_data(batches) if loop is not None else batches
        self._batches: Iterator[Any] = itertools.cycle(data)

    def step(self) -> None:
        batch = next(self._batches)
        self.opt.zero_grad()
        if self.work.loss is None:
            loss = self.model(**batch)["loss"]
        else:
            x, y = batch
            loss = self.work.loss(self.model(x), y)
        if self.loop is None:
            loss.backward()
        else:
            self.loop.backward(loss)
        self.opt.step()


def interleaved(a: tuple[Callable[[], None], int], b: tuple[Callable[[], None], int], rounds: int, steps: int
                ) -> tuple[dict[str, list[float]], bool]:
    """Two loops stepped in turn (a, b, b, a, ...), each at its intra-op threads (set outside the timed brackets),
    so the machine's load moves both alike within milliseconds: per round each one's median ms per step
    (``a``, ``b``), and with equal threads its median CPU time per step on the calling thread (``a_cpu``,
    ``b_cpu``: at one thread all of a step's work runs there, and waiting for a core while other processes run is
    not counted); and whether the timer's contention check marked any round. Blocks of steps, as dlperf's timer
    takes them elsewhere, drown a few percent in other processes' load on a shared machine."""
    keys = ("a", "b", "a_cpu", "b_cpu")
    by_round: dict[str, list[float]] = {k: [] for k in keys}
    contended = False
    before = torch.get_num_threads()
    try:
        for _ in range(rounds):
            for step, threads in (a, b):  # warm: the first step after the other one's threads
                torch.set_num_threads(threads)
                step()
            samples: dict[str, list[float]] = {k: [] for k in keys}
            monitor = ContentionMonitor(max(a[1], b[1]))
            monitor.start()
            for i in range(steps):
                for key in (("a", "b") if i % 2 == 0 else ("b", "a")):
                    step, threads = a if key == "a" else b
                    if torch.get_num_threads() != threads:
                        torch.set_num_threads(threads)
                    c0, t0 = time.thread_time(), time.perf_counter()
                    step()
                    samples[key].append(time.perf_counter() - t0)
                    samples[f"{key}_cpu"].append(time.thread_time() - c0)
                    monitor.sample()
            contended |= monitor.stop().contended
            for key, values in samples.items():
                by_round[key].append(statistics.median(values) * 1e3)
    finally:
        torch.set_num_threads(before)
    if a[1] != b[1]:
        del by_round["a_cpu"], by_round["b_cpu"]
    return by_round, contended


def paired(rounds: dict[str, list[float]], a: str, b: str) -> float:
    """The median over the rounds of ``a``'s time over ``b``'s in the same round."""
    return statistics.median(x / y for x, y in zip(rounds[a], rounds[b], strict=True))


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    work = MODELS[name]
    torch.manual_seed(0)
    model = work.build()
    g = torch.Generator().manual_seed(1)
    batches = [work.batch(g) for _ in range(16)]
    default_threads = torch.get_num_threads()
    plain = UsersLoop(work, copy.deepcopy(model), batches, None)
    steps = args.steps * (5 if name == "mlp" else 1)  # the MLP's steps are short: more for a steady median
    with dlperf.Loop() as bare, dlperf.Loop(plan="auto") as auto:
        wrapped = UsersLoop(work, copy.deepcopy(model), batches, bare)
        tuned = UsersLoop(work, copy.deepcopy(model), batches, auto)
        # the loop as the user runs it: torch's default threads until the plan says otherwise
        started, tuning_steps = time.perf_counter(), 0
        while auto.tuning and tuning_steps < args.max_tuning_steps:
            tuned.step()
            tuning_steps += 1
        tuning_s = time.perf_counter() - started
        if auto.tuning:  # timing a loop still switching between candidates would time the tuning, not the plan
            raise SystemExit(f"bench_your_loop: {name} still tuning after --max-tuning-steps "
                             f"{args.max_tuning_steps}; raise it")
        assert auto.plan is not None
        chosen = auto.plan
        table = auto.tuner.table() if auto.tuner is not None else ""
        threads, threads_contended = interleaved((plain.step, 1), (plain.step, 2), args.rounds, steps)
        best_threads = 1 if statistics.median(threads["a"]) <= statistics.median(threads["b"]) else 2
        overhead, overhead_contended = interleaved((plain.step, 1), (wrapped.step, 1), args.rounds, steps)
        # auto at the threads the Loop set for the user's thread (the other pairs changed it in between)
        versus, versus_contended = interleaved((plain.step, best_threads), (tuned.step, chosen.threads),
                                               args.rounds, steps)
    torch.set_num_threads(default_threads)
    rounds = {"plain_1t": threads["a"], "plain_2t": threads["b"], "plain_1t_beside_wrapped": overhead["a"],
              "wrapped_1t": overhead["b"], "plain_1t_cpu": overhead["a_cpu"], "wrapped_1t_cpu": overhead["b_cpu"],
              "plain_best_beside_auto": versus["a"], "auto": versus["b"]}
    best = {k: _ms(min(v)) for k, v in rounds.items()}
    contended = {"threads": threads_contended, "overhead": overhead_contended, "auto": versus_contended}
    return {"model": name, "what": work.description, "plain_ms": best["plain_best_beside_auto"],
            "best_plain_threads": best_threads, "plain_1t_ms": best["plain_1t"], "plain_2t_ms": best["plain_2t"],
            "wrapped_1t_ms": best["wrapped_1t"], "auto_ms": best["auto"], "auto_plan": chosen.name,
            "tuning_steps": tuning_steps, "tuning_s": round(tuning_s, 1),
            "own_loop_overhead": round(paired(rounds, "wrapped_1t", "plain_1t_beside_wrapped"), 3),
            "own_loop_overhead_cpu": round(paired(rounds, "wrapped_1t_cpu", "plain_1t_cpu"), 3),
            "own_loop_auto_vs_plain": round(paired(rounds, "auto", "plain_best_beside_auto"), 3),
            "best_rounds_overhead": round(best["wrapped_1t"] / best["plain_1t_beside_wrapped"], 3),
            "best_rounds_auto_vs_plain": round(best["auto"] / best["plain_best_beside_auto"], 3),
            "rounds_ms": {k: [_ms(x) for x in v] for k, v in rounds.items()},
            "contended": contended, "any_contended": any(contended.values()), "tuning_table": table}


def _ms(x: float) -> float:
    """Milliseconds to four significant digits (the figures' noise is far larger)."""
    return float(f"{x:.4g}")


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--steps", type=int, default=12, help="steps of each loop per round (the MLP takes 5x)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds; a ratio is the median of the rounds' ratios")
    ap.add_argument("--max-tuning-steps", type=int, default=5000, help="stop waiting for plan='auto' after this")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; valid: {', '.join(MODELS)}")
    keep_freed_host_memory()  # as dlperf's commands allocate
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        load_before = load_average()
        results[name] = measure(name, args)
        results[name]["load"] = [load_before, load_average()]
    print(f"one step of your own loop, ms (best of {args.rounds} rounds of {args.steps} steps taken in turn with its "
          f"peer's; ratios: median of the rounds' ratios; {usable_cores()} cores; torch {torch.__version__})")
    print(f"{'model':<12} {'plain 1t':>9} {'plain 2t':>9} {'wrapped':>9} {'auto':>9} {'overhead':>9} {'auto/best':>9}"
          "  auto's plan / tuning / load")
    for name, r in results.items():
        mark = " contended" if r["any_contended"] else ""
        load = "-".join(f"{v:.1f}" for v in r["load"] if v is not None)
        print(f"{name:<12} {r['plain_1t_ms']:>9.3f} {r['plain_2t_ms']:>9.3f} {r['wrapped_1t_ms']:>9.3f} "
              f"{r['auto_ms']:>9.3f} {r['own_loop_overhead']:>9.3f} {r['own_loop_auto_vs_plain']:>9.3f}  "
              f"{r['auto_plan']} / {r['tuning_steps']} steps {r['tuning_s']:.1f} s / load {load}{mark}")
    for name, r in results.items():
        print(f"\n{name}: plan='auto' tuning\n{r['tuning_table']}")
    loads = [v for r in results.values() for v in r["load"] if v is not None]
    doc = {"models": {n: {k: v for k, v in r.items() if k != "tuning_table"} for n, r in results.items()},
           "own_loop_overhead": {n: r["own_loop_overhead"] for n, r in results.items()},
           "own_loop_auto_vs_plain": {n: r["own_loop_auto_vs_plain"] for n, r in results.items()},
           "contended": any(r["any_contended"] for r in results.values()),
           "load": [min(loads), max(loads)] if loads else None, "cores": usable_cores(),
           "host_malloc": host_malloc_state(), "torch": torch.__version__}
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

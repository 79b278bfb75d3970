"""What a batch structure costs the Trainer: a dict batch against one tensor, for the same computation.

Run under the machine's benchmark lock so nothing else competes for the cores:

    flock /tmp/dlperf-cpu.lock .venv/bin/python benchmarks/bench_batches.py

A small token model (EmbeddingBag 1000x64, mean of 32 token ids, then 64-64-4), global batch 64,
one training step, measured in one run with the shared timer (warm-up, then the median of single
steps), in short alternating rounds with both Trainers open; the least disturbed round (lowest median)
of each is shown, and the ratio is the median over rounds of the dict round's median over the tensor
round's just before it:

* ``trainer_tensor``: the Trainer on cpu(0),cpu(1), one thread each, the batch one int64 tensor;
* ``trainer_dict``: the same model and data taken as a dict ``{"ids": ..., "lang": "en"}`` with dict
  targets ``{"label": ...}``: split by :func:`dlperf.batch.split_tree`, called by ``call_model``;
* ``plain_dict``: a plain PyTorch loop on the dict batch, one thread (what the step costs without
  any data parallelism);
* the split alone (``split_step``: size the batch, cut it, place the parts), tensor and dict in turns,
  the best block of 200 calls each: what the structure adds to a step without the machine's noise.

The last stdout line is one JSON object: ``dict_over_tensor`` (target: at most 1.05, the structure's
cost within 5% of the step), each round's ratio, the best medians, each round's, and ``contended``
(from the timer: any best round marked).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from torch import nn

from dlperf._hostmem import keep_freed_host_memory
from dlperf.devices import cpu
from dlperf.parallel import Trainer
from dlperf.parallel.split import split_step
from dlperf.timing import best_of, time_steps

BATCH, SEQ, VOCAB = 64, 32, 1000


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(VOCAB, 64, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(ids))


class DictTokens(Tokens):
    def forward(self, batch: dict) -> torch.Tensor:  # type: ignore[override]
        assert batch["lang"] == "en"
        return super().forward(batch["ids"])


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def trainer_step(as_dict: bool) -> tuple[Trainer, object]:
    """An open Trainer on cpu(0),cpu(1) and its step on the batch as one tensor or as a dict."""
    ids, labels = _data()
    torch.manual_seed(0)
    if as_dict:
        model, X, y = DictTokens(), {"ids": ids, "lang": "en"}, {"label": labels}

        def loss(out, target):
            return nn.functional.cross_entropy(out, target["label"])
    else:
        model, X, y, loss = Tokens(), ids, labels, nn.functional.cross_entropy
    trainer = Trainer(model, [cpu(0), cpu(1)], "sgd", {"lr": 0.1}, loss=loss, threads=[1, 1], processes=None)
    return trainer, lambda: trainer.train_step(X, y)


def measure_split(rounds: int) -> dict[str, float]:
    """The step's split alone (``split_step``: size, cut, place on two devices), tensor and dict in turns:
    microseconds, the best block of each (a single thread's Python, so the least disturbed block is it)."""
    ids, labels = _data()
    devices = [cpu(0), cpu(1)]
    batches = {"tensor": (ids, labels), "dict": ({"ids": ids, "lang": "en"}, {"label": labels})}
    best = {k: float("inf") for k in batches}
    for _ in range(rounds):
        for key, (X, y) in batches.items():
            best[key] = min(best[key], best_of(lambda X=X, y=y: split_step(X, y, devices), reps=5, calls=200) * 1e6)
    return best


def measure_plain(steps: int, warmup: int) -> dict:
    ids, labels = _data()
    torch.manual_seed(0)
    model, X = DictTokens(), {"ids": ids, "lang": "en"}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), labels).backward()
        opt.step()

    try:
        t = time_steps(step, warmup=warmup, steps=steps, threads=1)
    finally:
        torch.set_num_threads(before)
    return {"ms": t.median_s * 1e3, "contended": t.contended}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=15, help="alternating rounds")
    args = ap.parse_args(argv)
    keep_freed_host_memory()  # as dlperf's commands allocate (see bench_data_parallel.py)
    (tensor_trainer, tensor_step), (dict_trainer, dict_step) = trainer_step(False), trainer_step(True)
    # Both trainers stay open and their rounds alternate, short, so that a change of the machine's load
    # falls on both: on a shared machine the per-round ratio is steadier than either median.
    configs = {"trainer_tensor": tensor_step, "trainer_dict": dict_step}
    rounds: dict[str, list[dict]] = {k: [] for k in [*configs, "plain_dict"]}
    try:
        for _ in range(args.rounds):
            for key, step in configs.items():
                t = time_steps(step, warmup=args.warmup, steps=args.steps, threads=2)
                rounds[key].append({"ms": t.median_s * 1e3, "contended": t.contended})
            rounds["plain_dict"].append(measure_plain(args.steps, args.warmup))
    finally:
        tensor_trainer.close()
        dict_trainer.close()
    ratios = sorted(d["ms"] / t["ms"] for d, t in zip(rounds["trainer_dict"], rounds["trainer_tensor"]))
    split_us = measure_split(args.rounds)
    best = {k: min(v, key=lambda r: r["ms"]) for k, v in rounds.items()}
    labels = {"trainer_tensor": "Trainer cpu(0),cpu(1): one int64 tensor",
              "trainer_dict": "Trainer cpu(0),cpu(1): dict batch and targets",
              "plain_dict": "plain PyTorch loop, 1 thread: dict batch"}
    print(f"token model, global batch {BATCH}, one training step (median of {args.steps} steps; best of "
          f"{args.rounds} alternating rounds; {os.cpu_count()} cores; torch {torch.__version__})")
    print(f"{'configuration':<48} {'ms/step':>8}  each round")
    print("-" * 90)
    for key, label in labels.items():
        each = " ".join(f"{r['ms']:.3f}{'*' if r['contended'] else ''}" for r in rounds[key])
        print(f"{label:<48} {best[key]['ms']:>8.3f}  {each}")
    contended = any(r["contended"] for r in best.values())
    if contended:
        print("(* contended: other work competed for the cores during that round; see dlperf.timing)")
    ratio = statistics.median(ratios)
    print(f"the split alone (split_step, 2 devices): tensor {split_us['tensor']:.1f} us, dict "
          f"{split_us['dict']:.1f} us (+{split_us['dict'] - split_us['tensor']:.1f} us a step)")
    print(f"dict batch / tensor batch, median of the rounds' ratios: {ratio:.3f} (target <= 1.05; each round: "
          f"{' '.join(f'{r:.2f}' for r in ratios)}, sorted)")
    print(json.dumps({"dict_over_tensor": ratio, "target": 1.05, "met": ratio <= 1.05, "round_ratios": ratios,
                      **{f"{k}_ms": v["ms"] for k, v in best.items()},
                      "split_tensor_us": split_us["tensor"], "split_dict_us": split_us["dict"],
                      "rounds_ms": {k: [r["ms"] for r in v] for k, v in rounds.items()},
                      "contended": contended}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

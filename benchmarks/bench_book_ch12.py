"""The book's chapter 12.1-12.2 experiments in dlperf's names, beside plain PyTorch, in one run.

Figures for docs/from-the-book.md ("what pays and when"):

1. §12.1 MLP (512-256-128-2), batch 1 and 64: eager against ``hybridize`` (auto, and the graph
   replay) for an inference call under ``no_grad``, a forward with autograd on, and a training
   step's forward+backward.
2. The same MLP called with an engine array: the eager module (one engine op per layer op) against
   the hybridized one (the whole call is one engine op), call plus wait.
3. §12.2.3: 1000 x (y = x + 1) on a 1x2 array: plain torch, the threaded engine asynchronous
   (one wait) and synchronous (a wait per op), the naive engine.
4. §12.2.4's training loop (MLP 512-2048-512-1, batch 256, SGD) on engine arrays against eager.

Contenders of one experiment are sampled in turns so load from other processes hits all alike.
Prints a table, then one JSON object as the last line.

    flock /tmp/dlperf-cpu.lock python benchmarks/bench_book_ch12.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from dlperf.engine import array as np
from dlperf.engine import create_engine
from dlperf.hybrid import hybridize


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 2))


def round_robin(contenders: dict[str, Callable[[], None]], reps: int, samples: int) -> dict[str, float]:
    """Median seconds per call of each contender; ``reps`` calls per sample, samples in turns."""
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for i in range(samples + 1):  # round 0 warms up
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            if i:
                times[name].append((time.perf_counter() - t0) / reps)
    return {k: statistics.median(v) for k, v in times.items()}


def mlp_calls(batch: int, reps: int, samples: int) -> dict[str, float]:
    torch.manual_seed(0)
    net = mlp()
    x = torch.randn(batch, 512)
    hybrid_auto, hybrid_graph = hybridize(net), hybridize(net, backend="graph")
    xg = x.clone().requires_grad_(False)

    def train(model: Callable) -> Callable[[], None]:
        def step() -> None:
            model(xg).sum().backward()
        return step

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            nograd = round_robin({"eager": lambda: net(x), "hybrid auto": lambda: hybrid_auto(x),
                                  "hybrid graph": lambda: hybrid_graph(x)}, reps, samples)
        fwd = round_robin({"eager": lambda: net(x), "hybrid auto": lambda: hybrid_auto(x),
                           "hybrid graph": lambda: hybrid_graph(x)}, reps, samples)
        fb = round_robin({"eager": train(net), "hybrid auto": train(hybrid_auto),
                          "hybrid graph": train(hybrid_graph)}, reps // 2, samples)
    out = {}
    for mode, res in (("no_grad call", nograd), ("autograd forward", fwd), ("forward+backward", fb)):
        for k, v in res.items():
            out[f"b{batch} {mode}: {k}"] = v
    auto_choice = {str(k): c.backend for k, c in hybrid_auto.choices.items()}
    out[f"b{batch} auto chose"] = auto_choice  # type: ignore[assignment]
    return out


def mlp_on_engine(reps: int, samples: int) -> dict[str, float]:
    torch.manual_seed(1)
    net = mlp()
    hybrid = hybridize(net)
    with create_engine(cpu_threads=1) as eng, torch.no_grad():
        x = np.random.normal(size=(1, 512), engine=eng)
        x.wait_to_read()
        hybrid(x).wait_to_read()
        res = round_robin({"eager module on engine": lambda: net(x).wait_to_read(),
                           "hybridized module on engine": lambda: hybrid(x).wait_to_read(),
                           "plain torch eager": lambda: net(x.tensor())}, reps, samples)
    return {f"b1 no_grad + wait: {k}": v for k, v in res.items()}


def increments(samples: int) -> dict[str, float]:
    n = 1000
    results: dict[str, float] = {}
    xt = torch.ones(1, 2)

    def torch_loop() -> None:
        for _ in range(n):
            xt + 1

    with create_engine("threaded", cpu_threads=1) as eng, create_engine("naive", cpu_threads=1) as naive:
        x, xn = np.ones((1, 2), engine=eng), np.ones((1, 2), engine=naive)

        def async_loop() -> None:
            for _ in range(n):
                y = x + 1
            y.wait_to_read()

        def sync_loop() -> None:
            for _ in range(n):
                y = x + 1
                y.wait_to_read()

        def naive_loop() -> None:
            for _ in range(n):
                xn + 1

        res = round_robin({"torch eager": torch_loop, "engine async": async_loop, "engine sync": sync_loop,
                           "naive engine": naive_loop}, 1, samples)
    for k, v in res.items():
        results[f"1000 x (x+1), per op: {k}"] = v / n
    return results


def training_loop(batches: int, samples: int) -> dict[str, float]:
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512), nn.ReLU(), nn.Linear(512, 1))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    data = [torch.randn(256, 512) for _ in range(batches)]
    with create_engine(cpu_threads=torch.get_num_threads()) as eng:
        arrays = [np.array(d, engine=eng) for d in data]
        ones = np.ones((256,), engine=eng)
        eng.waitall()

        def on_engine() -> None:
            for X in arrays:
                loss = ((net(X).reshape((256,)) - ones) ** 2 / 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            eng.waitall()

        def eager() -> None:
            for X in data:
                loss = ((net(X).reshape(256) - 1) ** 2 / 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()

        res = round_robin({"engine arrays": on_engine, "torch eager": eager}, 1, samples)
    return {f"12.2.4 loop, per batch: {k}": v / batches for k, v in res.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: on a shared 2-core machine two threads make "
                             "backward's timings swing by 10x)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    samples = 5 if args.quick else 11
    results: dict[str, object] = {"threads": torch.get_num_threads()}
    results.update(mlp_calls(1, 200, samples))
    results.update(mlp_calls(64, 50, samples))
    results.update(mlp_on_engine(200, samples))
    results.update(increments(samples))
    results.update(training_loop(8 if args.quick else 20, max(3, samples // 2)))
    for k, v in results.items():
        if isinstance(v, float):
            print(f"{k:<58} {v * 1e6:12.2f} us")
        else:
            print(f"{k:<58} {v}")
    print(json.dumps({k: (v * 1e6 if isinstance(v, float) else v) for k, v in results.items()}))


if __name__ == "__main__":
    main()

"""How much does `dlperf bench`'s harness add to the step it times?

Times the same network's training step two ways in one run, interleaved round by round so that
drift in machine load hits both alike:

* harness: dlperf.bench.runner.run_cell (thread setting, mode lookup, per-step synchronize and
  timer, progress callback), as `dlperf bench` uses it;
* bare: a hand-written loop of zero_grad / forward / loss / backward / SGD step, timed with
  time.perf_counter around each step.

Target: harness median within 2% of the bare median. Prints a table, then one JSON line.

    python benchmarks/bench_harness_overhead.py [--network alexnet-r] [--rounds 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dlperf._threads import intra_op_threads
from dlperf.bench.runner import BenchConfig, run_cell
from dlperf.devices import cpu
from dlperf.models import get_spec


def bare_loop(network: str, batch: int, threads: int, warmup: int, steps: int, seed: int = 0) -> float:
    spec = get_spec(network)
    with intra_op_threads(threads):
        torch.manual_seed(seed)
        model = spec.build()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = spec.input.make_batch(batch, generator=torch.Generator().manual_seed(seed))
        samples = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = spec.loss(model(x), y)
            loss.backward()
            opt.step()
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def harness(network: str, batch: int, threads: int, warmup: int, steps: int) -> float:
    config = BenchConfig(networks=[network], devices=[cpu()], threads=[threads], batch_size=batch,
                         warmup=warmup, steps=steps)
    ticks = []
    cell = run_cell(network, cpu(), threads, config, flops=None, on_step=lambda: ticks.append(1))
    if cell.error:
        raise RuntimeError(cell.error)
    return cell.timing.median_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--network", default="alexnet-r")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    batch = a.batch_size or get_spec(a.network).cpu_batch
    h, b = [], []
    for r in range(a.rounds):
        # Alternate which goes first so neither always runs on a warmer machine.
        order = (("harness", h), ("bare", b)) if r % 2 == 0 else (("bare", b), ("harness", h))
        for name, out in order:
            fn = harness if name == "harness" else bare_loop
            out.append(fn(a.network, batch, a.threads, a.warmup, a.steps))
    hm, bm = statistics.median(h), statistics.median(b)
    ratio = hm / bm
    print(f"{'':10} {'median ms/step':>15} {'rounds (ms)':>40}")
    print(f"{'harness':10} {hm * 1e3:15.2f} {' '.join(f'{v * 1e3:.1f}' for v in h):>40}")
    print(f"{'bare loop':10} {bm * 1e3:15.2f} {' '.join(f'{v * 1e3:.1f}' for v in b):>40}")
    print(f"overhead: {(ratio - 1) * 100:+.2f}% (target <= 2%), {a.network} batch {batch}, {a.threads} thread(s)")
    print(json.dumps({"network": a.network, "batch_size": batch, "threads": a.threads,
                      "harness_ms": hm * 1e3, "bare_ms": bm * 1e3, "overhead_ratio": ratio,
                      "overhead_pct": (ratio - 1) * 100, "target_met": ratio <= 1.02}))


if __name__ == "__main__":
    main()

"""Data-parallel training on logical CPU devices against one device and against PyTorch DDP (gloo).

Run under the machine's benchmark lock so nothing else competes for the cores:

    flock /tmp/dlperf-cpu.lock .venv/bin/python benchmarks/bench_data_parallel.py

Measured in one run, with the shared timing protocol (warm-up, then the median of single steps):

* LeNet, global batch 256, one training step: dlperf Trainer on cpu(0) with one thread; on
  cpu(0),cpu(1) with one thread each; a plain PyTorch loop with one and with two threads; and
  DistributedDataParallel with 2 gloo processes of one thread each on 127.0.0.1 (128 examples each).
* allreduce of 64 MB per device across 2 logical devices, for every algorithm, and gloo's allreduce
  of 64 MB between the 2 processes. Bus bandwidth = size / time * 2(k-1)/k (k = 2: size / time).

The last stdout line is one JSON object: speedup_vs_one, ratio_vs_ddp, allreduce_busbw_gbs,
gloo_busbw_gbs and the raw figures.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

from dlperf.bench.timing import time_steps
from dlperf.devices import copy_to, cpu
from dlperf.models import get_spec
from dlperf.parallel import DEFAULT_ALGORITHM, DeviceWorkers, Trainer, algorithm_names, allreduce

BATCH = 256
ALLREDUCE_BYTES = 64 * 1024 * 1024
DDP_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_time(rank: int, world: int, steps: int, warmup: int, channels_last: bool):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    spec = get_spec("lenet")
    torch.manual_seed(0)
    net = spec.build()
    X, y = spec.input.make_batch(BATCH, generator=torch.Generator().manual_seed(1))
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    Xr, yr = X[mine], y[mine]
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
        Xr = Xr.contiguous(memory_format=torch.channels_last)
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        spec.loss(model(Xr), yr).backward()  # DDP averages gradients over ranks during backward
        opt.step()

    # a barrier around each timed step: both ranks start together and a step ends with the slower
    return time_steps(step, warmup=warmup, steps=steps, synchronize=dist.barrier)


def _ddp_worker(rank: int, world: int, port: int, steps: int, warmup: int, reps: int, out) -> None:
    """One DDP rank: LeNet steps on its half of the batch (both layouts), then gloo allreduce of 64 MB."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        plain = _ddp_time(rank, world, steps, warmup, channels_last=False)
        nhwc = _ddp_time(rank, world, steps, warmup, channels_last=True)
        buf = torch.ones(ALLREDUCE_BYTES // 4)
        dist.all_reduce(buf)
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        out.put((rank, plain.median_s, plain.q1_s, plain.q3_s, statistics.median(times), nhwc.median_s))
    finally:
        dist.destroy_process_group()


def measure_ddp(steps: int, warmup: int, reps: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_ddp_worker, args=(r, 2, port, steps, warmup, reps, out), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + DDP_TIMEOUT_S
    try:
        while len(results) < 2:
            results.append(out.get(timeout=max(1.0, deadline - time.monotonic())))
    except queue.Empty:
        raise RuntimeError(f"DDP ranks did not report within {DDP_TIMEOUT_S} s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    # a data-parallel step ends when the slower rank ends
    slow = max(results, key=lambda r: r[1])
    allreduce_s = max(r[4] for r in results)
    return {"ddp_ms": slow[1] * 1e3, "ddp_q1_ms": slow[2] * 1e3, "ddp_q3_ms": slow[3] * 1e3,
            "gloo_allreduce_ms": allreduce_s * 1e3, "gloo_busbw_gbs": ALLREDUCE_BYTES / allreduce_s / 1e9,
            "ddp_channels_last_ms": max(r[5] for r in results) * 1e3}


def measure_plain(threads: int, steps: int, warmup: int, channels_last: bool = False) -> float:
    """A plain PyTorch training loop on the whole batch with ``threads`` intra-op threads."""
    spec = get_spec("lenet")
    torch.manual_seed(0)
    model = spec.build()
    X, y = spec.input.make_batch(BATCH, generator=torch.Generator().manual_seed(1))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        X = X.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            spec.loss(model(X), y).backward()
            opt.step()
        return time_steps(step, warmup=warmup, steps=steps).median_s * 1e3
    finally:
        torch.set_num_threads(before)


def measure_trainer(k: int, steps: int, warmup: int) -> dict[str, float]:
    spec = get_spec("lenet")
    torch.manual_seed(0)
    model = spec.build()
    X, y = spec.input.make_batch(BATCH, generator=torch.Generator().manual_seed(1))
    with Trainer(model, [cpu(i) for i in range(k)], "sgd", {"lr": 0.1}, loss=spec.loss,
                 threads=[1] * k) as trainer:
        t = time_steps(lambda: trainer.train_step(X, y), warmup=warmup, steps=steps)
    return {"ms": t.median_s * 1e3, "q1_ms": t.q1_s * 1e3, "q3_ms": t.q3_s * 1e3, "noisy": t.noisy}


def measure_allreduce(reps: int) -> dict[str, float]:
    """Bus bandwidth (GB/s) of each algorithm, 64 MB per device, 2 logical devices, one thread each."""
    devs = [cpu(0), cpu(1)]
    xs = [copy_to(torch.ones(ALLREDUCE_BYTES // 4), d) for d in devs]
    out = {}
    with DeviceWorkers(devs, threads=[1, 1]) as workers:
        for name in algorithm_names():
            t = time_steps(lambda name=name: allreduce(xs, name, workers=workers), warmup=2, steps=reps)
            out[name] = ALLREDUCE_BYTES / t.median_s / 1e9  # k = 2: bus bandwidth = size / time
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10, help="allreduce repetitions")
    ap.add_argument("--no-ddp", action="store_true", help="skip the DDP peer (no process launch)")
    args = ap.parse_args(argv)

    one = measure_trainer(1, args.steps, args.warmup)
    two = measure_trainer(2, args.steps, args.warmup)
    plain1 = measure_plain(1, args.steps, args.warmup)
    plain2 = measure_plain(2, args.steps, args.warmup)
    plain2_cl = measure_plain(2, args.steps, args.warmup, channels_last=True)
    ddp = {} if args.no_ddp else measure_ddp(args.steps, args.warmup, args.reps)
    busbw = measure_allreduce(args.reps)

    print(f"LeNet, global batch {BATCH}, one training step (median of {args.steps}; "
          f"{os.cpu_count()} cores; torch {torch.__version__})")
    print("(the Trainer picks channels-last activations for conv nets on CPU; the rows marked so run the")
    print(" peers with the same layout, to separate the layout's gain from the parallel machinery's)")
    print(f"{'configuration':<48} {'ms/step':>8} {'IQR ms':>7}")
    print("-" * 65)
    rows = [("dlperf Trainer cpu(0), 1 thread", one["ms"], one["q3_ms"] - one["q1_ms"]),
            ("dlperf Trainer cpu(0),cpu(1), 1 thread each", two["ms"], two["q3_ms"] - two["q1_ms"]),
            ("plain PyTorch loop, 1 thread", plain1, float("nan")),
            ("plain PyTorch loop, 2 threads", plain2, float("nan")),
            ("plain PyTorch loop, 2 threads, channels-last", plain2_cl, float("nan"))]
    if ddp:
        rows.append(("PyTorch DDP, 2 gloo processes x 1 thread", ddp["ddp_ms"], ddp["ddp_q3_ms"] - ddp["ddp_q1_ms"]))
        rows.append(("PyTorch DDP, same, channels-last", ddp["ddp_channels_last_ms"], float("nan")))
    for name, ms, iqr in rows:
        print(f"{name:<48} {ms:>8.1f} {iqr:>7.1f}")
    print()
    print(f"allreduce, 64 MB per device, 2 devices: bus bandwidth GB/s (default: {DEFAULT_ALGORITHM})")
    for name, bw in busbw.items():
        print(f"  {name:<10} {bw:>6.2f}")
    if ddp:
        print(f"  {'gloo (2 processes, loopback)':<10} {ddp['gloo_busbw_gbs']:>6.2f}")
    result = {
        "speedup_vs_one": one["ms"] / two["ms"],
        "ratio_vs_ddp": two["ms"] / ddp["ddp_ms"] if ddp else None,
        "allreduce_busbw_gbs": busbw[DEFAULT_ALGORITHM],
        "gloo_busbw_gbs": ddp.get("gloo_busbw_gbs"),
        "trainer_1dev_ms": one["ms"], "trainer_2dev_ms": two["ms"], "plain_1thread_ms": plain1,
        "plain_2thread_ms": plain2, "plain_2thread_channels_last_ms": plain2_cl, "ddp_ms": ddp.get("ddp_ms"),
        "ddp_channels_last_ms": ddp.get("ddp_channels_last_ms"),
        "ratio_vs_ddp_channels_last": two["ms"] / ddp["ddp_channels_last_ms"] if ddp else None,
        "allreduce_busbw_by_algorithm": busbw,
        "noisy": bool(one["noisy"] or two["noisy"]),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

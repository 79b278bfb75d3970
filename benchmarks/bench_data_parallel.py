"""Data-parallel training on logical CPU devices against one device and against PyTorch DDP (gloo).

Run under the machine's benchmark lock so nothing else competes for the cores:

    flock /tmp/dlperf-cpu.lock .venv/bin/python benchmarks/bench_data_parallel.py

Measured in one run, with the shared timing protocol (warm-up, then the median of single steps):

* LeNet, global batch 256, one training step: dlperf Trainer on cpu(0) with one thread; on
  cpu(0),cpu(1) with one thread each; a plain PyTorch loop with one and with two threads; and
  DistributedDataParallel with 2 gloo processes of one thread each on 127.0.0.1 (128 examples each).
* allreduce of 64 MB per device across 2 logical devices, for every algorithm (each device's share an
  engine operation on its lane), and gloo's allreduce of 64 MB between the 2 processes. Bus bandwidth
  = size / time * 2(k-1)/k (k = 2: size / time).
* the Trainer's bucket path on the same 64 MB: gradient buckets of the Trainer's default size, each bucket's
  reduction pushed to the engine's communication lanes with its priority, as backward pushes them;
  ``bucket_busbw_ratio`` is its bus bandwidth over the standalone allreduce's.
* with a GPU: the Trainer on gpu(0) against a plain PyTorch loop on the same GPU.

Every configuration allocates host memory as dlperf's commands do (freed blocks up to 32 MiB stay in
the process, dlperf._hostmem; the DDP processes too, through the launcher): with glibc's adaptive
defaults the plain loops, run in this main thread, took 22 or 38 ms a step by whether their freed
activations had gone back to the kernel. ``DLPERF_HOST_MALLOC=system`` measures with the defaults.

Other work on a shared machine disturbs single runs, so the single-process configurations are
measured in alternating rounds and the least disturbed round (lowest median) of each is reported;
every round's median is printed too.

* the machine's own parallelism: one bare replica (a plain step on the 128 examples a device gets, one
  thread) alone, and two of them in two bare threads started together. Two threads run
  ``parallel_ceiling = 2 * alone / pair`` times as fast as one (2.0 on two free cores; less when the
  cores are shared or are siblings of one core), which bounds ``speedup_vs_one``;
  ``ratio_vs_bare_replicas`` is the 2-device Trainer's step over the bare pair's (its own overhead).
* the same pair of configurations on a small MLP (32-64-10, batch 64), whose step is ~0.1 ms of work:
  what the 2-device Trainer costs beyond two bare threads is then nearly all thread hand-offs and
  bookkeeping [small_trainer_2dev_ms, small_bare_replicas_2_ms, small_ratio_vs_bare_replicas].

The last stdout line is one JSON object: speedup_vs_one, ratio_vs_ddp, ratio_vs_best_plain (the 2-device
Trainer over the faster plain 2-thread loop, contiguous or channels-last), allreduce_busbw_gbs,
bucket_busbw_gbs, bucket_busbw_ratio, gloo_busbw_gbs, parallel_ceiling, speedup_vs_ceiling,
ratio_vs_bare_replicas, small_ratio_vs_bare_replicas and the raw figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from dlperf._hostmem import host_malloc_state, keep_freed_host_memory
from dlperf.devices import copy_to, cpu
from dlperf.engine import create_engine
from dlperf.models import get_spec
from dlperf.parallel import DEFAULT_ALGORITHM, Trainer, algorithm_names, allreduce
from dlperf.parallel.allreduce.lanes import EngineLanes, comm_lanes
from dlperf.parallel.communication.buckets import GradientBuckets
from dlperf.parallel.launchers import ProcessLauncher, rank_info
from dlperf.parallel.replicas import replicate
from dlperf.timing import time_steps

BATCH = 256
SMALL_BATCH = 64  # the small MLP's global batch (32 inputs, 64 hidden, 10 classes)
ALLREDUCE_BYTES = 64 * 1024 * 1024
DDP_TIMEOUT_S = 300


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


def _ddp_worker(steps: int, warmup: int, reps: int, rounds: int) -> tuple[float, ...]:
    """One DDP rank: LeNet steps on its share of the batch (both layouts), then gloo allreduce of 64 MB."""
    import torch.distributed as dist

    rank, world, _ = rank_info()
    torch.set_num_threads(1)
    plains, nhwcs = [], []
    for _ in range(rounds):  # alternate, as the single-process measurements do
        plains.append(_ddp_time(rank, world, steps, warmup, channels_last=False))
        nhwcs.append(_ddp_time(rank, world, steps, warmup, channels_last=True))
    plain = min(plains, key=lambda t: t.median_s)
    nhwc = min(nhwcs, key=lambda t: t.median_s)
    buf = torch.ones(ALLREDUCE_BYTES // 4)
    dist.all_reduce(buf)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - t0)
    return plain.median_s, plain.q1_s, plain.q3_s, statistics.median(times), nhwc.median_s


def measure_ddp(steps: int, warmup: int, reps: int, rounds: int) -> dict[str, float]:
    launcher = ProcessLauncher(2, backend="gloo", join_timeout_s=DDP_TIMEOUT_S)
    results = launcher.launch(_ddp_worker, steps, warmup, reps, rounds)
    # a data-parallel step ends when the slower rank ends
    slow = max(results, key=lambda r: r[0])
    allreduce_s = max(r[3] for r in results)
    return {"ddp_ms": slow[0] * 1e3, "ddp_q1_ms": slow[1] * 1e3, "ddp_q3_ms": slow[2] * 1e3,
            "gloo_allreduce_ms": allreduce_s * 1e3, "gloo_busbw_gbs": ALLREDUCE_BYTES / allreduce_s / 1e9,
            "ddp_channels_last_ms": max(r[4] for r in results) * 1e3}


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


def _workload(small: bool) -> tuple:
    """(build, X, y, loss, channels_last): LeNet on the benchmark's batch, or (``small``) an MLP whose
    step is so short that what a 2-device step costs beyond two bare threads is the machinery's."""
    if not small:
        spec = get_spec("lenet")
        X, y = spec.input.make_batch(BATCH, generator=torch.Generator().manual_seed(1))
        return spec.build, X, y, spec.loss, True
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(SMALL_BATCH, 32, generator=g), torch.randint(0, 10, (SMALL_BATCH,), generator=g)

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    return build, X, y, torch.nn.functional.cross_entropy, False


def measure_bare_replicas(k: int, steps: int, warmup: int, small: bool = False) -> float:
    """What the Trainer's design can reach on these cores: ``k`` plain PyTorch steps on the batch's
    halves (channels-last for LeNet, one intra-op thread each), each in its own bare thread, started
    together at every step; the step ends with the slower. No engine, no gradient sum, no dlperf code.
    With ``k = 1`` it is one half alone, so ``2 * t(1) / t(2)`` is how far two threads really run in
    parallel on this machine now (cores shared with other programs, or siblings of one core, give less)."""
    import threading

    from dlperf._threads import set_thread_budget

    build, X, y, loss, channels_last = _workload(small)
    torch.manual_seed(0)
    part = X.shape[0] // 2  # the part each device of the 2-device Trainer gets
    models = [build() for _ in range(k)]
    Xs = [X[i * part:(i + 1) * part] for i in range(k)]
    ys = [y[i * part:(i + 1) * part] for i in range(k)]
    if channels_last:
        models = [m.to(memory_format=torch.channels_last) for m in models]
        Xs = [x.contiguous(memory_format=torch.channels_last) for x in Xs]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    start, end = threading.Barrier(k + 1), threading.Barrier(k + 1)
    stop = False

    def replica(i: int) -> None:
        set_thread_budget(1, torch.get_num_threads())
        while True:
            start.wait()
            if stop:
                return
            opts[i].zero_grad(set_to_none=True)
            loss(models[i](Xs[i]), ys[i]).backward()
            opts[i].step()
            end.wait()

    threads = [threading.Thread(target=replica, args=(i,), name=f"bare replica {i}") for i in range(k)]
    for t in threads:
        t.start()

    def step() -> None:
        start.wait()
        end.wait()

    try:
        return time_steps(step, warmup=warmup, steps=steps).median_s * 1e3
    finally:
        stop = True
        start.wait()
        for t in threads:
            t.join()


def measure_trainer(k: int, steps: int, warmup: int, small: bool = False) -> dict[str, float]:
    build, X, y, loss, _ = _workload(small)
    torch.manual_seed(0)
    with Trainer(build(), [cpu(i) for i in range(k)], "sgd", {"lr": 0.1}, loss=loss, threads=[1] * k) as trainer:
        t = time_steps(lambda: trainer.train_step(X, y), warmup=warmup, steps=steps)
    return {"ms": t.median_s * 1e3, "q1_ms": t.q1_s * 1e3, "q3_ms": t.q3_s * 1e3, "noisy": t.noisy}


def measure_allreduce(reps: int) -> dict[str, float]:
    """Bus bandwidth (GB/s) of each algorithm, 64 MB per device, 2 logical devices, one thread each."""
    devs = [cpu(0), cpu(1)]
    xs = [copy_to(torch.ones(ALLREDUCE_BYTES // 4), d) for d in devs]
    out = {}
    with create_engine("threaded", cpu_threads=1) as eng:
        lanes = EngineLanes(eng, devs)
        for name in algorithm_names():
            t = time_steps(lambda name=name: allreduce(xs, name, workers=lanes), warmup=2, steps=reps)
            out[name] = ALLREDUCE_BYTES / t.median_s / 1e9  # k = 2: bus bandwidth = size / time
    return out


def measure_buckets(reps: int) -> float:
    """Bus bandwidth (GB/s) of the Trainer's bucket path on 64 MB of gradients across 2 logical devices."""
    devs = [cpu(0), cpu(1)]
    n = ALLREDUCE_BYTES // 4
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(n // (1024 * 1024))])
    replicas = replicate(model, devs)
    with create_engine("threaded", cpu_threads=1) as eng:
        lanes, kind = comm_lanes(devs)
        gb = GradientBuckets(replicas, DEFAULT_ALGORITHM, lanes=EngineLanes(eng, lanes, kind))  # Trainer's default
        try:
            for row in gb.flats:
                for f in row:
                    f.fill_(1.0)
            t = time_steps(gb.allreduce_all, warmup=2, steps=reps)
        finally:
            gb.close()
    return ALLREDUCE_BYTES / t.median_s / 1e9


def _gpu_pair(name: str, steps: int, warmup: int) -> tuple[float, float]:
    from dlperf.devices import gpu

    spec = get_spec(name)
    torch.manual_seed(0)
    X, y = spec.input.make_batch(BATCH, generator=torch.Generator().manual_seed(1))
    X, y = X.pin_memory(), y.pin_memory()
    model = spec.build().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def plain_step() -> None:
        opt.zero_grad(set_to_none=True)
        spec.loss(model(X.cuda(non_blocking=True)), y.cuda(non_blocking=True)).backward()
        opt.step()

    plain = time_steps(plain_step, warmup=warmup, steps=steps, synchronize=torch.cuda.synchronize)
    with Trainer(spec.build(), [gpu(0)], "sgd", {"lr": 0.1}, loss=spec.loss) as trainer:
        ours = time_steps(lambda: trainer.train_step(X, y), warmup=warmup, steps=steps,
                          synchronize=torch.cuda.synchronize)
    return plain.median_s, ours.median_s


def measure_gpu(steps: int, warmup: int) -> dict[str, float]:
    """Trainer on gpu(0) against a plain PyTorch loop on the same GPU (LeNet and ResNet-18, batch 256)."""
    out = {}
    for name in ("lenet", "resnet18"):
        plain, ours = _gpu_pair(name, steps, warmup)
        out[f"gpu_{name}_plain_ms"] = plain * 1e3
        out[f"gpu_{name}_trainer_ms"] = ours * 1e3
        out[f"gpu_{name}_throughput_vs_plain"] = plain / ours
    return out


def _best(samples: list[dict[str, float]]) -> dict[str, float]:
    """The round with the lowest median: the one least disturbed by other work on the machine."""
    return min(samples, key=lambda d: d["ms"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the least disturbed counts")
    ap.add_argument("--reps", type=int, default=10, help="allreduce repetitions")
    ap.add_argument("--no-ddp", action="store_true", help="skip the DDP peer (no process launch)")
    args = ap.parse_args(argv)
    # Every configuration, ours and the peers', allocates with the policy dlperf's commands use: under
    # glibc's adaptive thresholds the plain loops in this (main) thread were bimodal, 22 or 38 ms a
    # step by whether their freed activations went back to the kernel (DLPERF_HOST_MALLOC=system
    # measures that way; see dlperf._hostmem).
    keep_freed_host_memory()

    configs = {
        "trainer_1dev": lambda: measure_trainer(1, args.steps, args.warmup),
        "trainer_2dev": lambda: measure_trainer(2, args.steps, args.warmup),
        "plain_1thread": lambda: {"ms": measure_plain(1, args.steps, args.warmup)},
        "plain_2thread": lambda: {"ms": measure_plain(2, args.steps, args.warmup)},
        "plain_2thread_channels_last": lambda: {"ms": measure_plain(2, args.steps, args.warmup, True)},
        "bare_replica_alone": lambda: {"ms": measure_bare_replicas(1, args.steps, args.warmup)},
        "bare_replicas_2": lambda: {"ms": measure_bare_replicas(2, args.steps, args.warmup)},
        # a step of ~0.1 ms of work: 10x the steps for a steady median
        "small_trainer_2dev": lambda: measure_trainer(2, 10 * args.steps, 5 * args.warmup, small=True),
        "small_bare_replicas_2": lambda: {"ms": measure_bare_replicas(2, 10 * args.steps, 5 * args.warmup,
                                                                      small=True)},
    }
    rounds: dict[str, list[dict[str, float]]] = {k: [] for k in configs}
    for _ in range(args.rounds):
        for key, fn in configs.items():
            rounds[key].append(fn())
    best = {k: _best(v) for k, v in rounds.items()}
    ddp = {} if args.no_ddp else measure_ddp(args.steps, args.warmup, args.reps, args.rounds)
    busbw = max((measure_allreduce(args.reps) for _ in range(args.rounds)), key=lambda d: d[DEFAULT_ALGORITHM])
    bucket_bw = max(measure_buckets(args.reps) for _ in range(args.rounds))
    gpu = measure_gpu(args.steps, args.warmup) if torch.cuda.is_available() else {}

    print(f"LeNet, global batch {BATCH}, one training step (median of {args.steps} steps, best of "
          f"{args.rounds} alternating rounds; {os.cpu_count()} cores; torch {torch.__version__})")
    print(f"host memory, every configuration: {host_malloc_state()}")
    print("(the Trainer picks channels-last activations for conv nets on CPU; the rows marked so run the")
    print(" peers with the same layout, to separate the layout's gain from the parallel machinery's)")
    print(f"{'configuration':<48} {'ms/step':>8}  {'each round':<24}")
    print("-" * 84)
    labels = {"trainer_1dev": "dlperf Trainer cpu(0), 1 thread",
              "trainer_2dev": "dlperf Trainer cpu(0),cpu(1), 1 thread each",
              "plain_1thread": "plain PyTorch loop, 1 thread",
              "plain_2thread": "plain PyTorch loop, 2 threads",
              "plain_2thread_channels_last": "plain PyTorch loop, 2 threads, channels-last",
              "bare_replica_alone": "bare replica: 128 examples, 1 thread, alone",
              "bare_replicas_2": "2 bare replicas side by side, 1 thread each",
              "small_trainer_2dev": "small MLP, batch 64: Trainer cpu(0),cpu(1)",
              "small_bare_replicas_2": "small MLP, batch 64: 2 bare replicas"}
    for key, label in labels.items():
        each = " ".join(f"{r['ms']:.2f}" for r in rounds[key])
        print(f"{label:<48} {best[key]['ms']:>8.2f}  {each}")
    if ddp:
        print(f"{'PyTorch DDP, 2 gloo processes x 1 thread':<48} {ddp['ddp_ms']:>8.1f}")
        print(f"{'PyTorch DDP, same, channels-last':<48} {ddp['ddp_channels_last_ms']:>8.1f}")
    print()
    print(f"allreduce, 64 MB per device, 2 devices: bus bandwidth GB/s (default: {DEFAULT_ALGORITHM})")
    for name, bw in busbw.items():
        print(f"  {name:<30} {bw:>6.2f}")
    print(f"  {'Trainer bucket path (' + DEFAULT_ALGORITHM + ')':<30} {bucket_bw:>6.2f}")
    if ddp:
        print(f"  {'gloo (2 processes, loopback)':<30} {ddp['gloo_busbw_gbs']:>6.2f}")
    for key, value in gpu.items():
        print(f"  {key:<40} {value:>8.2f}")
    one, two = best["trainer_1dev"]["ms"], best["trainer_2dev"]["ms"]
    # Two OpenMP threads that gain < 20% over one mean another process holds a core: the two-core
    # figures (ours and the peers') are then not meaningful; rerun on a quiet machine.
    contended = best["plain_2thread"]["ms"] > 0.8 * best["plain_1thread"]["ms"]
    if contended:
        print("WARNING: another process held a core during this run (2 threads barely beat 1); rerun")
    # The 2-device Trainer can at best run its two replicas as two bare threads do: how parallel
    # two threads really are on these cores now bounds speedup_vs_one (2.0 only on two free cores).
    alone, pair = best["bare_replica_alone"]["ms"], best["bare_replicas_2"]["ms"]
    ceiling = 2 * alone / pair
    print(f"two bare threads run {ceiling:.2f}x as fast as one here (the ceiling of speedup_vs_one); the "
          f"Trainer's 2 devices take {two / pair:.2f}x the bare pair's time")
    result = {
        "speedup_vs_one": one / two,
        "ratio_vs_ddp": two / ddp["ddp_ms"] if ddp else None,
        "ratio_vs_best_plain": two / min(best["plain_2thread"]["ms"], best["plain_2thread_channels_last"]["ms"]),
        "allreduce_busbw_gbs": busbw[DEFAULT_ALGORITHM],
        "bucket_busbw_gbs": bucket_bw,
        "bucket_busbw_ratio": bucket_bw / busbw[DEFAULT_ALGORITHM],
        "gloo_busbw_gbs": ddp.get("gloo_busbw_gbs"),
        "trainer_1dev_ms": one, "trainer_2dev_ms": two,
        "plain_1thread_ms": best["plain_1thread"]["ms"], "plain_2thread_ms": best["plain_2thread"]["ms"],
        "plain_2thread_channels_last_ms": best["plain_2thread_channels_last"]["ms"],
        "ddp_ms": ddp.get("ddp_ms"), "ddp_channels_last_ms": ddp.get("ddp_channels_last_ms"),
        "ratio_vs_ddp_channels_last": two / ddp["ddp_channels_last_ms"] if ddp else None,
        "allreduce_busbw_by_algorithm": busbw,
        "rounds_ms": {k: [r["ms"] for r in v] for k, v in rounds.items()},
        "parallel_ceiling": ceiling,
        "speedup_vs_ceiling": one / two / ceiling,
        "ratio_vs_bare_replicas": two / pair,
        "bare_replica_alone_ms": alone, "bare_replicas_2_ms": pair,
        "small_trainer_2dev_ms": best["small_trainer_2dev"]["ms"],
        "small_bare_replicas_2_ms": best["small_bare_replicas_2"]["ms"],
        "small_ratio_vs_bare_replicas": best["small_trainer_2dev"]["ms"] / best["small_bare_replicas_2"]["ms"],
        "contended": contended,
        "host_malloc": host_malloc_state(),
        **gpu,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

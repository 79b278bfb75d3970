"""The distributed KVStore against the single-process one: push+pull of 2 x 4 MB from 2 workers.

Run under the machine's benchmark lock so nothing else competes for the cores:

    flock /tmp/dlperf-cpu.lock .venv/bin/python benchmarks/bench_kvstore_dist.py

One iteration moves two keys of 4 MB (float32) each:

* ``dist_sync``: 2 worker processes and 1 server process (started by the ProcessLauncher, gloo and
  torch RPC on 127.0.0.1); each worker calls ``pushpull`` on both keys, the server merges both
  workers' values and each worker copies the sum out. The iteration ends when the slower worker has
  its result. On one host the payloads go through shared memory and the requests through the control
  channel (:mod:`dlperf.kvstore.shm`), as the store chooses by itself.
* ``dist_sync, RPC only``: the same store with ``shared_memory=False`` (what ``DLPERF_KVSTORE_SHM=off``
  gives): every byte crosses TensorPipe, as it does between hosts. A peer row, not the target.
* ``local``: the same exchange in one process: the ``local`` store gets both workers' values for a
  key as two device values, sums them on the host and copies the sum out to both.

The three are measured in alternating rounds inside the launched job (rank 0 times the ``local`` store
while the other ranks wait), with the shared timing protocol (warm-up, then the median of single
iterations); the least disturbed round (lowest median) of each counts. Each timed window records the
contention check of :mod:`dlperf.timing`.

The last stdout line is one JSON object: ``dist_vs_local`` (dist_sync ms over local ms; target <= 2.0),
``rpc_vs_local`` (the RPC-only peer), the figures, every round's medians, the bytes each path moved
(the proof of which path ran) and whether the machine was contended.

``--local`` times the single-process store alone against the same exchange written by hand in torch
(``torch.add`` of the two values into the stored tensor, then two copies out: the floor) and MXNet's
``mx.kv.create('local')`` doing the same push and pull (``mx.nd.waitall()`` ends each iteration). The
contenders' iterations are interleaved one by one in one process, so a busy machine slows all alike;
run it with an interpreter that imports both ``mxnet`` and this checkout (a throwaway venv:
``pip install mxnet 'numpy<1.24'`` and torch), or give ``--mxnet-python PYTHON`` to time MXNet in its
own process between the rounds instead:

    PYTHONPATH=src /tmp/mxvenv/bin/python benchmarks/bench_kvstore_dist.py --local

Its JSON: ``local_ms``, ``torch_floor_ms``, ``mxnet_ms`` (null without MXNet), ``mxnet_vs_local``
(target >= 2.5: the local store at least 2.5x faster than MXNet's) and every round's medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch

from dlperf.kvstore import create_kvstore
from dlperf.parallel.launchers import ProcessLauncher
from dlperf.timing import ContentionMonitor, Timing, time_steps

KEY_BYTES = 4 * 1024 * 1024
KEYS = [0, 1]
TARGET = 2.0
JOIN_TIMEOUT_S = 600


def _values(worker: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(worker)
    return [torch.randn(KEY_BYTES // 4, generator=g) for _ in KEYS]


def _local_exchanges() -> dict[str, Callable[[], None]]:
    """One iteration of each in-process contender of ``--local``, on the same two workers' values."""
    mine, theirs = _values(0), _values(1)
    outs = [[torch.empty_like(v), torch.empty_like(v)] for v in mine]
    kv = create_kvstore("local")
    kv.init(KEYS, [torch.zeros_like(v) for v in mine])
    pushed = [[a, b] for a, b in zip(mine, theirs, strict=True)]
    stored = [torch.zeros_like(v) for v in mine]

    def local() -> None:
        kv.push(KEYS, pushed)
        kv.pull(KEYS, out=outs)

    def torch_floor() -> None:  # the same exchange by hand: each sum written into its key, copied out twice
        for s, a, b, (o0, o1) in zip(stored, mine, theirs, outs, strict=True):
            torch.add(a, b, out=s)
            o0.copy_(s)
            o1.copy_(s)

    exchanges = {"local": local, "torch_floor": torch_floor}
    mxnet_step = _mxnet_in_process(mine, theirs)
    if mxnet_step is not None:
        exchanges["mxnet"] = mxnet_step
    return exchanges


def _mxnet_in_process(mine: list[torch.Tensor], theirs: list[torch.Tensor]) -> Callable[[], None] | None:
    """MXNet's local store doing the same push and pull, when this interpreter imports mxnet (else None)."""
    try:
        import mxnet as mx  # optional peer
    except ImportError:
        return None
    kv = mx.kv.create("local")
    kv.init(KEYS, [mx.nd.zeros((v.numel(),)) for v in mine])
    vals = [[mx.nd.array(a.numpy(), ctx=mx.cpu(0)), mx.nd.array(b.numpy(), ctx=mx.cpu(1))]
            for a, b in zip(mine, theirs, strict=True)]
    outs = [[mx.nd.empty((v.numel(),), ctx=mx.cpu(d)) for d in range(2)] for v in mine]

    def step() -> None:
        kv.push(KEYS, vals)
        kv.pull(KEYS, out=outs)
        mx.nd.waitall()  # MXNet's calls return before the work is done

    step()
    expected = (mine[1] + theirs[1]).numpy()
    if abs(outs[1][1].asnumpy() - expected).max() != 0.0:
        raise SystemExit("MXNet's local store summed differently from torch: not the same exchange")
    return step


def _time_interleaved(exchanges: dict[str, Callable[[], None]], steps: int, warmup: int) -> dict[str, dict]:
    """Every contender's single iterations, taken in turn (the order rotating), so all see the same machine."""
    names = list(exchanges)
    for _ in range(warmup):
        for name in names:
            exchanges[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    monitor = ContentionMonitor(torch.get_num_threads())
    monitor.start()
    for i in range(steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            exchanges[name]()
            samples[name].append(time.perf_counter() - t0)
        monitor.sample()
    contention = monitor.stop()
    return {name: Timing.from_samples(samples[name], [], contention).to_dict() for name in names}


# Runs under another interpreter that imports mxnet but not dlperf: the same exchange, timed the same way.
_MXNET_LOCAL = """
import json, sys, time
import mxnet as mx
steps, warmup, numel = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
keys = [0, 1]
mx.random.seed(0)
kv = mx.kv.create("local")
kv.init(keys, [mx.nd.zeros((numel,)) for _ in keys])
vals = [[mx.nd.random.normal(shape=(numel,), ctx=mx.cpu(d)) for d in range(2)] for _ in keys]
outs = [[mx.nd.empty((numel,), ctx=mx.cpu(d)) for d in range(2)] for _ in keys]
mx.nd.waitall()
def step():
    kv.push(keys, vals)
    kv.pull(keys, out=outs)
    mx.nd.waitall()
for _ in range(warmup):
    step()
samples = []
for _ in range(steps):
    t0 = time.perf_counter()
    step()
    samples.append(time.perf_counter() - t0)
err = float(abs(outs[1][1].asnumpy() - vals[1][0].asnumpy() - vals[1][1].asnumpy()).max())
print(json.dumps({"samples": samples, "sum_error": err, "version": mx.__version__}))
"""


def _time_mxnet(python: str, steps: int, warmup: int, threads: int) -> dict:
    """MXNet's local store in a process of ``python``: median and quartiles of its single iterations.

    Its operators get as many OpenMP threads as torch's here (``OMP_NUM_THREADS``).
    """
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    done = subprocess.run([python, "-c", _MXNET_LOCAL, str(steps), str(warmup), str(KEY_BYTES // 4)],
                          capture_output=True, text=True, timeout=JOIN_TIMEOUT_S, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"--mxnet-python {python}: the MXNet run failed:\n{done.stderr.strip()[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    samples = sorted(result["samples"])
    q = statistics.quantiles(samples, n=4)
    return {"median_s": statistics.median(samples), "q1_s": q[0], "q3_s": q[2], "contended": None,
            "sum_error": result["sum_error"]}


def _local_only(args: argparse.Namespace) -> int:
    """``--local``: the single-process store against the torch floor and MXNet, in rounds."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    exchanges = _local_exchanges()
    torch.set_num_threads(threads)  # importing mxnet sets the OpenMP threads both libraries share to 1
    separate = "mxnet" not in exchanges and bool(args.mxnet_python)  # MXNet in a process of its own
    rounds: dict[str, list[dict]] = {name: [] for name in [*exchanges, *(["mxnet"] if separate else [])]}
    started = time.time()
    for _ in range(args.rounds):
        for name, timing in _time_interleaved(exchanges, args.steps, args.warmup).items():
            rounds[name].append(timing)
        if separate:
            rounds["mxnet"].append(_time_mxnet(args.mxnet_python, args.steps, args.warmup, threads))
    best = {name: _best(ts)["median_s"] * 1e3 for name, ts in rounds.items()}
    how = "MXNet in its own process between rounds" if separate else "interleaved iteration by iteration"
    print(f"push+pull of {len(KEYS)} keys x 2 values of {KEY_BYTES / 2**20:g} MB in one process (median of "
          f"{args.steps} iterations, best of {args.rounds} rounds, {how}; {os.cpu_count()} cores; torch "
          f"{torch.__version__}, {threads} intra-op threads)")
    print(f"{'store':<44} {'ms/iter':>8}  {'each round':<40}")
    print("-" * 96)
    labels = {"local": "dlperf local store", "torch_floor": "the same by hand in torch (floor)",
              "mxnet": "MXNet mx.kv.create('local')"}
    for name, ts in rounds.items():
        each = " ".join(f"{t['median_s'] * 1e3:.3f}" + ("!" if t["contended"] else "") for t in ts)
        print(f"{labels[name]:<44} {best[name]:>8.3f}  {each}")
    mxnet_ms = best.get("mxnet")
    ratio = mxnet_ms / best["local"] if mxnet_ms else None
    # per round (one machine state for all the contenders of a round): MXNet's time over dlperf's
    per_round = ([m["median_s"] / d["median_s"] for m, d in zip(rounds["mxnet"], rounds["local"], strict=True)]
                 if "mxnet" in rounds else [])
    contended = any(t["contended"] for ts in rounds.values() for t in ts)
    if ratio is not None:
        floor = best["local"] / best["torch_floor"]
        print(f"MXNet / dlperf = {ratio:.2f} (target >= 2.5; per round {' '.join(f'{r:.2f}' for r in per_round)}); "
              f"dlperf / floor = {floor:.2f}")
    if contended:
        print("WARNING: the contention check saw other work on the machine during a timed window (! above); rerun")
    result = {"local_ms": best["local"], "torch_floor_ms": best["torch_floor"], "mxnet_ms": mxnet_ms,
              "mxnet_vs_local": ratio, "mxnet_vs_local_per_round": per_round, "target": 2.5,
              "meets_target": ratio >= 2.5 if ratio else None, "local_vs_floor": best["local"] / best["torch_floor"],
              "rounds_ms": {name: [t["median_s"] * 1e3 for t in ts] for name, ts in rounds.items()},
              "mxnet_in_process": "mxnet" in exchanges, "key_bytes": KEY_BYTES, "keys": len(KEYS),
              "values_per_key": 2, "threads": threads, "contended": contended, "wall_s": time.time() - started,
              "contention": {name: _best(ts).get("contention") for name, ts in rounds.items()}}
    print(json.dumps(result))
    return 0


def _time_local(steps: int, warmup: int):
    """The single-process store: both workers' values for each key pushed as two device values."""
    mine, theirs = _values(0), _values(1)
    outs = [[torch.empty_like(v), torch.empty_like(v)] for v in mine]
    with create_kvstore("local") as kv:
        kv.init(KEYS, [torch.zeros_like(v) for v in mine])

        def step() -> None:
            kv.push(KEYS, [[a, b] for a, b in zip(mine, theirs, strict=True)])
            kv.pull(KEYS, out=outs)

        return time_steps(step, warmup=warmup, steps=steps)


def _job(steps: int, warmup: int, rounds: int) -> dict | None:
    """Every rank of the launched job: 2 workers and 1 server (the last rank)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    workers = dist.new_group(ranks=[0, 1])
    kv = create_kvstore("dist_sync", num_servers=1)
    rpc = create_kvstore("dist_sync", num_servers=1, shared_memory=False)
    if kv.role == "server":
        # the workers alternate between the stores: serve both at once
        other = threading.Thread(target=rpc.serve, name="serve the RPC-only store")
        other.start()
        kv.serve()
        other.join()
        kv.close()
        rpc.close()
        return None
    values = _values(kv.rank)
    expected_sum = _values(0)[0] + _values(1)[0]
    timings: dict[str, list] = {"dist": [], "rpc": [], "local": []}
    errors = []
    for store in (kv, rpc):
        store.init(KEYS, [torch.zeros_like(v) for v in values])
    for _ in range(rounds):
        for name, store in (("dist", kv), ("rpc", rpc)):
            outs = [torch.empty_like(v) for v in values]
            dist.barrier(workers)
            # sync pushpull ends when both workers' values are merged: the iteration synchronizes itself
            timings[name].append(time_steps(lambda s=store, o=outs: s.pushpull(KEYS, values, out=o),
                                            warmup=warmup, steps=steps))
            errors.append((outs[0] - expected_sum).abs().max().item())
        dist.barrier(workers)
        if kv.rank == 0:
            timings["local"].append(_time_local(steps, warmup))
        dist.barrier(workers)
    traffic = {"dist": kv.traffic(), "rpc": rpc.traffic()}
    kv.close()
    rpc.close()
    return {"rank": kv.rank, **{name: [t.to_dict() for t in ts] for name, ts in timings.items()},
            "sum_error": max(errors), "traffic": traffic, "placement": str(kv.placement())}


def _best(timings: list[dict]) -> dict:
    return min(timings, key=lambda t: t["median_s"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the least disturbed counts")
    ap.add_argument("--local", action="store_true",
                    help="time the single-process store alone, against torch by hand and (--mxnet-python) MXNet")
    ap.add_argument("--mxnet-python", metavar="PYTHON",
                    help="with --local: an interpreter that imports mxnet, to time MXNet's local store too")
    ap.add_argument("--threads", type=int, help="with --local: intra-op threads, for torch and MXNet alike "
                                                   "(default: torch's default)")
    args = ap.parse_args(argv)
    if args.local:
        return _local_only(args)

    results = [r for r in ProcessLauncher(3, backend="gloo", join_timeout_s=JOIN_TIMEOUT_S).launch(
        _job, args.steps, args.warmup, args.rounds) if r is not None]
    # an iteration ends when the slower worker ends: per round, the slower worker's median
    dist_rounds, rpc_rounds = ([max((r[name][i] for r in results), key=lambda t: t["median_s"])
                                for i in range(args.rounds)] for name in ("dist", "rpc"))
    local_rounds = results[0]["local"]
    best_dist, best_rpc, best_local = _best(dist_rounds), _best(rpc_rounds), _best(local_rounds)
    dist_ms, rpc_ms, local_ms = (b["median_s"] * 1e3 for b in (best_dist, best_rpc, best_local))
    ratio = dist_ms / local_ms
    contended = any(t["contended"] for t in dist_rounds + rpc_rounds + local_rounds)
    sum_error = max(r["sum_error"] for r in results)
    # bytes moved by each path, summed over the workers: which path each store really took
    paths = {name: {p: sum(r["traffic"][name][p] for r in results) for p in ("shm", "rpc", "in-process")}
             for name in ("dist", "rpc")}

    mb = KEY_BYTES / 2**20
    print(f"push+pull of {len(KEYS)} x {mb:g} MB from 2 workers per iteration (median of {args.steps} "
          f"iterations, best of {args.rounds} alternating rounds; {os.cpu_count()} cores; torch {torch.__version__})")
    print(f"{'store':<48} {'ms/iter':>8}  {'q1-q3':>13}  {'each round':<24}")
    print("-" * 100)
    for label, best, rounds in (("dist_sync: 2 workers + 1 server (same host)", best_dist, dist_rounds),
                                ("dist_sync, RPC only (DLPERF_KVSTORE_SHM=off)", best_rpc, rpc_rounds),
                                ("local: one process, 2 device values", best_local, local_rounds)):
        each = " ".join(f"{t['median_s'] * 1e3:.2f}" for t in rounds)
        print(f"{label:<48} {best['median_s'] * 1e3:>8.2f}  {best['q1_s'] * 1e3:>6.2f}-{best['q3_s'] * 1e3:<6.2f}"
              f"  {each}")
    mb_moved = {name: ", ".join(f"{p} {n / 2**20:.0f} MB" for p, n in moved.items() if n)
                for name, moved in paths.items()}
    print(f"payload paths: dist_sync {mb_moved['dist']}; RPC only {mb_moved['rpc']}")
    print(f"dist_vs_local = {ratio:.2f} (target <= {TARGET:g}); RPC only: {rpc_ms / local_ms:.2f}; "
          f"max |error| of the merged sum: {sum_error:.2e}")
    if contended:
        print("WARNING: the contention check saw other work on the machine during a timed window; rerun")
    result = {
        "dist_vs_local": ratio, "target": TARGET, "meets_target": ratio <= TARGET,
        "dist_sync_ms": dist_ms, "local_ms": local_ms, "rpc_only_ms": rpc_ms, "rpc_vs_local": rpc_ms / local_ms,
        "dist_rounds_ms": [t["median_s"] * 1e3 for t in dist_rounds],
        "rpc_rounds_ms": [t["median_s"] * 1e3 for t in rpc_rounds],
        "local_rounds_ms": [t["median_s"] * 1e3 for t in local_rounds],
        "key_bytes": KEY_BYTES, "keys": len(KEYS), "workers": 2, "servers": 1,
        "sum_error": sum_error, "contended": contended, "payload_bytes": paths,
        "contention": {"dist": best_dist["contention"], "rpc": best_rpc["contention"],
                       "local": best_local["contention"]},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

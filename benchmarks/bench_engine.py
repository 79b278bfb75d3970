"""d2l §12.2-12.3 on the dlperf engine, each experiment beside plain PyTorch/NumPy in the same run.

Experiments (all CPU unless a GPU is visible):

1. Frontend vs backend (§12.2.1): 10 x (1000x1000 normal + dot); how long the Python loop takes to
   return versus to finish [frontend_fraction].
2. Barriers and blockers (§12.2.2): waitall, wait_to_read, NumPy and scalar conversion after a dot.
3. Per-op overhead (§12.2.3): 1000 x (y = x + 1) on a 1x2 array, asynchronous (one waitall at the
   end) [async_us_per_op] and synchronous (a wait after each) [sync_us_per_op]; bulk execution; plain
   PyTorch eager [torch_us_per_op], in alternating rounds of one run, with the ratios to it
   [async_vs_torch, sync_vs_torch] and whether other work competed for the CPUs meanwhile
   [per_op_contention, judged by dlperf.timing's contention rule]. The engine batches small
   operations automatically (EngineConfig.auto_bulk); the same rounds also time an engine with it
   off [async_no_auto_bulk_us_per_op, async_no_auto_bulk_vs_torch], and the asynchronous loop's
   process CPU time against torch's [async_cpu_vs_torch], which other programs sway less, and the
   least share of a round's records that went in automatic batches [async_batched_share_min]: near
   1 (the first push of a round goes alone) unless batching failed, whatever the ratio says.
4. Automatic parallelism (§12.3.1): 10 matrix products on cpu(0) and 10 on cpu(1), one intra-op
   thread each: together versus the longer alone [parallel_ratio]; plain PyTorch runs them one
   after the other [torch_sequential_ratio].
5. Memory footprint (§12.2.4): an MLP training loop with at most k mini-batches in flight.
6. With a GPU: CPU and GPU work together (§12.3.1) and GPU compute overlapped with copies back to
   the host (§12.3.2) [gpu_parallel_ratio, gpu_copy_ratio].

Run:  flock /tmp/dlperf-cpu.lock .venv/bin/python benchmarks/bench_engine.py [--quick]
Prints a fixed-width table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy
import torch

from dlperf.devices import cpu, gpu, num_gpus
from dlperf.engine import InFlight, create_engine
from dlperf.engine import array as dnp
from dlperf.timing import ContentionMonitor, time_steps

ROWS: list[tuple[str, str, str, str]] = []  # (experiment, variant, value, note)


def row(experiment: str, variant: str, value: str, note: str = "") -> None:
    ROWS.append((experiment, variant, value, note))


def med(xs: list[float]) -> float:
    return statistics.median(xs)


# ------------------------------------------------------------------------------------------ 1
def frontend_vs_backend(repeats: int) -> dict:
    def seed_loop(eng):
        for _ in range(10):
            a = dnp.random.normal(size=(1000, 1000), engine=eng)
            b = dnp.dot(a, a)
        return b

    fractions, fronts, totals = [], [], []
    with create_engine() as eng:
        seed_loop(eng)
        eng.waitall()  # warm-up: worker started, thread pool and allocator warm
        for _ in range(repeats):
            t0 = time.perf_counter()
            seed_loop(eng)
            t1 = time.perf_counter()
            eng.waitall()
            t2 = time.perf_counter()
            fronts.append(t1 - t0)
            totals.append(t2 - t0)
            fractions.append((t1 - t0) / (t2 - t0))

    def numpy_loop():
        for _ in range(10):
            a = numpy.random.normal(size=(1000, 1000))
            numpy.dot(a, a)

    def torch_loop():
        for _ in range(10):
            a = torch.randn(1000, 1000)
            a @ a

    t_np = time_steps(numpy_loop, warmup=1, steps=repeats).median_s
    t_torch = time_steps(torch_loop, warmup=1, steps=repeats).median_s
    row("12.2.1 10x(normal+dot)", "numpy", f"{t_np * 1e3:9.1f} ms", "synchronous")
    row("", "torch eager", f"{t_torch * 1e3:9.1f} ms", "synchronous")
    row("", "engine: loop returns", f"{med(fronts) * 1e3:9.3f} ms", "frontend only")
    row("", "engine: + waitall", f"{med(totals) * 1e3:9.1f} ms", "all work done")
    row("", "engine: frontend/total", f"{100 * med(fractions):9.3f} %", "target <= 0.2 %")
    return {"frontend_fraction": med(fractions), "frontend_s": med(fronts), "engine_total_s": med(totals),
            "numpy_s": t_np, "torch_eager_s": t_torch}


# ------------------------------------------------------------------------------------------ 2
def barriers(repeats: int) -> dict:
    out: dict[str, float] = {}
    with create_engine() as eng:
        a = dnp.random.normal(size=(1000, 1000), engine=eng)
        eng.waitall()

        def via_waitall():
            dnp.dot(a, a)
            eng.waitall()

        def via_wait_to_read():
            dnp.dot(a, a).wait_to_read()

        def via_numpy():
            dnp.dot(a, a).asnumpy()

        def via_item():
            dnp.dot(a, a).sum().item()

        for name, fn in [("waitall", via_waitall), ("wait_to_read", via_wait_to_read),
                         ("numpy conversion", via_numpy), ("scalar conversion", via_item)]:
            t = time_steps(fn, warmup=1, steps=repeats).median_s
            out[name.replace(" ", "_") + "_s"] = t
            kind = "implicit blocker" if "conversion" in name else "barrier"
            row("12.2.2 dot + barrier" if name == "waitall" else "", name, f"{t * 1e3:9.2f} ms", kind)
    return out


# ------------------------------------------------------------------------------------------ 3
def per_op_overhead(repeats: int, n: int = 1000) -> dict:
    asyncs, syncs, bulks, torchs, offs = [], [], [], [], []
    async_cpu, torch_cpu = [], []  # process CPU time (all threads): less sensitive to other programs
    batched = []  # share of each round's records sent in automatic batches: tells a slow run that did not batch
    monitor = ContentionMonitor(threads=2)  # the frontend and the engine's worker
    with create_engine() as eng, create_engine(auto_bulk=0) as off:
        x = dnp.ones((1, 2), engine=eng)
        x.wait_to_read()
        x_off = dnp.ones((1, 2), engine=off)
        x_off.wait_to_read()
        for r in range(repeats + 1):  # the first round warms up and is dropped
            if r == 1:
                monitor.start()
            else:
                monitor.sample()
            # Each variant ends with waitall: the ops are independent, so the last result can be
            # ready (a waiting thread may run it itself) while earlier ones still queue, and their
            # cost would leak into the next variant's (or torch's) time instead of this one's.
            b0, a0 = eng.records_batched, eng.records_alone
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(n):
                y = x + 1
            eng.waitall()
            asyncs.append((time.perf_counter() - t0) / n)
            async_cpu.append((time.process_time() - c0) / n)
            batched.append((eng.records_batched - b0) / max(1, eng.records_batched - b0 + eng.records_alone - a0))

            t0 = time.perf_counter()
            for _ in range(n):
                y = x + 1
                y.wait_to_read()
            eng.waitall()
            syncs.append((time.perf_counter() - t0) / n)

            t0 = time.perf_counter()
            with eng.bulk(64):
                for _ in range(n):
                    y = x + 1
            eng.waitall()
            bulks.append((time.perf_counter() - t0) / n)

            t0 = time.perf_counter()
            for _ in range(n):
                y_off = x_off + 1
            off.waitall()
            offs.append((time.perf_counter() - t0) / n)

            xt = torch.ones(1, 2)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(n):
                yt = xt + 1
            torchs.append((time.perf_counter() - t0) / n)
            torch_cpu.append((time.process_time() - c0) / n)
        contention = monitor.stop()
        assert y.tolist() == y_off.tolist() == yt.tolist() == [[2.0, 2.0]]
    a, s, b, t, o = (med(v[1:]) * 1e6 for v in (asyncs, syncs, bulks, torchs, offs))
    cpu_ratio = med(async_cpu[1:]) / med(torch_cpu[1:])
    busy = f"contended: {contention.reason}" if contention.contended else "not contended"
    row("12.2.3 1000x(x+1), 1x2", "torch eager", f"{t:9.2f} us/op", f"synchronous, no engine; {busy}")
    row("", "engine async", f"{a:9.2f} us/op", f"{a / t:.2f}x torch (target <= 1.5x; MXNet 1.9.1: 36 us)")
    row("", "engine sync (wait each)", f"{s:9.2f} us/op", f"{s / t:.2f}x torch (target <= 4x; MXNet 1.9.1: 91 us)")
    row("", "engine async, bulk(64)", f"{b:9.2f} us/op", f"{b / t:.2f}x torch")
    row("", "engine async, auto_bulk=0", f"{o:9.2f} us/op", f"{o / t:.2f}x torch (automatic batches off)")
    row("", "engine async, CPU time", "", f"{cpu_ratio:.2f}x torch's (process CPU time, all threads)")
    row("", "engine async, batched", f"{min(batched[1:]):9.3f}", "least share of a round's records batched")
    return {"async_us_per_op": a, "sync_us_per_op": s, "bulk_us_per_op": b, "torch_us_per_op": t,
            "async_vs_torch": a / t, "sync_vs_torch": s / t, "async_no_auto_bulk_us_per_op": o,
            "async_no_auto_bulk_vs_torch": o / t, "async_cpu_vs_torch": cpu_ratio,
            "async_batched_share_min": min(batched[1:]),
            "per_op_contention": contention.to_dict()}


# ------------------------------------------------------------------------------------------ 4
def _two_devices(op, xt: torch.Tensor, title: str, repeats: int) -> dict:
    """10 x op on cpu(0) and 10 x op on cpu(1), one intra-op thread each, against each alone."""
    def run(x):
        return [op(x) for _ in range(10)]

    alone0, alone1, both = [], [], []
    with create_engine(cpu_threads=1) as eng:
        x0 = dnp.array(xt, device=cpu(0), engine=eng)
        x1 = dnp.array(xt, device=cpu(1), engine=eng)
        run(x0)
        run(x1)
        eng.waitall()  # warm-up: both workers started with their one-thread budgets
        for _ in range(repeats):
            for target, xs in ((alone0, (x0,)), (alone1, (x1,)), (both, (x0, x1))):
                t0 = time.perf_counter()
                for x in xs:
                    run(x)
                eng.waitall()
                target.append(time.perf_counter() - t0)
        eng.start_trace()
        run(x0)
        run(x1)
        eng.waitall()
        summary = eng.stop_trace().summary()
    ratio = med([b / max(p, q) for b, p, q in zip(both, alone0, alone1)])

    # Plain PyTorch in one thread can only run the two lists one after the other.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = time_steps(lambda: [op(xt) for _ in range(10)], warmup=1, steps=repeats).median_s
        two = time_steps(lambda: [op(xt) for _ in range(20)], warmup=1, steps=repeats).median_s
    finally:
        torch.set_num_threads(prev)
    # The machine's own ceiling: two plain Python threads, one intra-op thread each, no engine.
    raw = med([_raw_threads(op, xt, 2) / _raw_threads(op, xt, 1) for _ in range(repeats)])
    row(title, "torch 1 thread: one list", f"{one * 1e3:9.1f} ms", "")
    row("", "torch 1 thread: both lists", f"{two * 1e3:9.1f} ms", f"ratio {two / one:.2f} (sequential)")
    row("", "2 raw threads, no engine", "", f"ratio {raw:.3f} (this machine's ceiling now)")
    row("", "engine cpu(0) alone", f"{med(alone0) * 1e3:9.1f} ms", "1 intra-op thread")
    row("", "engine cpu(1) alone", f"{med(alone1) * 1e3:9.1f} ms", "1 intra-op thread")
    row("", "engine cpu(0)+cpu(1)", f"{med(both) * 1e3:9.1f} ms", f"ratio {ratio:.3f} (target <= 1.15)")
    row("", "trace: overlap / parallelism", f"{100 * summary.overlap_fraction:9.1f} %",
        f"mean parallelism {summary.parallelism:.2f}")
    return {"ratio": ratio, "raw_threads_ratio": raw, "alone_s": [med(alone0), med(alone1)],
            "both_s": med(both), "torch_sequential_ratio": two / one,
            "overlap_fraction": summary.overlap_fraction}


def automatic_parallelism(repeats: int, size: int, sort_n: int) -> dict:
    torch.manual_seed(0)
    mm = _two_devices(lambda x: x @ x, torch.rand(size, size), f"12.3.1 10 dots {size}^2 x2", repeats)
    # A second, scalar-bound workload (no FMA/vector units, little memory traffic per element),
    # so a miss can be told apart from two GEMMs fighting over shared caches and memory bandwidth.
    srt = _two_devices(lambda x: torch.sort(x), torch.randint(0, 1 << 30, (sort_n,)),
                       f"12.3.1' 10 sorts {sort_n // 1000}k x2", repeats)
    return {"parallel_ratio": mm["ratio"], "parallel": mm, "parallel_ratio_sort": srt["ratio"],
            "parallel_sort": srt, "torch_sequential_ratio": mm["torch_sequential_ratio"]}


def _raw_threads(op, x: torch.Tensor, k: int) -> float:
    import threading

    def work():
        torch.get_num_threads()  # initialise this thread before setting its budget (see CpuWorker)
        torch.set_num_threads(1)
        for _ in range(10):
            op(x)

    threads = [threading.Thread(target=work) for _ in range(k)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------ 5
def memory_footprint(batches: int, batch_size: int) -> dict:
    """Train an MLP with at most k mini-batches in flight; count what the queue pins in memory.

    Each queued step holds its input batch (made by the frontend, as d2l's data_iter does), so the
    memory that queued work pins is (steps pushed but unfinished) x (bytes per batch); it is
    counted exactly rather than read from RSS, which the allocator's caching blurs.
    """
    from torch import nn

    out = {}
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512), nn.ReLU(), nn.Linear(512, 1))
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)

    def train_step(X, y):
        opt.zero_grad()
        loss = ((net(X).squeeze(1) - y) ** 2).mean() / 2
        loss.backward()
        opt.step()
        return loss.item()

    train_step(torch.randn(batch_size, 512), torch.ones(batch_size))  # warm-up: grads, optimizer state
    batch_mb = (batch_size * 512 + batch_size) * 4 / 2**20
    for k in (1, 2, None):
        with create_engine() as eng:
            params = eng.new_var("params")
            window = InFlight(k, engine=eng) if k else None
            ops = []
            peak = 0
            t0 = time.perf_counter()
            for _ in range(batches):
                X = torch.randn(batch_size, 512)
                y = torch.ones(batch_size)
                ops.append(eng.push(train_step, args=(X, y), writes=[params], name="train_step"))
                peak = max(peak, sum(not op.done for op in ops[-(k or batches) - 1:]))
                if window:
                    window.submit(ops[-1])
            t_front = time.perf_counter() - t0
            eng.waitall()
            t_total = time.perf_counter() - t0
        label = f"k={k}" if k else "unbounded"
        row("12.2.4 MLP loop, in flight" if k == 1 else "", label, f"{t_total * 1e3:9.1f} ms",
            f"frontend {t_front * 1e3:.1f} ms; peak {peak} queued = {peak * batch_mb:.0f} MB inputs")
        out[label] = {"total_s": t_total, "frontend_s": t_front, "peak_in_flight": peak,
                      "peak_queued_input_mb": peak * batch_mb}
    return {"memory_footprint": out}


# ------------------------------------------------------------------------------------------ 6
def gpu_experiments(repeats: int) -> dict:
    if num_gpus() == 0:
        row("12.3 CPU+GPU, GPU+copy", "skipped", "        -", "no GPU visible")
        return {"gpu_parallel_ratio": None, "gpu_copy_ratio": None}

    def run(x):
        return [x.dot(x) for _ in range(10)]

    with create_engine() as eng:
        xc = dnp.random.uniform(size=(2000, 2000), engine=eng)
        xg = dnp.random.uniform(size=(6000, 6000), device=gpu(0), engine=eng)
        run(xc)
        [y.copyto(cpu(0)) for y in run(xg)]
        eng.waitall()

        def timed(fn):
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                eng.waitall()
                ts.append(time.perf_counter() - t0)
            return med(ts)

        t_cpu = timed(lambda: run(xc))
        t_gpu = timed(lambda: run(xg))
        t_both = timed(lambda: (run(xc), run(xg)))
        ys = run(xg)
        eng.waitall()
        t_copy = timed(lambda: [y.copyto(cpu(0)) for y in ys])
        t_gpu_copy = timed(lambda: [y.copyto(cpu(0)) for y in run(xg)])
    row("12.3.1 CPU & GPU", "cpu / gpu alone", f"{t_cpu * 1e3:9.1f} ms", f"gpu {t_gpu * 1e3:.1f} ms")
    row("", "together", f"{t_both * 1e3:9.1f} ms", f"ratio {t_both / max(t_cpu, t_gpu):.3f} (<= 1.15)")
    row("12.3.2 GPU + copy", "run / copy alone", f"{t_gpu * 1e3:9.1f} ms", f"copy {t_copy * 1e3:.1f} ms")
    row("", "run and copy", f"{t_gpu_copy * 1e3:9.1f} ms",
        f"ratio {t_gpu_copy / max(t_gpu, t_copy):.3f} (<= 1.15)")
    return {"gpu_parallel_ratio": t_both / max(t_cpu, t_gpu), "gpu_copy_ratio": t_gpu_copy / max(t_gpu, t_copy)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and smaller workloads")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    result: dict = {"machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}, {num_gpus()} GPUs"}
    result.update(frontend_vs_backend(repeats))
    result.update(barriers(repeats))
    result.update(per_op_overhead(2 * repeats + 1))  # rounds are cheap (ms): more of them steady the medians
    result.update(automatic_parallelism(repeats, 600 if args.quick else 1000,
                                        500_000 if args.quick else 2_000_000))
    result.update(memory_footprint(10 if args.quick else 30, 1024))
    result.update(gpu_experiments(repeats))
    print(f"{'experiment':<28} {'variant':<28} {'value':>15}  note")
    print("-" * 100)
    for exp, variant, value, note in ROWS:
        print(f"{exp:<28} {variant:<28} {value:>15}  {note}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

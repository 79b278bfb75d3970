"""Does the cost model rank the allreduce algorithms as this machine does?

For k logical CPU devices (default 2, 3 and 4) and tensors of 4 KB, 1 MB and 64 MB per device, every
registered algorithm is timed two ways: with each device's share an engine operation on its lane, one
thread per device (``allreduce(xs, name, workers=engine_lanes(...))``, as the Trainer reduces each
bucket), and on the calling thread, in alternating rounds whose order rotates; an
algorithm's time is the median of its per-round medians. Beside it stand the prediction ``auto``
makes (``dlperf.parallel.allreduce.auto``: each algorithm's schedule, its operators, memory traffic
and worker hand-offs, costed with the probe's figures and a hand-off timed now) and the algorithm
it picks.

On a two-core machine k = 3 and 4 run more worker threads than cores: the OS time-shares them, which
the model does not describe, so those rows test the model beyond its assumptions.

    flock /tmp/dlperf-cpu.lock .venv/bin/python benchmarks/bench_allreduce_model.py

Agreement: the predicted best agrees when its measured time is within ``--tolerance`` (10%) of the
measured best; the order agrees when no pair the model separates is measured the other way round by
more than the tolerance (pairs the model ties may come in either order). The last stdout line is
one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

import torch

from dlperf.devices import copy_to, cpu, cpu_count
from dlperf.parallel import algorithm_names, allreduce, engine_lanes
from dlperf.parallel.allreduce import choose_algorithm
from dlperf.parallel.allreduce.auto import cache_figures, describe_bytes, link_hardware, predict
from dlperf.probe.cost import ALLREDUCE_FORMULAS
from dlperf.timing import time_steps

SIZES = (4 * 1024, 1024 * 1024, 64 * 1024 * 1024)
_TIE = 1e-9


def _calls_per_round(nbytes: int) -> int:
    # about the same wall time per cell: small tensors need many calls for a stable median
    return 200 if nbytes <= 64 * 1024 else 40 if nbytes <= 4 * 1024 * 1024 else 5


def measure(k: int, nbytes: int, names: list[str], rounds: int, use_workers: bool) -> dict[str, dict]:
    devs = [cpu(i) for i in range(k)]
    g = torch.Generator().manual_seed(k)
    xs = [copy_to(torch.randn(nbytes // 4, generator=g), d) for d in devs]
    per_round: dict[str, list[float]] = {n: [] for n in names}
    steps = _calls_per_round(nbytes)
    with engine_lanes(devs, cpu_threads=1) as pool:
        workers = pool if use_workers else None
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                t = time_steps(lambda name=name: allreduce(xs, name, workers=workers), warmup=2, steps=steps)
                per_round[name].append(t.median_s)
    return {n: {"median_s": statistics.median(v), "min_s": min(v), "rounds_s": v} for n, v in per_round.items()}


def _order_text(pairs: list[tuple[str, float]], tie) -> str:
    """``a < b = c``: names fastest first, '=' where ``tie(x, y)``."""
    out = pairs[0][0]
    for (_, prev), (name, t) in zip(pairs, pairs[1:]):
        out += (" = " if tie(prev, t) else " < ") + name
    return out


def compare(k: int, nbytes: int, measured: dict[str, dict], tolerance: float, use_workers: bool) -> dict:
    names = [n for n in measured if n in ALLREDUCE_FORMULAS]
    hardware, source = link_hardware([cpu(i) for i in range(k)])
    predicted = {p.algorithm: p.seconds for p in predict(nbytes, k, hardware, shared_memory=True, algorithms=names,
                                                          cache=cache_figures(), workers=use_workers)}
    pick, reason = choose_algorithm(nbytes, k, workers=use_workers)
    got = {n: measured[n]["median_s"] for n in names}
    best = min(got, key=got.__getitem__)
    within = got[pick] <= got[best] * (1 + tolerance)
    discordant = []
    for a, b in itertools.combinations(names, 2):
        if predicted[a] > predicted[b]:
            a, b = b, a
        if predicted[b] > predicted[a] * (1 + _TIE) and got[a] > got[b] * (1 + tolerance):
            discordant.append(f"{a}<{b}")
    pred_sorted = sorted(predicted.items(), key=lambda kv: kv[1])
    meas_sorted = sorted(got.items(), key=lambda kv: kv[1])
    return {"k": k, "bytes": nbytes, "workers": use_workers, "predicted_order": [n for n, _ in pred_sorted],
            "predicted_text": _order_text(pred_sorted, lambda x, y: y <= x * (1 + _TIE)),
            "measured_order": [n for n, _ in meas_sorted],
            "measured_text": _order_text(meas_sorted, lambda x, y: y <= x * (1 + tolerance)),
            "predicted_s": predicted, "measured_s": got, "auto_pick": pick, "auto_reason": reason,
            "measured_best": best, "best_agrees": within, "discordant_pairs": discordant,
            "order_agrees": not discordant, "auto_measured_s": measured.get("auto", {}).get("median_s"),
            "links_from": source}


def print_table(row: dict, measured: dict[str, dict]) -> None:
    k, size = row["k"], describe_bytes(row["bytes"])
    how = "with device workers" if row["workers"] else "on the calling thread"
    print(f"\nk = {k}, {size} per device, {how}")
    print(f"  {'algorithm':<10} {'predicted ms':>13} {'pred rank':>9} {'measured ms':>12} {'meas rank':>9} "
          f"{'min ms':>9}  round medians ms")
    for name in row["predicted_order"]:
        rounds = " ".join(f"{t * 1e3:.3g}" for t in measured[name]["rounds_s"])
        print(f"  {name:<10} {row['predicted_s'][name] * 1e3:>13.4g} {row['predicted_order'].index(name) + 1:>9} "
              f"{row['measured_s'][name] * 1e3:>12.4g} {row['measured_order'].index(name) + 1:>9} "
              f"{measured[name]['min_s'] * 1e3:>9.4g}  {rounds}")
    if row["auto_measured_s"] is not None:
        print(f"  {'auto':<10} {'':>13} {'':>9} {row['auto_measured_s'] * 1e3:>12.4g}   (picks {row['auto_pick']})")
    print(f"  predicted: {row['predicted_text']}")
    print(f"  measured:  {row['measured_text']}   ('=' within the tolerance)")
    print(f"  auto picks {row['auto_pick']}; measured best {row['measured_best']}: "
          f"{'agrees' if row['best_agrees'] else 'DISAGREES'}"
          + (f"; order disagrees on {', '.join(row['discordant_pairs'])}" if row["discordant_pairs"] else
             "; order agrees"))


def spin_ratio(seconds: float = 0.3) -> float:
    """Process CPU time over wall time of a pure-Python spin: below 1 when another process takes our core."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall0 < seconds:
        pass
    return (time.process_time() - cpu0) / (time.perf_counter() - wall0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="2,3,4", help="comma-separated k values")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tolerance", type=float, default=0.10, help="measured times this close count as equal")
    ap.add_argument("--modes", default="workers,caller",
                    help="workers: allreduce(..., workers=engine lanes) as the Trainer runs each bucket; caller: "
                         "no workers, every task on the calling thread")
    args = ap.parse_args()
    ks = [int(s) for s in args.devices.split(",") if s.strip()]
    cores = cpu_count()
    load_before = os.getloadavg()[0]
    ratio_before = spin_ratio()
    names = algorithm_names()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    rows = []
    modes = [m.strip() == "workers" for m in args.modes.split(",") if m.strip()]
    print(f"links from {link_hardware([cpu(0), cpu(1)])[1]}")
    for use_workers in modes:
        for k in ks:
            for nbytes in SIZES:
                measured = measure(k, nbytes, names, args.rounds, use_workers)
                row = compare(k, nbytes, measured, args.tolerance, use_workers)
                print_table(row, measured)
                rows.append(row)
    busy_ratio = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    ratio_after, load_after = spin_ratio(), os.getloadavg()[0]
    # Others' load before we start, or a spin that got less than 90% of a core, means the figures
    # include time another process took from us.
    contended = load_before > 0.5 * cores or min(ratio_before, ratio_after) < 0.9
    print(f"\n{cores} cores; load average {load_before:.2f} before, {load_after:.2f} after; "
          f"spin CPU/wall {ratio_before:.2f} before, {ratio_after:.2f} after; process CPU/wall while timing "
          f"{busy_ratio:.2f}" + ("; CONTENDED: rerun on an idle machine" if contended else ""))
    if any(k > cores for k in ks):
        print(f"k > {cores} cores: workers time-share the cores, beyond the model's assumptions")
    best_ok = all(r["best_agrees"] for r in rows)
    order_ok = all(r["order_agrees"] for r in rows)
    print(f"predicted best within {args.tolerance:.0%} of measured best: {sum(r['best_agrees'] for r in rows)}"
          f"/{len(rows)}; whole order agrees: {sum(r['order_agrees'] for r in rows)}/{len(rows)}")
    summary = {f"{'workers' if r['workers'] else 'caller'}_k{r['k']}_{describe_bytes(r['bytes']).replace(' ', '')}": {
        "predicted": r["predicted_order"], "measured": r["measured_order"], "auto": r["auto_pick"],
        "best_agrees": r["best_agrees"], "order_agrees": r["order_agrees"],
        "predicted_ms": {n: round(t * 1e3, 5) for n, t in r["predicted_s"].items()},
        "measured_ms": {n: round(t * 1e3, 5) for n, t in r["measured_s"].items()}} for r in rows}
    print(json.dumps({"sizes": summary, "ranking_agrees": best_ok and order_ok, "best_agrees": best_ok,
                      "order_agrees": order_ok, "tolerance": args.tolerance, "links_from": rows[0]["links_from"],
                      "contended": contended, "loadavg_before": load_before, "loadavg_after": load_after,
                      "spin_cpu_per_wall": [round(ratio_before, 3), round(ratio_after, 3)],
                      "process_cpu_per_wall": round(busy_ratio, 3), "cores": cores}))


if __name__ == "__main__":
    main()

"""Two hosts for real (network namespaces on a veth pair): gloo allreduce bandwidth, and how fast a kill stops all.

Needs root, the ``ip`` command (iproute2) and ``unshare`` (util-linux); run under the machine's benchmark lock:

    flock /tmp/dlperf-cpu.lock .venv/bin/python benchmarks/bench_netns.py

Each host runs its own ProcessLauncher with one worker (``--nnodes 2``), the rendezvous store on host 0's
address. Measured:

* gloo allreduce of float32 tensors of a few sizes between the two hosts, with the shared timing protocol
  (warm-up, then the median of single allreduces, a barrier around each; dlperf.timing judges whether other
  work competed for the cores while they ran). Bus bandwidth = size / time * 2(k-1)/k (k = 2: size / time).
  The same between two workers of one launcher on loopback, for comparison.
* ``fault_exit_s``: a worker SIGKILLs itself; the time from the kill to every process of both hosts gone
  (both launchers, the other worker, the children the workers started). Once while the other worker waits
  in an allreduce (gloo notices the lost peer), once while it computes outside any collective (only the
  launchers' fault board can stop it). Target: at most ``fault_timeout_s`` + 5 s.
* LeNet, global batch 256, one training step, one process per host x 1 thread: the dlperf Trainer and
  PyTorch DDP in the same processes, steps alternating, each with a process group of its own
  (bench_distributed.py's step builders and loop; best of ``--lenet-rounds`` rounds). Between the hosts
  the Trainer's gradient sums go through gloo over the veth link (each node runs in a UTS namespace with a
  host name of its own: the Trainer takes ranks with one host name to share memory). The same on one host
  over loopback, where the Trainer sums through shared memory, plus a row with its sums through gloo.

The last stdout line is one JSON object: busbw_gbs and loopback_busbw_gbs by size, allreduce_ms, contended
cells, fault_exit_s (the worse of the two), fault_exit_s_by_mode, fault_timeout_s, fault_within_target,
the causes both hosts named; netns_lenet_trainer_ms, netns_lenet_ddp_ms, netns_ratio_vs_ddp (Trainer over
DDP, below 1 is faster), the loopback_ equivalents (and loopback_lenet_trainer_gloo_ms), each round's
times and ratios, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# the LeNet step builders and their alternating loop are bench_distributed's (this directory is on sys.path
# when a benchmark runs as a script, and spawned workers inherit it)
import bench_distributed as lenet
from dlperf.parallel.launchers import LaunchError, ProcessLauncher
from dlperf.timing import time_steps

# the namespaces helper is test support, kept out of the library: it lives beside the tests
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.netns import Hosts, node_result, nodes_unavailable_reason  # noqa: E402

SIZES = (64 * 1024, 1024 * 1024, 16 * 1024 * 1024, 64 * 1024 * 1024)
PORT = 29500  # the namespaces are fresh: nothing else listens in them
TARGET_MARGIN_S = 5.0
# the LeNet configurations: between the hosts the Trainer's sums go through gloo by themselves (one process
# per host); on one host they take shared memory, and the gloo row separates the transport from the link
NETNS_LENET = ("trainer", "ddp")
LOOPBACK_LENET = ("trainer", "trainer_gloo", "ddp")


# --- what runs inside each host -----------------------------------------------------------------------

def _allreduce_worker(sizes: list[int], warmup: int, steps: int) -> dict:
    import torch.distributed as dist

    out = {}
    for size in sizes:
        t = torch.ones(size // 4)
        timing = time_steps(lambda t=t: dist.all_reduce(t), warmup=warmup, steps=steps, synchronize=dist.barrier,
                            threads=1)
        out[size] = {"median_s": timing.median_s, "contended": timing.contended,
                     "reason": timing.contention.reason if timing.contention else None}
    return out


def _kill_worker(pid_dir: str, victim: bool, in_collective: bool) -> None:
    import torch.distributed as dist

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    Path(pid_dir, f"{os.getpid()}.pids").write_text(f"{os.getpid()} {child.pid}")
    dist.barrier()
    if victim:
        Path(pid_dir, "killed_at").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    if in_collective:
        dist.all_reduce(torch.ones(1))
    end = time.monotonic() + 300
    while time.monotonic() < end:
        torch.ones(64, 64) @ torch.ones(64, 64)
        time.sleep(0.01)


def _lenet_worker(steps: int, warmup: int, rounds: int) -> dict:
    return {"rounds": lenet._worker(steps, warmup, rounds, NETNS_LENET), "host": socket.gethostname()}


def node_main(a: argparse.Namespace) -> int:
    if a.node == "lenet":
        # the Trainer tells hosts apart by host name; namespaces share the machine's, so each node takes one
        # of its own (it runs in a UTS namespace of its own, see _nodes), as a real host has
        socket.sethostname(f"{socket.gethostname()}-h{a.node_rank}")
    launcher = ProcessLauncher(1, nnodes=2, node_rank=a.node_rank, master_addr=a.master_addr,
                               master_port=a.master_port, join_timeout_s=300, fault_timeout_s=a.fault_timeout)
    try:
        if a.node == "allreduce":
            out = {"ok": True, "results": launcher.launch(_allreduce_worker, list(SIZES), a.warmup, a.steps)}
        elif a.node == "lenet":
            out = {"ok": True, "results": launcher.launch(_lenet_worker, a.lenet_steps, a.warmup, a.lenet_rounds)}
        else:
            launcher.launch(_kill_worker, a.pid_dir, a.node_rank == 1, a.node == "kill-collective")
            out = {"ok": True}
    except LaunchError as exc:
        out = {"ok": False, "error": str(exc)}
    print(json.dumps(out), flush=True)
    return 0


# --- the measurement --------------------------------------------------------------------------------

def _nodes(hosts: Hosts, mode: str, args: argparse.Namespace, pid_dir: str = "") -> list[subprocess.Popen]:
    return hosts.start_nodes(__file__, ["--node", mode, "--fault-timeout", str(args.fault_timeout), "--steps",
                                        str(args.steps), "--warmup", str(args.warmup), "--lenet-steps",
                                        str(args.lenet_steps), "--lenet-rounds", str(args.lenet_rounds),
                                        "--pid-dir", pid_dir], PORT)


def measure_bandwidth(hosts: Hosts, args: argparse.Namespace) -> dict[int, dict]:
    nodes = [node_result(p, 600) for p in _nodes(hosts, "allreduce", args)]
    if not all(n["ok"] for n in nodes):
        raise SystemExit(f"the allreduce launch failed: {nodes}")
    # an allreduce ends when the slower rank ends
    return {int(size): max((n["results"][0][size] for n in nodes), key=lambda c: c["median_s"])
            for size in nodes[0]["results"][0]}


def measure_loopback(args: argparse.Namespace) -> dict[int, dict]:
    results = ProcessLauncher(2, join_timeout_s=300).launch(_allreduce_worker, list(SIZES), args.warmup, args.steps)
    return {size: max((r[size] for r in results), key=lambda c: c["median_s"]) for size in results[0]}


def measure_lenet(hosts: Hosts, args: argparse.Namespace) -> dict[str, list[tuple[float, bool]]]:
    """LeNet steps of the Trainer and DDP alternating, one process per host: per configuration, each round."""
    nodes = [node_result(p, 600) for p in _nodes(hosts, "lenet", args)]
    if not all(n["ok"] for n in nodes):
        raise SystemExit(f"the LeNet launch failed: {nodes}")
    names = [n["results"][0]["host"] for n in nodes]
    if len(set(names)) != len(names):
        raise SystemExit(f"the hosts share a host name ({names}): the Trainer would sum through shared memory")
    return lenet.by_config([n["results"][0]["rounds"] for n in nodes], NETNS_LENET)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def measure_fault_exit(hosts: Hosts, mode: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="dlperf-bench-netns-") as pid_dir:
        procs = _nodes(hosts, mode, args, pid_dir)
        outcomes = [node_result(p, 600) for p in procs]
        pids = [int(p) for f in Path(pid_dir).glob("*.pids") for p in f.read_text().split()]
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.01)
        gone = time.time()
        killed_at = float(Path(pid_dir, "killed_at").read_text())
    return {"fault_exit_s": gone - killed_at, "errors": [o.get("error") for o in outcomes],
            "survivors": [p for p in pids if _alive(p)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--fault-timeout", type=float, default=10.0, help="the launchers' fault_timeout_s")
    ap.add_argument("--lenet-steps", type=int, default=20, help="LeNet steps per configuration and round")
    ap.add_argument("--lenet-rounds", type=int, default=3, help="alternating LeNet rounds; the least disturbed counts")
    ap.add_argument("--node", choices=["allreduce", "lenet", "kill-collective", "kill-compute"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--node-rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master-addr", help=argparse.SUPPRESS)
    ap.add_argument("--master-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--pid-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.node:
        return node_main(args)
    reason = nodes_unavailable_reason()
    if reason is not None:
        print(f"bench_netns: {reason}", file=sys.stderr)
        return 2

    load_before = os.getloadavg()
    with Hosts(2) as hosts:
        veth = measure_bandwidth(hosts, args)
        netns_lenet = measure_lenet(hosts, args)
        faults = {mode: measure_fault_exit(hosts, mode, args) for mode in ("kill-collective", "kill-compute")}
    loop = measure_loopback(args)
    loop_lenet = lenet.measure(args.lenet_steps, args.warmup, args.lenet_rounds, LOOPBACK_LENET)
    load_after = os.getloadavg()

    print(f"gloo allreduce between 2 hosts (network namespaces, veth), 1 worker each (median of {args.steps}; "
          f"{os.cpu_count()} cores; torch {torch.__version__})")
    print(f"{'size':>10} {'veth ms':>9} {'veth GB/s':>10} {'loopback ms':>12} {'loopback GB/s':>14}  contended")
    print("-" * 72)
    for size in SIZES:
        v, lo = veth[size], loop[size]
        marks = ",".join(k for k, c in (("veth", v), ("loopback", lo)) if c["contended"]) or "-"
        print(f"{_size(size):>10} {v['median_s'] * 1e3:>9.2f} {size / v['median_s'] / 1e9:>10.3f} "
              f"{lo['median_s'] * 1e3:>12.2f} {size / lo['median_s'] / 1e9:>14.3f}  {marks}")
    print()
    print(f"SIGKILL of one worker to every process of both hosts gone (fault_timeout_s={args.fault_timeout:g}, "
          f"target <= {args.fault_timeout + TARGET_MARGIN_S:g} s)")
    for mode, label in (("kill-collective", "the other worker in an allreduce"),
                        ("kill-compute", "the other worker computing, in no collective")):
        print(f"  {label:<48} {faults[mode]['fault_exit_s']:>6.2f} s")
        print(f"    named: {faults[mode]['errors'][0]}")
    lenet_best = _print_lenet(netns_lenet, loop_lenet, args)
    print(f"load average (1, 5, 15 min): {_load(load_before)} before, {_load(load_after)} after")
    contended = {f"{k}_{size}": c["reason"] for k, cells in (("veth", veth), ("loopback", loop))
                 for size, c in cells.items() if c["contended"]}
    contended.update({f"lenet_{where}_{key}": "dlperf.timing's rule" for where, best in lenet_best.items()
                      for key, (_, c) in best.items() if c})
    if contended:
        print("WARNING: other work competed for the cores during some cells (see 'contended'); rerun")
    worst = max(f["fault_exit_s"] for f in faults.values())
    result = {
        "busbw_gbs": {str(s): s / veth[s]["median_s"] / 1e9 for s in SIZES},
        "loopback_busbw_gbs": {str(s): s / loop[s]["median_s"] / 1e9 for s in SIZES},
        "allreduce_ms": {str(s): veth[s]["median_s"] * 1e3 for s in SIZES},
        "loopback_allreduce_ms": {str(s): loop[s]["median_s"] * 1e3 for s in SIZES},
        "contended": contended,
        "fault_exit_s": worst,
        "fault_exit_s_by_mode": {m: f["fault_exit_s"] for m, f in faults.items()},
        "fault_timeout_s": args.fault_timeout,
        "fault_within_target": worst <= args.fault_timeout + TARGET_MARGIN_S,
        "fault_errors": {m: f["errors"] for m, f in faults.items()},
        "fault_survivors": {m: f["survivors"] for m, f in faults.items()},
        **_lenet_keys(netns_lenet, loop_lenet, lenet_best),
        "loadavg_before": list(load_before),
        "loadavg_after": list(load_after),
    }
    print(json.dumps(result))
    return 0


LENET_LABELS = {"trainer": "dlperf Trainer", "trainer_gloo": "dlperf Trainer, sums through gloo",
                "ddp": "PyTorch DDP"}


def _print_lenet(netns: dict, loop: dict, args: argparse.Namespace) -> dict[str, dict[str, tuple[float, bool]]]:
    """The LeNet table; returns the least disturbed round per configuration, by where it ran."""
    best = {where: {key: min(rs, key=lambda r: r[0]) for key, rs in rounds.items()}
            for where, rounds in (("netns", netns), ("loopback", loop))}
    print()
    print(f"LeNet, global batch {lenet.BATCH}, one training step, 1 process per host x 1 thread, configurations "
          f"alternating step by step (median of {args.lenet_steps}, best of {args.lenet_rounds} rounds; "
          "! = contended)")
    print(f"{'configuration':<36} {'2 hosts (veth) ms':>18} {'1 host (loopback) ms':>21}")
    print("-" * 77)
    for key, label in LENET_LABELS.items():
        cells = [f"{best[w][key][0] * 1e3:.1f}{'!' if best[w][key][1] else ' '}" if key in best[w] else "-"
                 for w in ("netns", "loopback")]
        print(f"{label:<36} {cells[0]:>18} {cells[1]:>21}")
    ratios = [best[w]["trainer"][0] / best[w]["ddp"][0] for w in ("netns", "loopback")]
    print(f"{'Trainer / DDP':<36} {ratios[0]:>17.2f}  {ratios[1]:>20.2f}")
    print("  across the hosts the Trainer's sums go through gloo (one process per host); on one host through "
          "shared memory")
    return best


def _lenet_keys(netns: dict, loop: dict, best: dict) -> dict:
    out: dict = {}
    for where, rounds in (("netns", netns), ("loopback", loop)):
        b = best[where]
        out.update({f"{where}_lenet_{key}_ms": b[key][0] * 1e3 for key in rounds})
        out[f"{where}_ratio_vs_ddp"] = b["trainer"][0] / b["ddp"][0]
        out[f"{where}_ratio_vs_ddp_by_round"] = [t[0] / d[0] for t, d in zip(rounds["trainer"], rounds["ddp"])]
        out[f"{where}_lenet_rounds_ms"] = {key: [s * 1e3 for s, _ in rs] for key, rs in rounds.items()}
    out["lenet_batch"] = lenet.BATCH
    return out


def _load(avg: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in avg)


def _size(n: int) -> str:
    return f"{n // (1024 * 1024)} MB" if n >= 1024 * 1024 else f"{n // 1024} KB"


if __name__ == "__main__":
    sys.exit(main())

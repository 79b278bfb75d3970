"""Two hosts on shaped links: every gradient strategy measured, beside the cost model's prediction and auto's choice.

Needs root, ``ip`` and ``tc`` (iproute2) and ``unshare`` (util-linux); run under the machine's benchmark lock:

    flock /tmp/dlperf-cpu.lock .venv/bin/python benchmarks/bench_cluster.py [--quick]

For each link rate (default 1, 10 and 25 Gbit/s; ``--quick``: 1 and 10) two network namespaces are joined
by a veth pair shaped with ``tbf`` to that rate (tests/support/netns.py), and each runs a ProcessLauncher
with two worker processes of one thread (``--nnodes 2``, world 4, ranks 0-1 on one host and 2-3 on the
other; each node in a UTS namespace of its own, so that the processes of different hosts never take
each other for neighbours and share memory, and on cores of its own, half of this machine's each, as real hosts
have: ``Hosts(own_cores=True)``; sharing every core, one host's ranks ran while the other's waited on the
link, and the parameter servers' cells spread 10x from one repetition to the next). Inside that job:

1. **The links are measured, not taken from the configuration, each as the cells use it**, in the same
   rounds as the cells (so the load is in both alike), at 4 KB, 32 KB, 256 KB, 768 KB, 2 MB, 16 MB, 24 MB
   and 64 MB (none a cell's size, one on either side of each; together they span the cells', the
   last-level cache's size included): gloo allreduce
   between one rank per host (``pair``, for the two-host allreduce cells and hierarchical's leaders);
   gloo's ring and the sharded exchange over all 4 ranks at once, two per host sharing the cores
   (``network``, ``sharded``: a CPU-bound veth is in the fit, not assumed); shared memory inside each
   host, both hosts at once (``intra``); dlperf's hierarchical allreduce over all 4 ranks (``hier``: its three
   phases, on shared memory and between the leaders, as the cells run them); one worker's push and pull to the
   parameter servers, every worker
   at once, with one server and with two (``rpc``, ``rpc2``: the servers' own transport); and one rank's
   reduction of 16 MB while every rank
   reduces (``reduce_s_per_byte``). Each is the median per size, fitted with
   :func:`dlperf.probe.projection.alpha_beta_fit` (latency from the small messages, bandwidth from the
   sizes on either side of the cell's own: a copy through the CPU moves what stays in the caches faster per
   byte) and turned into a per-message link through the formula of what it timed
   (:func:`dlperf.probe.projection.link_from_strategy`).
2. **Allreduce cells**: gloo allreduce between the hosts (one rank each) at several sizes.
3. **Strategy cells** on LeNet- and ResNet-18-sized gradients (their parameter bytes): ``ring`` (gloo's
   allreduce over the 4 ranks), ``sharded`` (direct reduce-scatter + all-gather: torch.distributed's
   all_to_all then all_gather), ``hierarchical`` (dlperf's host_allreduce_: shared memory inside a host,
   gloo between one leader per host), ``ps-1`` and ``ps-2`` (dlperf's dist_sync KVStore with the last 1
   or 2 ranks as servers, every key split over the servers; one pushpull per step).

Every cell is timed per repetition on its slowest rank (a barrier before each; the median of the
repetitions, eight times as many for sizes up to 1 MB, after five warm-up repetitions for those: a job runs
in the wake of the one before it; the allreduce and allreduce-strategy cells run among the fits, in the order
of their sizes, so each runs between the fits on either side of its size, round after round; the
parameter-server cells and their fits follow, round by round too, as their servers serve until the workers
close), with dlperf.timing's contention check on every rank. The prediction beside it is
:mod:`dlperf.probe.projection`'s formula for the cell's layout, priced with the links of its transport (ring:
``network`` and ``intra``; hierarchical, composed as ``dlperf plan`` composes it: ``pair`` between the
leaders, who exchange while the others wait, and ``intra``; sharded: ``sharded``; parameter servers:
``rpc`` or ``rpc2``) and, as each emulated host has a share of this machine's cores, the turns ranks that
outnumber them take for their reductions (:func:`dlperf.probe.projection.cpu_time`). Hierarchical's cells
also carry ``own_fit_s``: the same formula priced on the fit of the whole hierarchical allreduce (``hier``),
as ring is priced on gloo's ring. ``auto`` is the strategy the predictions rank fastest; it is compared
with the strategy measured fastest for each rate and model. ``--no-faults`` measures the cells alone (for
iterating on the model); ``--from-json FILE`` prices the measurements a run wrote (its last stdout line)
again, without measuring, and prints the tables and the JSON line with this analysis (the run's fault
figures copied; a run recorded without a fit this analysis reads gets one line naming it).

The last stdout line is one JSON object: ``model_error_median`` and ``model_error_max``
(|predicted - measured| / measured over every cell; targets 0.15 and 0.35), ``auto_within_10pct`` (the
share of (rate, model) pairs where auto's choice measured within 10% of the best; target 0.9), the
cells, the choices, the fitted links per rate, contended cells, and the load average before and after;
``link_down_exit_s``: host 1's link brought down (``ip link set ... down``) while two hosts train, the
seconds until both launchers have exited (target: the fault timeout + 5 s), and what each named;
``straggler_named``: three hosts train, then again with host 2's link 10x slower: whether an exchange
between every pair of hosts names host 2 (and no host in the unshaped run), and
``slow_link_weights_equal``: whether both runs end with the same weights, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dlperf.parallel.launchers import LaunchError, ProcessLauncher
from dlperf.probe.cost import Link
from dlperf.probe.projection import STRATEGIES, HostCPU, Layout, alpha_beta_fit, layout_time, link_from_strategy
from dlperf.timing import ContentionMonitor

# the namespaces helper is test support, kept out of the library: it lives beside the tests
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.netns import Hosts, node_result, nodes_unavailable_reason  # noqa: E402

PORT = 29500  # the namespaces are fresh: nothing else listens in them
RATES_GBIT = (1, 10, 25)
QUICK_RATES_GBIT = (1, 10)
SIZES = (64 << 10, 1 << 20, 8 << 20, 32 << 20)
QUICK_SIZES = (64 << 10, 1 << 20, 8 << 20)
# none of them a cell's size, and they span the cells' (a transport's rate at 16 MB overstated the sharded
# exchange's at 43 MB by 1.5-2x), with a size on either side of each cell's: a cell is priced on the link
# measured around its own size (alpha_beta_fit's ``around``), as a copy through the CPU moves what stays in
# the caches faster per byte
FIT_SIZES = (4 << 10, 32 << 10, 256 << 10, 768 << 10, 2 << 20, 16 << 20, 24 << 20, 64 << 20)
SMALL = 1 << 20  # cells and fits up to this size take SMALL_REPS times the repetitions: a few ms each, and noisy
SMALL_REPS = 8
# a job runs in the wake of the one before it (what that one left in the caches, the sockets and the scheduler):
# small jobs, a few ms each, take this many warm-up repetitions in every round, large ones --warmup
SMALL_WARMUP = 5
SERVER_STRATEGIES = ("ps-1", "ps-2")
MODELS = ("lenet", "resnet18")
TARGETS = {"model_error_median": 0.15, "model_error_max": 0.35, "auto_within_10pct": 0.9}


def gradient_bytes(name: str) -> int:
    from dlperf.models import get_spec

    return sum(p.numel() * p.element_size() for p in get_spec(name).build().parameters())


# --- what runs in every rank ----------------------------------------------------------------------------

class _Timer:
    """Times a collective on the ranks of ``group``: per repetition the slowest rank, and whether any was crowded."""

    def __init__(self, group, members: list[int]) -> None:
        self.group, self.members = group, members

    def __call__(self, fn, reps: int, warmup: int) -> tuple[list[float], bool]:
        import torch.distributed as dist

        for _ in range(warmup):
            fn()
        monitor = ContentionMonitor(1)
        monitor.start()
        samples = []
        for _ in range(reps):
            dist.barrier(group=self.group)
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
            monitor.sample()
        crowded = monitor.stop().contended
        both = torch.tensor([*samples, float(crowded)], dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        return both[:-1].tolist(), bool(both[-1].item())


def repetitions(reps: int, nbytes: int) -> int:
    return reps * SMALL_REPS if nbytes <= SMALL else reps


def warmups(warmup: int, nbytes: int) -> int:
    return max(warmup, SMALL_WARMUP) if nbytes <= SMALL else warmup


def _sharded(flat: torch.Tensor, world: int) -> None:
    import torch.distributed as dist

    parts = flat.view(world, -1)
    received = torch.empty_like(parts)
    dist.all_to_all_single(received, parts)  # row j: rank j's part that this rank reduces
    dist.all_gather_into_tensor(flat, received.sum(0))


def _server_cells(servers: int, world: int, me: int, sizes: dict[str, int], reps: int, warmup: int, rounds: int,
                  groups: dict[int, object]) -> dict[str, tuple[list[float], bool]]:
    from dlperf.kvstore import create_kvstore

    kv = create_kvstore("dist_sync", num_servers=servers, big_array_bound=1)  # every key split over the servers
    if kv.role == "server":
        kv.serve()
        kv.close()
        return {}
    timer = _Timer(groups[servers], list(range(world - servers)))
    out = {}
    # the servers' own transport (RPC), measured as the collectives' links are, for each count of servers (with
    # two, both on the second host, every message crosses the link and the two share that host's cores), in the
    # same rounds as the cells: the fit's sizes, then the models, round after round
    fit = "fit-rpc" if servers == 1 else f"fit-rpc{servers}"
    jobs = [(f"{fit}:{nbytes}", 1000 + i, nbytes, 1) for i, nbytes in enumerate(FIT_SIZES)]
    jobs += [(model, key, nbytes, warmup) for key, (model, nbytes) in enumerate(sizes.items())]
    buffers = {}
    for _, key, nbytes, _ in jobs:
        kv.init(key, torch.zeros(nbytes // 4))
        buffers[key] = (torch.ones(nbytes // 4), torch.empty(nbytes // 4))
    for r in range(rounds):
        for name, key, nbytes, warm in jobs:
            grads, result = buffers[key]
            got = timer(lambda key=key, grads=grads, result=result: kv.pushpull(key, grads, out=result),
                        repetitions(reps, nbytes), warmups(warm if r == 0 or name.startswith("fit-") else 0, nbytes))
            was = out.get(name, ([], False))
            out[name] = (was[0] + got[0], was[1] or got[1])
    kv.close()
    return out


def cluster_worker(sizes: list[int], models: dict[str, int], reps: int, warmup: int, rounds: int) -> dict:
    import torch.distributed as dist

    from dlperf.parallel.allreduce.shm import host_allreduce_, host_allreduce_kind
    from dlperf.parallel.launchers import rank_host, rank_info

    torch.set_num_threads(1)
    me, world, _ = rank_info()
    names: list = [None] * world
    dist.all_gather_object(names, rank_host())
    hosts = [sorted(set(names), key=names.index).index(n) for n in names]
    leaders = [hosts.index(h) for h in sorted(set(hosts))]
    # every group is made on every rank, in one order (new_group is collective)
    pair = dist.new_group(leaders)
    local = {h: dist.new_group([r for r in range(world) if hosts[r] == h]) for h in sorted(set(hosts))}
    worker_groups = {s: dist.new_group(list(range(world - s))) for s in (1, 2)}
    everyone = _Timer(None, list(range(world)))
    host_allreduce_(torch.zeros(1), host_name=rank_host())  # sets up the hierarchical path, collective
    kind = host_allreduce_kind()

    samples: dict[tuple[str, str], list[float]] = {}
    crowded: dict[tuple[str, str], bool] = {}

    def record(key: tuple[str, str], got: tuple[list[float], bool]) -> None:
        samples.setdefault(key, []).extend(got[0])
        crowded[key] = crowded.get(key, False) or got[1]

    mine = local[hosts[me]]
    between = _Timer(pair, leaders) if me in leaders else None  # the others wait at the barrier after each job
    neighbours = _Timer(mine, [r for r in range(world) if hosts[r] == hosts[me]])
    # what each transport costs as the cells use it, measured in the same rounds as the cells (the load is in
    # both alike): gloo between one rank per host, gloo's ring and its sharded exchange with every rank at
    # work, shared memory inside a host (both hosts at once), and one rank's reduction while all reduce
    jobs: list[tuple[tuple[str, str], _Timer | None, Callable[[], object], int, int]] = []
    for nbytes in FIT_SIZES:
        flat = torch.ones(-(-nbytes // 4 // world) * world)
        jobs += [(("fit-pair", str(nbytes)), between, lambda f=flat: dist.all_reduce(f, group=pair), 1, nbytes),
                 (("fit-world", str(nbytes)), everyone, lambda f=flat: dist.all_reduce(f), 1, nbytes),
                 (("fit-sharded", str(nbytes)), everyone, lambda f=flat: _sharded(f, world), 1, nbytes),
                 (("fit-intra", str(nbytes)), neighbours,
                  lambda f=flat: host_allreduce_(f, mine, host_name=rank_host()), 1, nbytes),
                 (("fit-hier", str(nbytes)), everyone, lambda f=flat: host_allreduce_(f, host_name=rank_host()), 1,
                  nbytes)]
    reduced = 16 << 20
    a, b = torch.ones(reduced // 4), torch.ones(reduced // 4)
    jobs.append((("reduce", str(reduced)), everyone, lambda: a.add_(b), 1, reduced))
    for nbytes in sizes:
        flat = torch.ones(nbytes // 4)
        jobs.append((("allreduce", str(nbytes)), between, lambda f=flat: dist.all_reduce(f, group=pair), warmup,
                     nbytes))
    for model, nbytes in models.items():
        flat = torch.ones(-(-nbytes // 4 // world) * world)  # whole parts for the sharded exchange
        jobs += [((strategy, model), everyone, run, warmup, nbytes) for strategy, run in (
            ("ring", lambda f=flat: dist.all_reduce(f)), ("sharded", lambda f=flat: _sharded(f, world)),
            ("hierarchical", lambda f=flat: host_allreduce_(f, host_name=rank_host())))]
    # each cell between the fits of the sizes on either side of its own, so that both run in the same conditions
    # (a job runs in the wake of the one before: measured after the largest fits, the cells took 10-30% less than
    # fits of the same operation on smaller sizes)
    jobs.sort(key=lambda job: job[4])
    for _ in range(rounds):
        for key, timer, run, warm, nbytes in jobs:
            if timer is not None:
                record(key, timer(run, repetitions(reps, nbytes), warmups(warm, nbytes)))
            dist.barrier()
    for servers in (1, 2):
        for model, got in _server_cells(servers, world, me, models, reps, warmup, rounds, worker_groups).items():
            record((f"ps-{servers}", model) if not model.startswith("fit-") else tuple(model.split(":")), got)
    # the servers have no samples of their cells: the first worker's are everyone's
    shared: list = [None]
    if me == 0:
        shared = [({f"{a}|{b}": v for (a, b), v in samples.items()},
                   {f"{a}|{b}": v for (a, b), v in crowded.items()})]
    dist.broadcast_object_list(shared, src=0)
    return {"hosts": hosts, "kind": kind, "fit_sizes": list(FIT_SIZES), "samples": shared[0][0],
            "contended": shared[0][1]}


def node_main(a: argparse.Namespace) -> int:
    # the store's shared-memory path tells hosts apart by host name: a real host has one of its own
    socket.sethostname(f"{socket.gethostname()}-h{a.node_rank}")
    launcher = ProcessLauncher(2, nnodes=2, node_rank=a.node_rank, master_addr=a.master_addr,
                               master_port=a.master_port, join_timeout_s=900, fault_timeout_s=30)
    sizes = list(QUICK_SIZES if a.quick else SIZES)
    models = {m: gradient_bytes(m) for m in MODELS}
    try:
        out = {"ok": True, "results": launcher.launch(cluster_worker, sizes, models, a.reps, a.warmup, a.rounds)}
    except LaunchError as exc:
        out = {"ok": False, "error": str(exc)}
    print(json.dumps(out), flush=True)
    return 0


# --- the measurement --------------------------------------------------------------------------------

# TensorPipe (the store's RPC) finds its address by the host name, which resolves to nothing here: the launcher
# names the interface that reaches the master (TP_SOCKET_IFNAME, beside gloo's). The store's shared-memory path is off:
# the namespaces share one pid namespace, so a worker could map a server's arena on the other "host" and then
# fail to reach its control socket, which lives in that host's network namespace; on real hosts the mapping
# fails and the RPC path is taken, as it is here.
_NODE_ENV = {"DLPERF_KVSTORE_SHM": "off"}


def measure_rate(rate_gbit: float, args: argparse.Namespace) -> dict:
    extra = ["--quick"] if args.quick else []
    with Hosts(2, rate=rate_gbit * 1e9 / 8, own_cores=True) as hosts:
        procs = hosts.start_nodes(__file__, ["--reps", str(args.reps), "--warmup", str(args.warmup), "--rounds",
                                             str(args.rounds), *extra], PORT, env=_NODE_ENV)
        outs = [node_result(p, 1800) for p in procs]
        cores = _cores_per_host(hosts.cores)
    if not all(o["ok"] for o in outs):
        raise SystemExit(f"the launch at {rate_gbit} Gbit/s failed: {[o.get('error') for o in outs]}")
    return {**outs[0]["results"][0], "cores_per_host": cores}


def _cores_per_host(shares: list[list[int]] | None) -> float | None:
    """The cores each emulated host may count on: the smallest share, or the cores over the hosts where hosts
    take turns on the same ones (fewer cores than hosts); None where every host may use every core."""
    if not shares:
        return None
    every = {c for share in shares for c in share}
    if sum(len(share) for share in shares) > len(every):
        return len(every) / len(shares)
    return float(min(len(share) for share in shares))


NODE = Path(__file__).resolve().parent.parent / "tests" / "netns_node.py"
FAULT_TIMEOUT_S = 10.0


def measure_link_down(args: argparse.Namespace) -> dict:
    """Two hosts train (tests/netns_node.py's ``train`` job); host 1's link goes down after 3 steps: the seconds
    until both launchers have exited, and what each named."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dlperf-bench-cluster-") as tmp, Hosts(2, rate=1.25e8) as hosts:
        procs = hosts.start_nodes(str(NODE), ["train", "--nnodes", "2", "--fault-timeout", str(FAULT_TIMEOUT_S),
                                              "--checkpoint", f"{tmp}/ck.pt", "--total-steps", "1000", "--pause",
                                              "0.2", "--pid-dir", tmp], PORT + 1, own_host_name=False)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(
                Path(tmp, f"step.{r}").exists() and int(Path(tmp, f"step.{r}").read_text().split()[0]) >= 3
                for r in range(2)):
            time.sleep(0.05)
        hosts.set_link(1, up=False)
        down = time.monotonic()
        errors, exits = [], []
        for p in procs:
            out, _ = p.communicate(timeout=FAULT_TIMEOUT_S + 120)
            exits.append(time.monotonic() - down)
            lines = out.strip().splitlines()
            errors.append(json.loads(lines[-1]).get("error") if lines else f"exit {p.returncode}, nothing printed")
    return {"link_down_exit_s": max(exits), "fault_timeout_s": FAULT_TIMEOUT_S,
            "link_down_within_target": max(exits) <= FAULT_TIMEOUT_S + 5, "link_down_errors": errors}


def measure_slow_link() -> dict:
    """Three hosts train 12 steps unshaped, then with host 2's link 10x slower than the others': whether the weights
    match bit for bit, the step time of each, and the host an exchange between every pair names as the straggler."""
    import tempfile

    from dlperf.probe.projection import straggler

    runs = {}
    with tempfile.TemporaryDirectory(prefix="dlperf-bench-cluster-") as tmp, Hosts(3) as hosts:
        for k, (name, rates) in enumerate((("unshaped", [None] * 3), ("slow", [1.25e8, 1.25e8, 1.25e7]))):
            for i, rate in enumerate(rates):
                hosts.set_rate(i, rate)
            where = Path(tmp, name)
            where.mkdir()
            start = time.monotonic()
            procs = hosts.start_nodes(str(NODE), ["train", "--nnodes", "3", "--checkpoint", str(where / "ck.pt"),
                                                  "--total-steps", "12", "--pid-dir", str(where)], PORT + 2 + k,
                                      own_host_name=False)
            nodes = [node_result(p, 600) for p in procs]
            if not all(n["ok"] for n in nodes):
                raise SystemExit(f"the three-host training ({name}) failed: {nodes}")
            results = [r for n in nodes for r in n["results"]]
            node_of = {r["rank"]: r["node"] for r in results}
            pairs: dict = {}
            for r in results:
                for a, b, sec in r["pair_seconds"]:
                    pairs[(node_of[a], node_of[b])] = max(sec, pairs.get((node_of[a], node_of[b]), 0.0))
            runs[name] = {"seconds": time.monotonic() - start, "weights": [r["weights"] for r in results],
                          "straggler": straggler(pairs),
                          "pair_ms": {f"{a}-{b}": sec * 1e3 for (a, b), sec in pairs.items()}}
    same = all(w == runs["unshaped"]["weights"][0] for run in runs.values() for w in run["weights"])
    return {"straggler_named": runs["slow"]["straggler"] == 2 and runs["unshaped"]["straggler"] is None,
            "slow_link_weights_equal": same, "slow_link_straggler": runs["slow"]["straggler"],
            "slow_link_pair_ms": {k: v["pair_ms"] for k, v in runs.items()},
            "slow_link_run_s": {k: v["seconds"] for k, v in runs.items()}}


def _layout(strategy: str, hosts: list[int]) -> Layout:
    servers = int(strategy[3:]) if strategy.startswith("ps-") else 0
    return Layout(tuple(hosts[:len(hosts) - servers]), tuple(hosts[len(hosts) - servers:]))


def measured_links(got: dict, around: float | None = None) -> dict[str, Link]:
    """The per-message links each cell is priced on, fitted from the medians the ranks measured (the load is in
    them, as it is in the cells), each through the formula of what it timed: ``pair`` between one rank per host,
    ``network`` gloo's ring with every rank at work, ``sharded`` gloo's sharded exchange likewise, ``intra``
    inside a host, ``rpc`` and ``rpc2`` the parameter servers' pushes and pulls (one server, two). ``around``:
    each as messages of about that many bytes see it (the bandwidth between the fit's sizes on either side)."""
    sizes, hosts = got["fit_sizes"], got["hosts"]
    per_host = max(hosts.count(h) for h in set(hosts))

    def fit(name: str, strategy: str, layout: Layout) -> Link:
        medians = [statistics.median(got["samples"][f"fit-{name}|{n}"]) for n in sizes]
        return link_from_strategy(strategy, alpha_beta_fit(sizes, medians, around), layout)

    return {"pair": fit("pair", "ring", Layout((0, 1))), "network": fit("world", "ring", Layout(tuple(hosts))),
            "sharded": fit("sharded", "sharded", Layout(tuple(hosts))),
            "intra": fit("intra", "ring", Layout((0,) * per_host)), "rpc": fit("rpc", "ps-1", _layout("ps-1", hosts)),
            "rpc2": fit("rpc2", "ps-2", _layout("ps-2", hosts)),
            "hier": fit("hier", "hierarchical", Layout(tuple(hosts)))}


def reduce_s_per_byte(got: dict) -> float:
    (key,) = (k for k in got["samples"] if k.startswith("reduce|"))
    return statistics.median(got["samples"][key]) / int(key.split("|")[1])


def analyse(rate_gbit: float, got: dict, models: dict[str, int]) -> tuple[list[dict], list[dict]]:
    hosts = len(set(got["hosts"]))
    # each emulated host has a share of this machine's cores (all of them have every core without own_cores)
    cores = got.get("cores_per_host") or max(1, (os.cpu_count() or 1)) / hosts
    cpu = HostCPU(cores, reduce_s_per_byte(got))
    cells, choices = [], []
    for key, samples in got["samples"].items():
        what, which = key.split("|")
        if what.startswith("fit-") or what == "reduce":
            continue
        nbytes = int(which) if what == "allreduce" else models[which]
        links = measured_links(got, around=nbytes)
        if what == "allreduce":
            strategy, model, layout = "ring", "-", Layout((0, 1))
            network, intra = links["pair"], links["intra"]
            predicted = layout_time(strategy, nbytes, layout, network, intra)
        else:
            strategy, model, layout = what, which, _layout(what, got["hosts"])
            # the servers' pushes and pulls travel by RPC, inside a host too (its shared memory is off here);
            # hierarchical is composed as dlperf plan composes it: its leaders exchange while the others wait, as
            # in the pair's fit, and its phases inside a host run on shared memory's link
            rpc = links["rpc2"] if what == "ps-2" else links["rpc"]
            network, intra = (rpc, rpc) if what.startswith("ps-") else \
                (links["sharded"], links["intra"]) if what == "sharded" else \
                (links["pair"], links["intra"]) if what == "hierarchical" else (links["network"], links["intra"])
            predicted = layout_time(strategy, nbytes, layout, network, intra, cpu)
        measured = statistics.median(samples)
        extra = {}
        if what == "hierarchical":
            # beside it, the three phases priced on the fit of the three together, as ring is on gloo's ring
            own = layout_time(strategy, nbytes, layout, links["hier"], links["hier"], cpu)
            extra = {"own_fit_s": own, "own_fit_error": abs(own - measured) / measured}
        cells.append({**extra, "rate_gbit": rate_gbit, "cell": what, "model": model, "bytes": nbytes,
                      "measured_s": measured,
                      "predicted_s": predicted, "error": abs(predicted - measured) / measured,
                      "contended": got["contended"][key], "repetitions": len(samples),
                      # the links around this cell's size that priced it: (latency s, bytes/s) each
                      "network_link": [network.alpha_s, network.bandwidth],
                      "intra_link": [intra.alpha_s, intra.bandwidth]})
    for model, nbytes in models.items():
        row = {c["cell"]: c for c in cells if c["model"] == model}
        names = [s for s in STRATEGIES if s in row]
        auto = min(names, key=lambda s: row[s]["predicted_s"])
        best = min(names, key=lambda s: row[s]["measured_s"])
        choices.append({"rate_gbit": rate_gbit, "model": model, "bytes": nbytes, "auto": auto, "best": best,
                        "auto_measured_s": row[auto]["measured_s"], "best_measured_s": row[best]["measured_s"],
                        "within_10pct": row[auto]["measured_s"] <= 1.1 * row[best]["measured_s"]})
    return cells, choices


def _size(n: float) -> str:
    return f"{n / (1 << 20):.1f} MB" if n >= 1 << 20 else f"{n / 1024:.0f} KB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="rates 1 and 10 Gbit/s, sizes up to 8 MB, fewer repetitions")
    ap.add_argument("--rates", default=None, help="comma-separated link rates in Gbit/s (default 1,10,25)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per cell and round")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-faults", action="store_true", help="the measured-against-predicted cells only")
    ap.add_argument("--from-json", metavar="FILE", help="price a run's recorded measurements again (its JSON line)")
    ap.add_argument("--node-rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master-addr", help=argparse.SUPPRESS)
    ap.add_argument("--master-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.reps = args.reps or (3 if args.quick else 5)
    args.rounds = args.rounds or (2 if args.quick else 3)
    if args.node_rank is not None:
        return node_main(args)
    if args.from_json:
        try:
            recorded = _recorded_run(args.from_json)
        except ValueError as exc:
            print(f"bench_cluster: {exc}", file=sys.stderr)
            return 2
        return report(recorded["measurements"], args, recorded.get("loadavg_before", [0.0] * 3),
                      recorded.get("loadavg_after", [0.0] * 3), recorded.get("elapsed_s", 0.0),
                      {k: v for k, v in recorded.items() if k in _FAULT_KEYS})
    reason = nodes_unavailable_reason()
    if reason is not None:
        print(f"bench_cluster: {reason}", file=sys.stderr)
        return 2
    rates = [float(r) for r in args.rates.split(",")] if args.rates else list(QUICK_RATES_GBIT if args.quick
                                                                             else RATES_GBIT)
    load_before = os.getloadavg()
    started = time.monotonic()
    raw = {str(rate): measure_rate(rate, args) for rate in rates}
    faults = {} if args.no_faults else {**measure_link_down(args), **measure_slow_link()}
    return report(raw, args, list(load_before), list(os.getloadavg()), time.monotonic() - started, faults)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _flag(v: object) -> bool:
    return isinstance(v, bool)


def _strings(v: object) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _numbers_by_name(v: object) -> bool:
    return isinstance(v, dict) and all(isinstance(x, dict) and all(_number(y) for y in x.values()) or _number(x)
                                       for x in v.values())


# a recorded run's fault figures, each with what it must be to be copied
_FAULT_CHECKS = {"link_down_exit_s": _number, "fault_timeout_s": _number,
                 "link_down_within_target": _flag, "link_down_errors": _strings, "straggler_named": _flag,
                 "slow_link_weights_equal": _flag,
                 "slow_link_straggler": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
                 "slow_link_pair_ms": _numbers_by_name, "slow_link_run_s": _numbers_by_name}
_FAULT_KEYS = tuple(_FAULT_CHECKS)
_RECORD_BYTES = 16 << 20  # a run's last line is a few hundred KB


def _recorded_run(path: str) -> dict:
    """The JSON object a run printed last, its measurements and figures checked; ValueError naming what is
    wrong."""
    from dlperf._io import decode_json, read_bounded

    def fail(where: str, why: str) -> ValueError:
        return ValueError(f"{where}: {why}; expected the last stdout line of a bench_cluster run")

    try:
        data = read_bounded(path, _RECORD_BYTES, fail)
    except OSError as exc:
        raise fail(path, exc.strerror or type(exc).__name__) from None
    lines = data.rstrip().splitlines()
    doc = decode_json(lines[-1] if lines else b"", path, fail, allow_nan=False, unique_keys=True)
    got = doc.get("measurements") if isinstance(doc, dict) else None
    if not isinstance(got, dict) or not got:
        raise fail(path, "no 'measurements' per rate")
    rates = [_checked_rate(path, rate, m, fail) for rate, m in got.items()]
    if len(set(rates)) < len(rates):
        raise fail(path, f"rates {list(got)!r} name one rate twice")
    for key in ("loadavg_before", "loadavg_after"):
        v = doc.get(key, [0.0] * 3)
        if not (isinstance(v, list) and len(v) == 3 and all(_number(x) for x in v)):
            raise fail(path, f"{key} {v!r} is not three load averages")
    if not _number(doc.get("elapsed_s", 0.0)):
        raise fail(path, f"elapsed_s {doc.get('elapsed_s')!r} is not a number of seconds")
    for key, ok in _FAULT_CHECKS.items():
        if key in doc and not ok(doc[key]):
            raise fail(path, f"{key} {doc[key]!r} is not what a run records there")
    return doc


def _checked_rate(path: str, rate: str, m: object, fail: Callable[[str, str], ValueError]) -> float:
    """One rate's recorded measurements checked for what the analysis reads; the rate."""
    try:
        value = float(rate)
    except ValueError:
        raise fail(path, f"rate {rate!r} is not a number") from None
    where = f"{path}, rate {rate}"
    if not math.isfinite(value) or value <= 0:
        raise fail(where, "the rate is not a positive number")
    if not isinstance(m, dict) or not {"hosts", "kind", "fit_sizes", "samples", "contended"} <= m.keys():
        raise fail(where, "no hosts, kind, fit_sizes, samples and contended")
    hosts, sizes, samples = m["hosts"], m["fit_sizes"], m["samples"]
    if not (isinstance(hosts, list) and all(isinstance(h, int) and not isinstance(h, bool) for h in hosts)
            and len(set(hosts)) >= 2):
        raise fail(where, f"hosts {hosts!r} are not a host number per rank, two hosts or more")
    if not (isinstance(sizes, list) and len(set(sizes)) >= 2 and all(_number(n) and n > 0 for n in sizes)):
        raise fail(where, f"fit_sizes {sizes!r} are not two or more sizes in bytes")
    if not isinstance(samples, dict) or not all(
            isinstance(v, list) and v and all(_number(t) and t > 0 for t in v) for v in samples.values()):
        raise fail(where, "samples are not lists of seconds, each > 0")
    cores = m.get("cores_per_host")
    if cores is not None and not (_number(cores) and cores > 0):
        raise fail(where, f"cores_per_host {cores!r} is not a positive number")
    if not isinstance(m["contended"], dict) or not isinstance(m["kind"], str):
        raise fail(where, "contended is not a mapping or kind not a name")
    return value


def report(raw: dict[str, dict], args: argparse.Namespace, load_before: list[float], load_after: list[float],
           elapsed_s: float, faults: dict) -> int:
    """Price every rate's measurements, print the tables and, last, the JSON line."""
    models = {m: gradient_bytes(m) for m in MODELS}
    rates = [float(r) for r in raw]
    cells, choices, links = [], [], {}
    for rate, got in zip(rates, raw.values(), strict=True):
        try:
            c, ch = analyse(rate, got, models)
        except (KeyError, ValueError, TypeError, ZeroDivisionError, statistics.StatisticsError) as exc:
            print(f"bench_cluster: the measurements at {rate:g} Gbit/s cannot be priced ({type(exc).__name__}: "
                  f"{exc}); expected every fit and cell a run records", file=sys.stderr)
            return 2
        cells += c
        choices += ch
        fitted = measured_links(got)
        links[str(rate)] = {**{k: [v.alpha_s, v.bandwidth] for k, v in fitted.items()},
                            "reduce_s_per_byte": reduce_s_per_byte(got), "hierarchical_kind": got["kind"]}

    if args.from_json:  # what was measured, and how, is the recorded run's
        print(f"{args.from_json}: a recorded run's measurements priced again (each the median of that run's "
              f"repetitions on its slowest rank; ! = contended)")
    else:
        print(f"2 hosts (network namespaces, veth shaped with tbf) x 2 processes x 1 thread; median of "
              f"{args.reps} x {args.rounds} repetitions ({args.reps * SMALL_REPS} x {args.rounds} up to "
              f"{SMALL >> 20} MB), each on its slowest rank ({os.cpu_count()} cores, torch "
              f"{torch.__version__}; ! = contended)")
    for rate in rates:
        got = {k: Link(*links[str(rate)][k]) for k in ("pair", "network", "sharded", "intra", "rpc", "rpc2", "hier")}
        print(f"\n{rate:g} Gbit/s ({rate / 8:.3f} GB/s configured), measured per message, one line through every "
              f"size (each cell is priced on the links around its own size: 'network_link' and 'intra_link' in "
              f"its JSON): between one rank per "
              f"host {got['pair'].describe()}, with every rank at work {got['network'].describe()} (the sharded "
              f"exchange {got['sharded'].describe()}, hierarchical's {got['hier'].describe()}), inside a host "
              f"{got['intra'].describe()}, the servers' RPC "
              f"{got['rpc'].describe()} (two servers {got['rpc2'].describe()}); a reduction "
              f"{links[str(rate)]['reduce_s_per_byte'] * 1e12:.0f} ps/byte")
        print(f"{'cell':<14}{'model':<10}{'size':>10}{'measured ms':>13}{'predicted ms':>14}{'error':>8}")
        for c in (c for c in cells if c["rate_gbit"] == rate):
            composed = f"  (own fit {c['own_fit_s'] * 1e3:.2f}, {c['own_fit_error'] * 100:.0f}%)" \
                if "own_fit_s" in c else ""
            print(f"{c['cell']:<14}{c['model']:<10}{_size(c['bytes']):>10}{c['measured_s'] * 1e3:>12.2f}"
                  f"{'!' if c['contended'] else ' '}{c['predicted_s'] * 1e3:>14.2f}{c['error'] * 100:>7.0f}%{composed}")
        for ch in (ch for ch in choices if ch["rate_gbit"] == rate):
            verdict = "within 10%" if ch["within_10pct"] else "MISSED"
            print(f"  {ch['model']}: auto chose {ch['auto']} ({ch['auto_measured_s'] * 1e3:.1f} ms), measured best "
                  f"{ch['best']} ({ch['best_measured_s'] * 1e3:.1f} ms): {verdict}")
    errors = [c["error"] for c in cells]
    result = {
        "model_error_median": statistics.median(errors),
        "model_error_max": max(errors),
        "auto_within_10pct": sum(ch["within_10pct"] for ch in choices) / len(choices),
        "targets": TARGETS,
        "rates_gbit": rates,
        "links": links,
        "cells": cells,
        "measurements": raw,
        "choices": choices,
        "contended": [f"{c['rate_gbit']:g}/{c['cell']}/{c['model']}/{c['bytes']}" for c in cells if c["contended"]],
        "elapsed_s": elapsed_s,
        "loadavg_before": list(load_before),
        "loadavg_after": list(load_after),
    }
    met = {k: (result[k] <= v if k.startswith("model") else result[k] >= v) for k, v in TARGETS.items()}
    print(f"\nmodel error median {result['model_error_median']:.3f} (target <= 0.15), "
          f"max {result['model_error_max']:.3f} (<= 0.35); auto within 10% of the best in "
          f"{result['auto_within_10pct']:.2f} of the pairs (>= 0.9); "
          f"load average {' '.join(f'{x:.2f}' for x in load_before)} before, "
          f"{' '.join(f'{x:.2f}' for x in load_after)} after")
    # a recorded run's fault figures are copied as they are: each line only where its figures are there
    if {"link_down_exit_s", "link_down_errors"} <= faults.keys():
        print(f"link of host 1 brought down mid-training: both launchers gone {faults['link_down_exit_s']:.1f} s "
              f"later (fault_timeout_s {FAULT_TIMEOUT_S:g}, target <= {FAULT_TIMEOUT_S + 5:g} s)")
        for error in faults["link_down_errors"]:
            print(f"  named: {error}")
    if {"slow_link_straggler", "slow_link_weights_equal", "slow_link_pair_ms"} <= faults.keys():
        print(f"three hosts, host 2's link 10x slower: straggler named {faults['slow_link_straggler']} (want 2), "
              f"weights equal to the unshaped run's: {faults['slow_link_weights_equal']}; pair exchanges (ms) "
              f"{faults['slow_link_pair_ms'].get('slow')}")
    result.update(faults)
    if result["contended"]:
        print("WARNING: other work competed for the cores during some cells (see 'contended')")
    result["targets_met"] = met
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One node of a launch across network namespaces: run by the tests inside each "host" (see netns.py).

    python tests/netns_node.py JOB --nnodes 2 --node-rank I --master-addr A --master-port P [--pid-dir D]

JOB is ``allreduce`` (each rank all-reduces ``(rank + 1) * [1, 2, 3, 4]`` and reports what it got),
``links`` (the measured choice between shared memory and gloo, and sums through it), ``kill`` (the
rank on node ``--victim-node`` SIGKILLs itself after a first all-reduce; the others wait in a second
all-reduce, or, with ``--compute``, compute outside any collective) or ``steps`` (after a first
all-reduce every rank computes outside any collective and saves its step count, with its node's rank,
to ``<pid-dir>/step.<rank>`` after each step, until it is stopped: the caller interrupts a node).
``train`` (a small model trained with SGD, its gradients summed by gloo every step, rank 0 saving a
checkpoint after each step to ``--checkpoint`` and every rank its step count under ``--pid-dir``; with
an existing checkpoint it resumes from it; ``--pause`` seconds between steps leave time to break a link;
with three nodes or more, every pair of ranks then times an exchange). ``fit`` trains a model of about 1 MB
of gradients with dlperf's Trainer (the ``processes`` strategy) for ``--total-steps`` steps; the first rank
returns the run's own exchange report, which names the straggler.
The last stdout line is one JSON object: ``{"ok": true, "results": [...]}``, ``{"ok": false, "error",
"rank", "role", "host", "cause"}``, or ``{"ok": false, "interrupted": SIGNAL}`` on the node that was
interrupted (which exits 128 + the signal's number). Every worker writes its pid, and the pid of a
child it starts, under ``--pid-dir``, so the caller can check that none survives; the victim writes the
time it killed itself and its rank to ``killed_at``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _record_pids(pid_dir: str | None) -> None:
    if not pid_dir:
        return
    # a child of the worker's own: the launcher must take it down with the worker
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    Path(pid_dir, f"{os.getpid()}.pids").write_text(f"{os.getpid()} {child.pid}")


def allreduce_job(pid_dir: str | None) -> dict:
    import torch
    import torch.distributed as dist

    from dlperf.parallel.launchers import rank_info, rank_role

    _record_pids(pid_dir)
    rank = rank_info().rank
    t = torch.tensor([1.0, 2.0, 3.0, 4.0]) * (rank + 1)
    dist.all_reduce(t)
    return {"rank": rank, "world": rank_info().world_size, "sum": t.tolist(), "role": rank_role(),
            "host": os.environ.get("DLPERF_HOST"), "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}


def kill_job(pid_dir: str | None, victim: bool, compute: bool) -> None:
    import torch
    import torch.distributed as dist

    _record_pids(pid_dir)
    dist.all_reduce(torch.ones(1))  # every rank is up and connected
    if victim:
        if pid_dir:
            Path(pid_dir, "killed_at").write_text(f"{time.time()!r} {os.environ['RANK']}")
        os.kill(os.getpid(), signal.SIGKILL)
    if compute:
        end = time.monotonic() + 300
        while time.monotonic() < end:  # no collective: only the launcher can stop this rank
            torch.ones(64, 64) @ torch.ones(64, 64)
            time.sleep(0.01)
    dist.all_reduce(torch.ones(1))


def links_job() -> dict:
    import torch
    import torch.distributed as dist

    from dlperf.parallel.allreduce.shm import host_allreduce_kind
    from dlperf.parallel.communication.process_group import allreduce_across_processes, describe_process_allreduce
    from dlperf.parallel.communication.process_links import choose_process_allreduce
    from dlperf.parallel.launchers import rank_host, rank_info

    rank, world, _ = rank_info()
    torch.set_num_threads(1)
    choice = choose_process_allreduce()
    exact = []
    for n in (1, 1003, 300_000):
        # whole numbers: their sum is exact in float32 whatever the order of the additions
        def addend(r: int, n: int = n) -> torch.Tensor:
            return torch.randint(-1000, 1000, (n,), generator=torch.Generator().manual_seed(10 * n + r)).float()

        ours = addend(rank)
        allreduce_across_processes(ours)
        exact.append(torch.equal(ours, sum(addend(r) for r in range(world))))
    return {"rank": rank, "kind": host_allreduce_kind(), "fits": sorted(choice.fits), "exact": exact,
            "picks": [choice.pick(1 << k) for k in range(0, 31, 5)], "describe": describe_process_allreduce(),
            "host": rank_host(), "dist_backend": dist.get_backend()}


def steps_job(pid_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from dlperf._io import atomic_write_text

    _record_pids(pid_dir)
    dist.all_reduce(torch.ones(1))  # every rank is up and connected
    rank = os.environ["RANK"]
    step = 0
    end = time.monotonic() + 300
    while time.monotonic() < end:  # no collective: only the launcher can stop this rank
        torch.ones(64, 64) @ torch.ones(64, 64)
        step += 1
        atomic_write_text(Path(pid_dir, f"step.{rank}"), f"{step} {os.environ['GROUP_RANK']}\n")
        time.sleep(0.02)


def _train_batch(step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def train_job(pid_dir: str | None, checkpoint: str, total: int, pause: float) -> dict:
    import torch
    import torch.distributed as dist

    from dlperf._io import atomic_write_bytes, atomic_write_text

    _record_pids(pid_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    start = 0
    if os.path.exists(checkpoint):
        import io

        state = torch.load(io.BytesIO(Path(checkpoint).read_bytes()), weights_only=True)
        model.load_state_dict(state["model"])
        start = int(state["step"])
    for step in range(start, total):
        x, y = _train_batch(step, rank)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p -= 0.05 * p.grad / world
        if rank == 0:
            import io

            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "step": step + 1}, buf)
            atomic_write_bytes(checkpoint, buf.getvalue())
        if pid_dir:
            atomic_write_text(Path(pid_dir, f"step.{rank}"), f"{step + 1} {os.environ['GROUP_RANK']}\n")
        time.sleep(pause)
    out = {"rank": rank, "node": int(os.environ["GROUP_RANK"]), "start": start,
           "weights": {k: v.tolist() for k, v in model.state_dict().items()}}
    if pid_dir and world > 2:
        out["pair_seconds"] = _pair_seconds(rank, world)
    return out


def _pair_seconds(rank: int, world: int) -> list[list[float]]:
    """[a, b, seconds] for every pair of ranks this rank is in: 1 MB there and back, the best of 3."""
    import torch
    import torch.distributed as dist

    buf, out = torch.ones(1 << 18), []
    for a in range(world):
        for b in range(a + 1, world):
            best = float("inf")
            for _ in range(3):
                dist.barrier()
                start = time.perf_counter()
                if rank == a:
                    dist.send(buf, b)
                    dist.recv(buf, b)
                elif rank == b:
                    dist.recv(buf, a)
                    dist.send(buf, a)
                best = min(best, time.perf_counter() - start)
            if rank in (a, b):
                out.append([a, b, best])
    return out


def fit_job(total: int) -> dict:
    """A model with about 1 MB of gradients trained by dlperf's Trainer across the processes; the first rank
    returns the run's own exchange report (the straggler it names)."""
    import torch

    from dlperf.devices import cpu
    from dlperf.parallel import Trainer
    from dlperf.parallel.communication.process_group import last_exchange_report

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1))
    with Trainer(model, [cpu(0)], "sgd", {"lr": 0.05}, loss=torch.nn.functional.mse_loss) as trainer:
        for step in range(total):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(24, 256, generator=g)
            trainer.train_step(x, x.sum(1, keepdim=True).sin())
    report = last_exchange_report()
    return {"rank": rank, "node": int(os.environ["GROUP_RANK"]),
            "weights": {k: v.tolist() for k, v in model.state_dict().items()},
            "exchanges": report.as_dict() if report is not None else None,
            "summary": report.describe() if report is not None else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("job", choices=["allreduce", "kill", "steps", "links", "train", "fit"])
    p.add_argument("--nnodes", type=int, default=2)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--victim-node", type=int, default=1)
    p.add_argument("--compute", action="store_true")
    p.add_argument("--roles", default=None, help="comma-separated role per global rank")
    p.add_argument("--pid-dir", default=None)
    p.add_argument("--fault-timeout", type=float, default=10.0)
    p.add_argument("--join-timeout", type=float, default=90.0)
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--total-steps", type=int, default=8)
    p.add_argument("--pause", type=float, default=0.0)
    a = p.parse_args(argv)

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from dlperf.parallel.launchers import LaunchError, ProcessLauncher

    launcher = ProcessLauncher(a.nproc_per_node, nnodes=a.nnodes, node_rank=a.node_rank,
                               master_addr=a.master_addr, master_port=a.master_port, join_timeout_s=a.join_timeout,
                               fault_timeout_s=a.fault_timeout, roles=a.roles.split(",") if a.roles else None)
    try:
        if a.job == "allreduce":
            results = launcher.launch(allreduce_job, a.pid_dir)
        elif a.job == "links":
            results = launcher.launch(links_job)
        elif a.job == "steps":
            results = launcher.launch(steps_job, a.pid_dir)
        elif a.job == "fit":
            results = launcher.launch(fit_job, a.total_steps)
        elif a.job == "train":
            results = launcher.launch(train_job, a.pid_dir, a.checkpoint, a.total_steps, a.pause)
        else:
            results = launcher.launch(kill_job, a.pid_dir, a.node_rank == a.victim_node, a.compute)
        out = {"ok": True, "results": results}
    except LaunchError as exc:
        out = {"ok": False, "error": str(exc), "rank": exc.rank, "role": exc.role, "host": exc.host,
               "cause": exc.cause}
    except KeyboardInterrupt:
        print(json.dumps({"ok": False, "interrupted": "SIGINT"}), flush=True)
        return 128 + signal.SIGINT
    except SignalException as exc:
        print(json.dumps({"ok": False, "interrupted": signal.Signals(exc.sigval).name}), flush=True)
        return 128 + exc.sigval
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

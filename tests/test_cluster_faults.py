"""Faults on links between emulated hosts: a link brought down mid-run, then back for a resume.

Each node is its own launcher (``tests/netns_node.py train``) in a network namespace; the job trains a
small model with its gradients summed over gloo, rank 0 saving a checkpoint after every step; the slow-link
test trains with dlperf's Trainer instead (``fit``), whose own summary names the straggler. Marked slow
and distributed; needs root, ``ip`` and ``tc`` (skipped with the reason otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support.netns import Hosts, unavailable_reason

NODE = Path(__file__).with_name("netns_node.py")
SRC = Path(__file__).parents[1] / "src"
FAULT_TIMEOUT_S = 8.0
TOTAL_STEPS = 12

_reason = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.distributed,
              pytest.mark.skipif(_reason is not None, reason=_reason or "")]


def _train(hosts: Hosts, port: int, tmp: Path, pause: float, pid_dir: Path) -> list[subprocess.Popen]:
    """One ``train`` node per host; rank 0 checkpoints to ``tmp/ck.pt``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    pid_dir.mkdir(exist_ok=True)
    return [hosts.popen(i, [sys.executable, str(NODE), "train", "--nnodes", str(hosts.n), "--node-rank", str(i),
                            "--master-addr", hosts.addresses[0], "--master-port", str(port),
                            "--fault-timeout", str(FAULT_TIMEOUT_S), "--checkpoint", str(tmp / "ck.pt"),
                            "--total-steps", str(TOTAL_STEPS), "--pause", str(pause), "--pid-dir", str(pid_dir)],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for i in range(hosts.n)]


def _last(proc: subprocess.Popen, timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    lines = out.strip().splitlines()
    assert lines, f"node exited with {proc.returncode} and printed nothing:\n{err[-3000:]}"
    return json.loads(lines[-1])


def _steps(pid_dir: Path) -> int:
    done = [int(p.read_text().split()[0]) for p in pid_dir.glob("step.*")]
    return min(done) if len(done) == 2 else 0


@pytest.mark.timeout(300)
def test_a_link_brought_down_stops_every_process_naming_the_host_and_the_checkpoint_resumes_exactly(tmp_path):
    reference_dir, faulted_dir = tmp_path / "reference", tmp_path / "faulted"
    reference_dir.mkdir()
    faulted_dir.mkdir()
    with Hosts(2, rate=1.25e8) as hosts:
        reference = [_last(p, 120) for p in _train(hosts, 29501, reference_dir, 0.0, reference_dir / "pids")]
        procs = _train(hosts, 29502, faulted_dir, 0.3, faulted_dir / "pids")
        deadline = time.monotonic() + 90
        while _steps(faulted_dir / "pids") < 3 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
            time.sleep(0.05)
        hosts.set_link(1, up=False)
        down = time.monotonic()
        outcomes = [_last(p, FAULT_TIMEOUT_S + 60) for p in procs]
        exited = time.monotonic() - down
        pids = [int(p) for f in (faulted_dir / "pids").glob("*.pids") for p in f.read_text().split()]
        hosts.set_link(1, up=True)
        saved_step = int(__import__("torch").load(faulted_dir / "ck.pt", weights_only=True)["step"])
        resumed = [_last(p, 120) for p in _train(hosts, 29503, faulted_dir, 0.0, faulted_dir / "pids2")]
    assert all(n["ok"] for n in reference), reference
    assert [o["ok"] for o in outcomes] == [False, False], outcomes
    # every process stopped within the fault timeout (+ 5 s to report), and each node names the lost host
    assert exited <= FAULT_TIMEOUT_S + 5, (exited, outcomes)
    assert hosts.addresses[1] in outcomes[0]["error"], outcomes[0]
    assert hosts.addresses[0] in outcomes[1]["error"] or hosts.addresses[1] in outcomes[1]["error"], outcomes[1]
    assert not [p for p in pids if os.path.exists(f"/proc/{p}") and
                Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"]
    # the resume starts at the last checkpoint and ends with the reference's weights, bit for bit
    assert 3 <= saved_step < TOTAL_STEPS
    assert all(n["ok"] for n in resumed), resumed
    assert {r["start"] for n in resumed for r in n["results"]} == {saved_step}
    want = reference[0]["results"][0]["weights"]
    assert all(r["weights"] == want for n in resumed for r in n["results"])


def _fit(hosts: Hosts, port: int) -> list[dict]:
    """Every node's results of ``fit``: dlperf's Trainer across the hosts, the first rank's with the run's own
    exchange report."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    procs = [hosts.popen(i, [sys.executable, str(NODE), "fit", "--nnodes", str(hosts.n), "--node-rank", str(i),
                             "--master-addr", hosts.addresses[0], "--master-port", str(port),
                             "--fault-timeout", str(FAULT_TIMEOUT_S), "--total-steps", str(TOTAL_STEPS)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(hosts.n)]
    nodes = [_last(p, 200) for p in procs]
    assert all(n["ok"] for n in nodes), nodes
    return [r for n in nodes for r in n["results"]]


@pytest.mark.timeout(300)
def test_a_host_on_a_link_ten_times_slower_trains_to_the_same_weights_and_the_run_names_it(tmp_path):
    runs = {}
    with Hosts(3) as hosts:
        for name, rates in (("unshaped", [None] * 3), ("slow host 2", [1.25e8, 1.25e8, 1.25e7])):
            for i, rate in enumerate(rates):
                hosts.set_rate(i, rate)
            runs[name] = _fit(hosts, 29510 + len(runs))
    weights = {name: [r["weights"] for r in results] for name, results in runs.items()}
    assert len(weights["slow host 2"]) == 3
    want = {k: torch.tensor(v) for k, v in weights["unshaped"][0].items()}
    for ws in weights.values():
        for w in ws:
            assert all(torch.allclose(torch.tensor(w[k]), want[k], rtol=1e-6, atol=1e-7) for k in want)
    # the run itself names host 2 (its address) as the straggler in its summary line, and no host unshaped
    (slow,) = [r for r in runs["slow host 2"] if r["summary"] is not None]
    assert slow["summary"].startswith("straggler: ") and f"({hosts.addresses[2]}), on a slow link" in slow["summary"]
    assert slow["exchanges"]["straggler"]["host"].endswith(f"({hosts.addresses[2]})"), slow["exchanges"]
    (even,) = [r for r in runs["unshaped"] if r["summary"] is not None]
    assert even["exchanges"]["straggler"] is None, even["summary"]
    assert all(r["summary"] is None for rs in runs.values() for r in rs if r["rank"] != 0)

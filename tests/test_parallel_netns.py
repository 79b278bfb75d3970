"""A launch over two "hosts" for real: network namespaces joined by a veth pair, one node in each.

Each node is its own launcher process (``tests/netns_node.py``) inside its namespace, with the
rendezvous store on host 0's address; gloo connects the workers over the veth link. Skipped where
namespaces cannot be made (not root, no ``ip`` command, no CAP_NET_ADMIN), with the reason.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlperf._shm import spin_barrier_supported
from dlperf.parallel.launchers.faults import session_members
from support.netns import Hosts, unavailable_reason

NODE = Path(__file__).with_name("netns_node.py")
SRC = Path(__file__).parents[1] / "src"
PORT = 29500  # the namespaces are fresh: nothing else listens in them
FAULT_TIMEOUT_S = 8.0

_reason = unavailable_reason()
pytestmark = [pytest.mark.distributed, pytest.mark.skipif(_reason is not None, reason=_reason or "")]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _sessions_after_exit(procs: list[subprocess.Popen], grace_s: float = 5.0) -> list[list[int]]:
    """What is still alive in each node's session once the nodes have exited; a process that is
    exiting (multiprocessing's resource tracker goes when its launcher's pipe closes) gets ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while True:
        left = [session_members(p.pid) for p in procs]
        if not any(left) or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _start_nodes(hosts: Hosts, job: str, *extra: str, env: dict | None = None) -> list[subprocess.Popen]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
               **(env or {}))
    return [hosts.popen(i, [sys.executable, str(NODE), job, "--nnodes", str(hosts.n), "--node-rank", str(i),
                            "--master-addr", hosts.addresses[0], "--master-port", str(PORT),
                            "--fault-timeout", str(FAULT_TIMEOUT_S), *extra],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for i in range(hosts.n)]


def _outcome(proc: subprocess.Popen, timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    lines = out.strip().splitlines()
    assert proc.returncode == 0 and lines, f"node exited with {proc.returncode}:\n{err[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.timeout(120)
def test_workers_in_two_namespaces_rendezvous_and_allreduce_to_the_sum():
    with Hosts(2) as hosts:
        nodes = [_outcome(p, 100) for p in _start_nodes(hosts, "allreduce", "--roles", "worker,server")]
    assert all(n["ok"] for n in nodes), nodes
    results = [r for n in nodes for r in n["results"]]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["world"] == 2 for r in results)
    # (1 + 2) * [1, 2, 3, 4]: each rank contributed (rank + 1) * [1, 2, 3, 4]
    assert [r["sum"] for r in results] == [[3.0, 6.0, 9.0, 12.0]] * 2
    assert {r["rank"]: r["role"] for r in results} == {0: "worker", 1: "server"}
    # each node's worker reached the other over its own veth end, not loopback
    assert [n["results"][0]["host"].endswith(f"({a})") for n, a in zip(nodes, hosts.addresses)] == [True, True]
    assert [n["results"][0]["ifname"] for n in nodes] == hosts.interfaces


@pytest.mark.timeout(120)
def test_a_rank_killed_on_one_host_stops_every_process_on_both_and_both_name_it(tmp_path):
    with Hosts(2) as hosts:
        procs = _start_nodes(hosts, "kill", "--compute", "--victim-node", "1", "--roles", "worker,server",
                             "--pid-dir", str(tmp_path))
        nodes = [_outcome(p, 100) for p in procs]
        all_gone = time.time()
        when, victim = (tmp_path / "killed_at").read_text().split()
    victim = int(victim)
    expected = {"ok": False, "rank": victim, "role": ["worker", "server"][victim],
                "host": nodes[1]["host"], "cause": "killed by SIGKILL (exit code -9)"}
    assert nodes[1]["host"].endswith(f"({hosts.addresses[1]})")
    for node in nodes:
        assert {k: node[k] for k in expected} == expected
        assert node["error"] == f"rank {victim} failed: killed by SIGKILL (exit code -9) " \
                                f"(role {expected['role']}, host {expected['host']})"
    # the other host's worker computed outside any collective: only the fault board could stop it
    assert all_gone - float(when) < FAULT_TIMEOUT_S + 5
    pids = [int(p) for f in tmp_path.glob("*.pids") for p in f.read_text().split()]
    assert len(pids) == 4
    assert [p for p in pids if _alive(p)] == []


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_host_whose_launcher_dies_is_reported_lost_by_the_other(tmp_path):
    with Hosts(2) as hosts:
        procs = _start_nodes(hosts, "kill", "--compute", "--victim-node", "-1", "--pid-dir", str(tmp_path))
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("*.pids"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # both nodes beat at least once
        procs[1].kill()
        killed = time.monotonic()
        node0 = _outcome(procs[0], 100)
        took = time.monotonic() - killed
    assert not node0["ok"]
    assert "node 1" in node0["cause"] and "stopped answering" in node0["cause"], node0
    assert node0["host"].endswith(f"({hosts.addresses[1]})")
    assert took < 2 * FAULT_TIMEOUT_S + 5  # noticed within one timeout, the reports awaited within another
    pids = [int(p) for f in tmp_path.glob("*.pids") for p in f.read_text().split()]
    assert [p for p in pids[::2] if _alive(p)] == []  # both workers; node 1's died with its launcher


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_three_namespaces_on_a_bridge_allreduce_to_the_sum():
    with Hosts(3) as hosts:
        nodes = [_outcome(p, 120) for p in _start_nodes(hosts, "allreduce")]
    assert all(n["ok"] for n in nodes), nodes
    results = sorted((r for n in nodes for r in n["results"]), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert [r["sum"] for r in results] == [[6.0, 12.0, 18.0, 24.0]] * 3


@pytest.mark.skipif(not spin_barrier_supported(), reason="shared-memory allreduce needs Linux memfd and x86-64")
@pytest.mark.timeout(240)
def test_two_hosts_of_two_processes_choose_between_hierarchical_and_gloo_and_sum_exactly(tmp_path):
    with Hosts(2) as hosts:
        procs = _start_nodes(hosts, "links", "--nproc-per-node", "2", env={"XDG_CACHE_HOME": str(tmp_path)})
        nodes = [_outcome(p, 200) for p in procs]
        leftovers = _sessions_after_exit(procs)
    assert all(n["ok"] for n in nodes), nodes
    results = sorted((r for n in nodes for r in n["results"]), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    # shared memory inside each host, gloo between them: not one segment across what are two hosts
    assert [r["kind"] for r in results] == ["hierarchical"] * 4
    assert all(r["fits"] == ["gloo", "hierarchical"] for r in results)
    assert all(r["exact"] == [True, True, True] for r in results), results
    assert len({json.dumps([r["picks"], r["describe"]]) for r in results}) == 1  # every rank chose alike
    lines = results[0]["describe"]
    assert lines[0].startswith("process allreduce: hierarchical: ") and "; gloo: " in lines[0], lines
    assert lines[1].startswith("process allreduce: measured now")
    saved = list((tmp_path / "dlperf" / "probe").glob("links-*.json"))
    assert len(saved) == 1  # recorded once, by rank 0, for this layout of two hosts
    doc = json.loads(saved[0].read_text())
    assert set(doc["links"]) == {"hierarchical", "gloo"}
    assert doc["hosts"] == [r["host"] for r in results] and len(set(doc["hosts"])) == 2
    assert leftovers == [[], []]
    assert not any(name in _namespaces() for name in hosts.names)


_SERVE = ("import socket, sys\n"
          "s = socket.create_server((sys.argv[1], 4000))\n"
          "print('ready', flush=True)\n"
          "c, peer = s.accept(); c.sendall(peer[0].encode()); c.close()\n")
_ASK = ("import socket, sys\n"
        "print(socket.create_connection((sys.argv[1], 4000), timeout=5).recv(100).decode())\n")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


@pytest.mark.timeout(60)
def test_hosts_reach_each_other_by_address_and_leave_no_namespace_behind():
    with Hosts(2) as hosts:
        names = list(hosts.names)
        assert all(n in _namespaces() for n in names)
        server = hosts.popen(1, [sys.executable, "-c", _SERVE, hosts.addresses[1]], stdout=subprocess.PIPE,
                             text=True)
        assert server.stdout.readline().strip() == "ready"
        asked = hosts.run(0, [sys.executable, "-c", _ASK, hosts.addresses[1]], timeout=30)
        server.wait(10)
        server.stdout.close()
        assert asked.stdout.strip() == hosts.addresses[0]  # the server saw host 0's own address
    assert not any(n in _namespaces() for n in names)


@pytest.mark.timeout(60)
def test_hosts_are_torn_down_when_the_block_fails_and_their_processes_killed():
    with pytest.raises(RuntimeError, match="the block fails"):
        with Hosts(2) as hosts:
            names = list(hosts.names)
            sleeper = hosts.popen(0, [sys.executable, "-c", "import time; time.sleep(300)"])
            raise RuntimeError("the block fails")
    assert sleeper.poll() is not None
    assert not any(n in _namespaces() for n in names)


def _steps(pid_dir: Path) -> dict[int, tuple[int, int]]:
    """rank -> (steps saved, its node) from the ``steps`` job's files."""
    out = {}
    for path in pid_dir.glob("step.*"):
        step, node = path.read_text().split()
        out[int(path.name.split(".")[1])] = (int(step), int(node))
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("victim, signum, to_group", [(1, signal.SIGINT, True), (0, signal.SIGTERM, False)],
                         ids=["ctrl-c-on-node-1", "sigterm-to-node-0-which-hosts-the-store"])
def test_an_interrupted_node_is_named_by_the_other_at_once_and_keeps_its_work(tmp_path, victim, signum, to_group):
    fault_timeout_s = 30.0  # the others must not wait for it: they hear of the interrupt from the board
    with Hosts(2) as hosts:
        procs = _start_nodes(hosts, "steps", "--roles", "worker,server", "--pid-dir", str(tmp_path),
                             "--fault-timeout", str(fault_timeout_s))
        deadline = time.monotonic() + 90
        while len(_steps(tmp_path)) < 2 and all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_steps(tmp_path)) == 2, [p.communicate(timeout=30)[1][-3000:] for p in procs]
        # Ctrl-C in a terminal signals the launcher's process group; the workers lead groups of their own
        os.killpg(procs[victim].pid, signum) if to_group else os.kill(procs[victim].pid, signum)
        signalled = time.monotonic()
        out, err = procs[1 - victim].communicate(timeout=60)
        other_took = time.monotonic() - signalled
        victim_out, victim_err = procs[victim].communicate(timeout=60)
        leftovers = _sessions_after_exit(procs)
    assert procs[victim].returncode == 128 + signum, victim_err[-3000:]
    assert json.loads(victim_out.strip().splitlines()[-1]) == {"ok": False, "interrupted": signum.name}
    assert procs[1 - victim].returncode == 0, err[-3000:]
    other = json.loads(out.strip().splitlines()[-1])
    steps = _steps(tmp_path)
    (rank,) = [r for r, (_, node) in steps.items() if node == victim]
    role = ["worker", "server"][rank]
    assert other["rank"] == rank and other["role"] == role and other["host"].endswith(f"({hosts.addresses[victim]})")
    assert other["error"] == (f"rank {rank} failed: interrupted by {signum.name} to the launcher of node {victim} "
                              f"(ranks [{rank}]) (role {role}, host {other['host']})")
    assert other_took < fault_timeout_s / 3, other_took
    assert steps[rank][0] >= 1  # the interrupted rank's saved steps are still there, whole
    assert leftovers == [[], []]  # every worker, and every process a worker started, is gone
    assert [int(p) for f in tmp_path.glob("*.pids") for p in f.read_text().split() if _alive(int(p))] == []
    assert not any(name in _namespaces() for name in hosts.names)

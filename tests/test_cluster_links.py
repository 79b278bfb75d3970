"""Emulated hosts with shaped links (tests/support/netns.py): the rate holds, and nothing outlives the block.

Needs root, ``ip`` and ``tc`` (iproute2); skipped with the reason otherwise.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import support.netns as netns
from support.netns import Hosts, NamespaceError, unavailable_reason

_reason = unavailable_reason()
pytestmark = [pytest.mark.distributed, pytest.mark.skipif(_reason is not None, reason=_reason or "")]

_RECEIVE = ("import socket, sys, time\n"
            "s = socket.create_server((sys.argv[1], 4001))\n"
            "print('ready', flush=True)\n"
            "c, _ = s.accept(); got = 0; start = None; buf = bytearray(1 << 16)\n"
            "while True:\n"
            "    n = c.recv_into(buf)\n"
            "    if not n: break\n"
            "    start = start or time.perf_counter(); got += n\n"
            "print(got / (time.perf_counter() - start), flush=True)\n")
_SEND = ("import socket, sys\n"
         "c = socket.create_connection((sys.argv[1], 4001), timeout=20)\n"
         "c.sendall(b'x' * int(sys.argv[2])); c.close()\n")


def _rate(hosts: Hosts, src: int, dst: int, nbytes: int) -> float:
    """Bytes/s from host ``src`` to host ``dst`` over one TCP connection."""
    server = hosts.popen(dst, [sys.executable, "-c", _RECEIVE, hosts.addresses[dst]], stdout=subprocess.PIPE,
                         text=True)
    assert server.stdout.readline().strip() == "ready"
    hosts.run(src, [sys.executable, "-c", _SEND, hosts.addresses[dst], str(nbytes)], timeout=60)
    out, _ = server.communicate(timeout=60)
    return float(out.strip())


def _leftovers(names: list[str]) -> list[str]:
    """Namespaces, links or qdiscs of ``names`` still on the machine."""
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, check=True).stdout
    left = [n for n in names if n in spaces]
    # every veth end lives in a namespace: none may appear in the machine's own
    left += [line for line in links.splitlines() if "dlperf" in line or "@eth" in line.split(":")[1]]
    left += [line for line in qdiscs.splitlines() if " tbf " in line or " htb " in line]
    return left


@pytest.mark.timeout(120)
@pytest.mark.parametrize("qdisc", ["tbf", "htb"])
def test_a_shaped_link_carries_its_rate_both_ways(qdisc):
    rate = 12.5e6  # 100 Mbit/s: quick to measure, far below what the veth does unshaped
    with Hosts(2, rate=rate, qdisc=qdisc) as hosts:
        assert [line.split()[2] for line in hosts.qdiscs()] == [qdisc, qdisc]
        forth, back = _rate(hosts, 0, 1, 3_000_000), _rate(hosts, 1, 0, 3_000_000)
        hosts.set_rate(0, None)
        unshaped = _rate(hosts, 0, 1, 3_000_000)
        assert [line.split()[2] for line in hosts.qdiscs()] != [qdisc, qdisc]
    for measured in (forth, back):
        assert 0.7 * rate < measured < 1.15 * rate, (measured, rate)
    assert unshaped > 2 * rate


@pytest.mark.timeout(120)
def test_three_hosts_on_a_switch_each_get_their_own_rate():
    with Hosts(3, rates=[25e6, 25e6, 6.25e6]) as hosts:
        # the shaping is on both ends of every host's link: its own and the switch's port
        assert [line.split()[2] for line in hosts.qdiscs()] == ["tbf"] * 6
        fast = _rate(hosts, 0, 1, 3_000_000)
        slow_in = _rate(hosts, 0, 2, 2_000_000)
        slow_out = _rate(hosts, 2, 1, 2_000_000)
    assert 0.7 * 25e6 < fast < 1.15 * 25e6, fast
    for measured in (slow_in, slow_out):
        assert 0.7 * 6.25e6 < measured < 1.15 * 6.25e6, measured


@pytest.mark.timeout(60)
def test_a_link_brought_down_carries_nothing_until_it_is_up_again():
    with Hosts(2, rate=12.5e6) as hosts:
        hosts.set_link(1, up=False)
        ask = [sys.executable, "-c", "import socket, sys; socket.create_connection((sys.argv[1], 9), timeout=2)",
               hosts.addresses[1]]
        down = hosts.run(0, ask, timeout=30)
        assert down.returncode != 0
        hosts.set_link(1, up=True)
        time.sleep(0.2)
        assert _rate(hosts, 0, 1, 200_000) > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 4])
def test_an_error_inside_the_block_leaves_no_namespace_link_or_qdisc(n):
    with pytest.raises(RuntimeError, match="inside"):
        with Hosts(n, rate=1.25e8, qdisc="htb") as hosts:
            names = [*hosts.names, hosts._switch]
            assert len(hosts.qdiscs()) == (2 if n == 2 else 2 * n)
            sleeper = hosts.popen(0, [sys.executable, "-c", "import time; time.sleep(300)"])
            raise RuntimeError("an error inside")
    assert sleeper.poll() is not None
    assert _leftovers(names) == []


@pytest.mark.timeout(60)
def test_a_failure_while_shaping_tears_down_what_was_built(monkeypatch):
    made: list[str] = []
    real_add = Hosts._add_namespace

    def record(self, name):
        made.append(name)
        return real_add(self, name)

    monkeypatch.setattr(Hosts, "_add_namespace", record)
    monkeypatch.setattr(netns, "_shaping", lambda qdisc, interface, rate: [["qdisc", "add", "dev", interface,
                                                                           "root", "nonesuch"]])
    with pytest.raises(NamespaceError, match="nonesuch"):
        with Hosts(3, rate=1.25e8):
            pass  # pragma: no cover (the build fails first)
    assert len(made) == 4
    assert _leftovers(made) == []


def test_bad_rates_are_refused_before_anything_is_made():
    with pytest.raises(ValueError, match="bytes per second"):
        Hosts(2, rate=0)
    with pytest.raises(ValueError, match="one rate per host"):
        Hosts(3, rates=[1e6, 1e6])
    with pytest.raises(ValueError, match="qdisc"):
        Hosts(2, rate=1e6, qdisc="netem")


_NODE = ("import argparse, json, socket\n"
         "ap = argparse.ArgumentParser(); ap.add_argument('--say'); ap.add_argument('--node-rank', type=int)\n"
         "ap.add_argument('--master-addr'); ap.add_argument('--master-port', type=int); a = ap.parse_args()\n"
         "if a.node_rank == 1 and a.say == 'fail': raise SystemExit('node 1 gave up')\n"
         "socket.sethostname(f'node{a.node_rank}')\n"
         "print('noise'); print(json.dumps({**vars(a), 'host': socket.gethostname()}))\n")


@pytest.mark.timeout(60)
def test_nodes_start_in_every_host_with_their_rank_the_master_and_a_host_name_of_their_own(tmp_path):
    script = tmp_path / "node.py"
    script.write_text(_NODE)
    with Hosts(2) as hosts:
        got = [netns.node_result(p, 30) for p in hosts.start_nodes(str(script), ["--say", "hi"], 29511)]
        assert got == [{"say": "hi", "node_rank": i, "master_addr": hosts.addresses[0], "master_port": 29511,
                        "host": f"node{i}"} for i in range(2)]
        quiet = hosts.start_nodes(str(script), ["--say", "fail"], 29511)
        assert netns.node_result(quiet[0], 30)["node_rank"] == 0
        with pytest.raises(NamespaceError, match="printed nothing .exit 1.:\n.*node 1 gave up"):
            netns.node_result(quiet[1], 30)


@pytest.mark.timeout(60)
def test_hosts_with_cores_of_their_own_run_everything_on_their_share():
    import os

    mine = sorted(os.sched_getaffinity(0))
    affinity = "import os; print(sorted(os.sched_getaffinity(0)))"
    with Hosts(2, own_cores=True) as hosts:
        assert sorted(c for share in hosts.cores for c in share) == mine or len(mine) < 2
        for i in range(2):
            got = hosts.run(i, [sys.executable, "-c", affinity], timeout=30).stdout.strip()
            assert got == str(hosts.cores[i])
        if len(mine) >= 2:  # disjoint shares: one host's ranks never run on another's cores
            assert not set(hosts.cores[0]) & set(hosts.cores[1])
    with Hosts(2) as shared:  # without it, every host may use every core
        assert shared.cores is None
        assert shared.run(0, [sys.executable, "-c", affinity], timeout=30).stdout.strip() == str(mine)

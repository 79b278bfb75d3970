"""Several "hosts" on one machine: Linux network namespaces joined by virtual Ethernet.

A launch over several nodes is only tested for real when its nodes have different addresses and
reach each other over an interface that is not loopback. :class:`Hosts` makes ``n`` network
namespaces, each with its loopback up and one address ``10.<a>.<b>.<i+1>/24``; two are joined by one
veth pair, more by veth pairs to a bridge in a further namespace (nothing is added to the machine's
own namespace). It runs commands inside them (``ip netns exec``), and tears everything down (the
processes it started, then the namespaces, whose interfaces go with them) when the block ends, also
on errors and Ctrl-C. Namespaces left by a killed earlier run (their creator's pid is in the name)
are removed on the next start.

Shaped links: ``Hosts(n, rate=1.25e9)`` (bytes per second, or ``rates=[...]`` one per host) limits every
host's link to that rate in both directions, as a NIC of that speed would: a ``tbf`` (or ``htb``) queueing
discipline on the host's own end of its veth (what it sends) and on the far end (what it receives: the
peer's end for two hosts, the switch's port for more). The qdiscs live on interfaces inside the
namespaces, so they go with them at teardown. :meth:`Hosts.set_rate` changes one host's rate and
:meth:`Hosts.set_link` brings its link down or up while processes run. Latency is not emulated: the
kernel here has no ``netem``, and a tbf queue delays a packet only while the bucket is empty, which
is queueing, not propagation; a link's latency is whatever the veth and the stack give (tens of us).
Two hosts share their one veth pair, so a rate given for either shapes it both ways.

Cores: real hosts do not share processors, but these share the machine's. ``own_cores=True`` gives each
host a share of the cores this process may use (:attr:`Hosts.cores`: contiguous, as even as the count
allows; with fewer cores than hosts, hosts take turns) and runs everything started in it on that share
only (``taskset``), so one host's busy ranks never run on another's cores, and a cost model can take
each host's core count as :attr:`Hosts.cores` says.

Needs Linux, root (CAP_NET_ADMIN) and the ``ip`` command (Debian/Ubuntu: ``apt-get install iproute2``);
:func:`unavailable_reason` says what is missing.

>>> reason = unavailable_reason()
>>> reason is None or isinstance(reason, str)
True
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from dlperf.errors import DlperfError
from dlperf.parallel.launchers.faults import session_members

__all__ = ["Hosts", "NamespaceError", "node_result", "unavailable_reason"]

_PREFIX = "dlperf"  # namespace names: dlperf<pid>h<i>, dlperf<pid>sw for the switch
_NAME = re.compile(rf"^{_PREFIX}(\d+)(h\d+|sw)$")


class NamespaceError(DlperfError, RuntimeError):
    """A namespace, link or address could not be made; the message has the command and its error."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise NamespaceError(f"'ip {' '.join(args)}' failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


_reason_cache: list[str | None] = []


def nodes_unavailable_reason() -> str | None:
    """Why :meth:`Hosts.start_nodes` cannot run here (namespaces, or the ``unshare`` command that gives each
    node a host name of its own), one line with the fix, or None."""
    import shutil

    reason = unavailable_reason()
    if reason is None and shutil.which("unshare") is None:
        reason = "the 'unshare' command is missing (each host needs a host name of its own); install util-linux"
    return reason


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (one line, with the fix), or None when they can."""
    if _reason_cache:
        return _reason_cache[0]
    reason = None
    if not os.path.exists("/proc/self/ns/net"):
        reason = "network namespaces need Linux"
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        reason = "the 'ip' or 'tc' command is missing; install iproute2 (apt-get install iproute2)"
    elif os.geteuid() != 0:
        reason = "making network namespaces needs root (CAP_NET_ADMIN); run as root"
    else:
        name = f"{_PREFIX}{os.getpid()}probe"
        proc = _ip("netns", "add", name, check=False)
        if proc.returncode != 0:
            reason = (f"cannot make a network namespace ({proc.stderr.strip() or 'ip netns add failed'}); "
                      "needs CAP_NET_ADMIN and CAP_SYS_ADMIN (a privileged container)")
        else:
            probe = _ip("-n", name, "link", "add", "vp0", "type", "veth", "peer", "name", "vp1", check=False)
            if probe.returncode != 0:
                reason = f"cannot make veth links ({probe.stderr.strip()}); the kernel needs the veth module"
            _ip("netns", "del", name, check=False)
    _reason_cache.append(reason)
    return reason


def _remove_stale() -> None:
    """Delete namespaces made by runs whose process is gone (killed before their teardown ran)."""
    proc = _ip("netns", "list", check=False)
    for line in proc.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not os.path.exists(f"/proc/{m[1]}"):
            _ip("netns", "del", name, check=False)


class Hosts:
    """``n`` network namespaces that reach each other at ``addresses[i]``; a context manager.

    For example, a node of a two-node launch in each (``hosts.addresses[0]`` is the master address)::

        with Hosts(2) as hosts:
            nodes = [hosts.popen(i, [sys.executable, "train.py", "--node-rank", str(i),
                                     "--master-addr", hosts.addresses[0]]) for i in range(2)]
            codes = [node.wait() for node in nodes]
    """

    def __init__(self, n: int = 2, subnet: str = "10.77.0", *, rate: float | None = None,
                 rates: Sequence[float | None] | None = None, qdisc: str = "tbf", own_cores: bool = False) -> None:
        if not isinstance(n, int) or n < 2:
            raise ValueError(f"n={n!r}: expected at least 2 hosts")
        if rates is not None and (rate is not None or len(rates) != n):
            raise ValueError(f"rates={rates!r}: give one rate per host ({n}), or rate= for all of them")
        self.rates = list(rates) if rates is not None else [rate] * n
        for r in self.rates:
            _check_rate(r)
        if qdisc not in _QDISCS:
            raise ValueError(f"qdisc={qdisc!r}: expected one of {', '.join(_QDISCS)}")
        self.qdisc = qdisc
        if not re.fullmatch(r"10\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"subnet={subnet!r}: expected the first three numbers of a 10.x.y.0/24 network")
        self.n = n
        self.subnet = subnet
        tag = f"{_PREFIX}{os.getpid()}"
        self.names = [f"{tag}h{i}" for i in range(n)]
        self.addresses = [f"{subnet}.{i + 1}" for i in range(n)]
        self.interfaces = [f"eth{i}" for i in range(n)]  # inside host i; names are per namespace
        self._switch = f"{tag}sw"
        self.cores = _share_cores(sorted(os.sched_getaffinity(0)), n) if own_cores else None
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> Hosts:
        reason = unavailable_reason()
        if reason is None and self.cores is not None and shutil.which("taskset") is None:
            reason = "the 'taskset' command is missing (hosts with cores of their own); install util-linux"
        if reason is not None:
            raise NamespaceError(reason)
        _remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        for name in self.names:
            self._add_namespace(name)
        if self.n == 2:
            _ip("-n", self.names[0], "link", "add", self.interfaces[0], "type", "veth", "peer", "name",
                self.interfaces[1], "netns", self.names[1])
        else:
            self._add_namespace(self._switch)
            _ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self._switch, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                port = f"p{i}"
                _ip("-n", self._switch, "link", "add", port, "type", "veth", "peer", "name", self.interfaces[i],
                    "netns", name)
                _ip("-n", self._switch, "link", "set", port, "master", "br0")
                _ip("-n", self._switch, "link", "set", port, "up")
        for name, interface, address in zip(self.names, self.interfaces, self.addresses):
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", name, "link", "set", interface, "up")
        for i, r in enumerate(self.rates):
            if r is not None:
                self.set_rate(i, r)

    def _ends(self, i: int) -> list[tuple[str, str]]:
        """(namespace, interface) of both ends of host ``i``'s link: what it sends, then what it receives."""
        far = (self.names[1 - i], self.interfaces[1 - i]) if self.n == 2 else (self._switch, f"p{i}")
        return [(self.names[i], self.interfaces[i]), far]

    def set_rate(self, i: int, rate: float | None) -> None:
        """Shape host ``i``'s link to ``rate`` bytes/s each way (None: unshaped), replacing any earlier shaping."""
        _check_rate(rate)
        for namespace, interface in self._ends(i):
            _tc(namespace, "qdisc", "del", "dev", interface, "root", check=False)
            if rate is not None:
                for command in _shaping(self.qdisc, interface, rate):
                    _tc(namespace, *command)
        self.rates[i] = rate

    def qdiscs(self) -> list[str]:
        """Every root qdisc on the hosts' links, one ``namespace interface kind`` line each (for checks)."""
        out = []
        for i in range(self.n):
            for namespace, interface in self._ends(i) if self.n > 2 else self._ends(i)[:1]:
                shown = _tc(namespace, "qdisc", "show", "dev", interface, "root").stdout.split()
                out.append(f"{namespace} {interface} {shown[1] if len(shown) > 1 else '-'}")
        return out

    def set_link(self, i: int, up: bool) -> None:
        """Bring host ``i``'s interface down (``ip link set ... down``: nothing passes either way) or up again."""
        _ip("-n", self.names[i], "link", "set", self.interfaces[i], "up" if up else "down")

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` as it runs inside host ``i`` (on its cores only, with ``own_cores``)."""
        pin = ["taskset", "-c", ",".join(map(str, self.cores[i]))] if self.cores is not None else []
        return ["ip", "netns", "exec", self.names[i], *pin, *argv]

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside host ``i`` in a session of its own; it is killed at teardown if still running."""
        proc = subprocess.Popen(self.command(i, argv), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def start_nodes(self, script: str, args: Sequence[str], port: int, *, env: dict[str, str] | None = None,
                    own_host_name: bool = True) -> list[subprocess.Popen]:
        """``script`` in every host as one node of a launch across them: ``args`` then ``--node-rank i
        --master-addr <host 0's address> --master-port port``, stdout and stderr captured as text.

        ``own_host_name`` runs each node in a UTS namespace of its own (``unshare --uts``, which execs it:
        same pid), where it may give itself a host name, as a real host has one (dlperf tells hosts apart
        by it: ranks with one host name share memory).
        """
        prefix = ["unshare", "--uts"] if own_host_name else []
        return [self.popen(i, [*prefix, sys.executable, script, *args, "--node-rank", str(i), "--master-addr",
                               self.addresses[0], "--master-port", str(port)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ, **env) if env else None)
                for i in range(self.n)]

    def run(self, i: int, argv: Sequence[str], timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``i`` to its end (killed after ``timeout`` seconds), capturing text output."""
        proc = self.popen(i, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            out, err = proc.communicate()
            raise NamespaceError(f"{' '.join(argv)!r} in host {i} ran past {timeout:g} s; it was killed\n"
                                 f"{err[-2000:]}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def close(self) -> None:
        """Kill what was started inside, then delete the namespaces (their links go with them)."""
        for proc in self._procs:
            _kill_session(proc)
        self._procs.clear()
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()


def node_result(proc: subprocess.Popen, timeout: float) -> dict:
    """The JSON object a node started by :meth:`Hosts.start_nodes` printed as its last stdout line.

    A node that printed nothing raises :class:`NamespaceError` with its exit status and its stderr's tail.
    """
    import json

    out, err = proc.communicate(timeout=timeout)
    lines = out.strip().splitlines()
    if not lines:
        raise NamespaceError(f"a host's node printed nothing (exit {proc.returncode}):\n{err[-3000:]}")
    return json.loads(lines[-1])


_QDISCS = ("tbf", "htb")
_MIN_RATE = 1e5  # bytes/s: below this tbf's burst arithmetic gets coarse, and no test needs it
_MAX_RATE = 1e11
_TIMER_HZ = 1000  # a token bucket must hold a timer tick's worth of bytes (hrtimers: 1 ms is ample)


def _share_cores(cores: list[int], n: int) -> list[list[int]]:
    """``cores`` dealt to ``n`` hosts in contiguous runs, the first hosts taking one more where they do not
    divide; with fewer cores than hosts, host i gets core i modulo their count.

    >>> _share_cores([0, 1, 2, 3, 4], 2), _share_cores([0, 1], 3)
    ([[0, 1, 2], [3, 4]], [[0], [1], [0]])
    """
    if len(cores) < n:
        return [[cores[i % len(cores)]] for i in range(n)]
    base, extra = divmod(len(cores), n)
    out, start = [], 0
    for i in range(n):
        size = base + (i < extra)
        out.append(cores[start:start + size])
        start += size
    return out


def _check_rate(rate: float | None) -> None:
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                             or not _MIN_RATE <= rate <= _MAX_RATE):
        raise ValueError(f"rate={rate!r}: expected None or bytes per second from {_MIN_RATE:g} to {_MAX_RATE:g}")


def _tc(namespace: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["tc", "-n", namespace, *args], capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise NamespaceError(f"'tc -n {namespace} {' '.join(args)}' failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def _shaping(qdisc: str, interface: str, rate: float) -> list[list[str]]:
    """tc commands that limit ``interface``'s sending to ``rate`` bytes/s."""
    bits = f"{int(rate * 8)}bit"
    # a bucket smaller than one timer tick's bytes cannot reach the rate; veth hands over 64 KB GSO packets
    burst = str(max(int(rate / _TIMER_HZ), 64 * 1024))
    if qdisc == "tbf":
        return [["qdisc", "add", "dev", interface, "root", "tbf", "rate", bits, "burst", burst, "latency", "100ms"]]
    return [["qdisc", "add", "dev", interface, "root", "handle", "1:", "htb", "default", "10", "r2q", "1000"],
            ["class", "add", "dev", interface, "parent", "1:", "classid", "1:10", "htb", "rate", bits, "ceil", bits,
             "burst", burst, "cburst", burst]]


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s whole session (it was started as a session leader) and reap it.

    The session, not the process group: launched workers lead process groups of their own.
    """
    for pid in [proc.pid, *session_members(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass

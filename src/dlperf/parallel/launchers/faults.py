"""What a process launch does when a rank is lost: name it, stop everyone else, leave nothing behind.

On one node PyTorch's elastic agent notices a dead worker within its monitor interval and stops the
others. Across nodes no agent learns of the other nodes' failures: their workers fail only when a
collective touches the lost rank, and hang (pytorch/pytorch#46874) when none does. So each node's
launcher keeps a :class:`FaultBoard` on the rendezvous store it already shares with the others:

* ``beat/<node>``: a counter the node's watchdog raises every beat; a counter that stops for
  ``fault_timeout_s`` means the node (its launcher) was killed or lost the network;
* ``final/<node>``: the node's failures, written once when its agent gives up, or the moment its launcher
  is interrupted (Ctrl-C, SIGTERM): any node that sees one stops its own workers at once;
* ``seen/<node>``: the node has read every other node's failures; node 0, whose agent hosts the store,
  waits for these before it leaves, so the others can still read its own.

Every node then picks the same cause from the same records (:func:`first_cause`): a rank that died
without a Python error of its own (a signal, ``os._exit``, a lost node) before one that raised, since
its peers' errors are only echoes of its death; among equals, the earliest.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..._io import decode_json, proc_stat

__all__ = ["FailureRecord", "FaultBoard", "first_cause", "host_label", "interface_with_address",
           "kill_process_groups", "local_address", "session_members", "set_parent_death_signal", "shut_connections_to"]

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_RETRY_S = 0.5  # after a failed call, the store is not tried again for this long


@dataclass(frozen=True)
class FailureRecord:
    """One failed rank as its node saw it (or one lost node, ``rank`` = its lowest rank or None)."""

    rank: int | None
    role: str
    host: str
    cause: str
    when: float
    reported: bool  # the rank raised a Python exception itself (else: signal, exit, lost node)

    def message(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "a node"
        return f"{who} failed: {self.cause} (role {self.role}, host {self.host})"

    @classmethod
    def from_dict(cls, d: Any) -> FailureRecord | None:
        """The record in ``d`` from another node, or None when it is not one (never trust its shape)."""
        if not isinstance(d, dict):
            return None
        try:
            rank = d.get("rank")
            return cls(None if rank is None else int(rank), str(d["role"]), str(d["host"]), str(d["cause"]),
                       float(d["when"]), bool(d["reported"]))
        except (KeyError, TypeError, ValueError):
            return None


def first_cause(records: list[FailureRecord]) -> FailureRecord | None:
    """The record every node agrees is the cause: unreported deaths first, then the earliest."""
    return min(records, key=lambda r: (r.reported, r.when, -1 if r.rank is None else r.rank), default=None)


def local_address(peer: str) -> str | None:
    """The address this machine uses to reach ``peer`` (from the routing table; nothing is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def host_label(peer: str) -> str:
    """This host as the others know it: its name, and its address towards ``peer`` unless that is loopback.

    Network namespaces on one machine share the name; the address tells them apart.
    """
    name = socket.gethostname()
    address = local_address(peer)
    return name if address is None or address.startswith("127.") else f"{name} ({address})"


def interface_with_address(address: str) -> str | None:
    """The network interface that carries IPv4 ``address`` (Linux), for ``GLOO_SOCKET_IFNAME``."""
    try:
        import fcntl
    except ImportError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def _group_and_session(pid: str) -> tuple[int, int] | None:
    """(process group, session) of ``pid`` from /proc, or None when it is gone or a zombie."""
    fields = proc_stat(pid)
    if fields is None or len(fields) < 4 or fields[0] in ("Z", "X"):
        return None
    return int(fields[2]), int(fields[3])


def _connections_to(addr: str, port: int) -> dict[int, str]:
    """This process's file descriptors of TCP connections to ``addr:port`` (Linux /proc), by fd."""
    try:
        v4 = f"{struct.unpack('<I', socket.inet_aton(addr))[0]:08X}"
        # torch's store connects over IPv6 sockets where it can: the address is then IPv4-mapped
        wanted = {f"{v4}:{port:04X}", f"0000000000000000FFFF0000{v4}:{port:04X}"}
        rows = [r.split() for table in ("tcp", "tcp6") if Path(f"/proc/self/net/{table}").exists()
                for r in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]]
        inodes = {f"socket:[{r[9]}]" for r in rows if len(r) > 9 and r[2] in wanted}
        found = {}
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if link in inodes:
                found[int(fd)] = link
        return found
    except (OSError, ValueError):
        return {}


def shut_connections_to(addr: str, port: int) -> int:
    """Shut down this process's TCP connections to ``addr:port`` (Linux); return how many.

    A thread blocked reading from a peer whose link went down waits for TCP to give up (many minutes):
    the elastic agent's rendezvous reads do. Shutting the socket down makes that read return at once.
    """
    count = 0
    for fd in _connections_to(addr, port):
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
    return count


def _bound_reads(fds: list[int], seconds: float) -> None:
    """Make reads and writes on ``fds`` fail after ``seconds`` instead of waiting for TCP to give up."""
    value = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    for fd in fds:
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        except OSError:
            pass


def session_members(sid: int) -> list[int]:
    """Live processes of session ``sid`` (Linux /proc; empty elsewhere)."""
    if not Path("/proc/self/stat").exists():
        return []
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            stat = _group_and_session(entry)
            if stat is not None and stat[1] == sid:
                out.append(int(entry))
    return out


def kill_process_groups(leaders: set[int]) -> int:
    """SIGKILL every process in the process groups led by ``leaders``; return how many were signalled.

    Workers lead their own group, so the processes they started (a KVStore server, data loaders)
    go with them even when the worker itself is already dead. Only processes of this session are
    touched: a group id reused by a stranger after its leader and members are gone is left alone.
    """
    if not leaders:
        return 0
    if not Path("/proc/self/stat").exists():
        for pgid in leaders:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
        return len(leaders)
    session, count = os.getsid(0), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        stat = _group_and_session(entry)
        if stat is not None and stat[0] in leaders and stat[1] == session:
            try:
                os.kill(int(entry), signal.SIGKILL)
                count += 1
            except OSError:
                pass
    return count


def set_parent_death_signal(parent_pid: int) -> None:
    """Have the kernel SIGKILL the calling process when its parent dies (Linux; a no-op elsewhere).

    A worker whose launcher is killed would otherwise wait in a collective until its timeout.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request was made
        os.kill(os.getpid(), signal.SIGKILL)


class FaultBoard:
    """Heartbeats and final failures of the nodes of one launch, on the rendezvous store (see module doc).

    Used by one thread at a time: the launcher's watchdog while the workers run, then the launcher.
    Every store error is taken as "the store (node 0) is not answering", never raised.
    """

    def __init__(self, addr: str, port: int, run_id: str, node_rank: int, nnodes: int, host: str,
                 fault_timeout_s: float) -> None:
        self.addr, self.port = addr, port
        self.prefix = f"dlperf/{run_id}/faults/"
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.host = host
        self.fault_timeout_s = fault_timeout_s
        self._store: Any = None
        self._beats: dict[int, tuple[int, float]] = {}  # node -> (last counter, when it last changed)
        self._last_ok = time.monotonic()
        self._failed_at = -1.0  # when a call last found the store unreachable
        self._ever_ok = False  # a store not up yet is the rendezvous's business (its join timeout), not a loss
        self._others = [n for n in range(nnodes) if n != node_rank]
        self._ranks_published = False

    # store access ---------------------------------------------------------------------------
    def _connect(self) -> Any:
        if self._store is None:
            import torch.distributed as dist

            before = _connections_to(self.addr, self.port)
            timeout = min(2.0, self.fault_timeout_s / 2)
            store = dist.TCPStore(self.addr, self.port, is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout))
            # the store's timeout bounds its waits, not a read from a peer whose link is down: bound those
            # too, on this board's own connection, so a lost link is noticed within the fault timeout
            _bound_reads([fd for fd in _connections_to(self.addr, self.port) if fd not in before], timeout)
            self._store = dist.PrefixStore(self.prefix, store)
        return self._store

    def _call(self, fn: Any) -> Any:
        """``fn(store)``, or None when the store does not answer (then the next call reconnects)."""
        return self._attempt(fn)[1]

    def _attempt(self, fn: Any) -> tuple[bool, Any]:
        """(whether the store answered, what ``fn(store)`` returned)."""
        if self._store is None and time.monotonic() - self._failed_at < _RETRY_S:
            # it just failed: every call of this poll would wait out its own timeout, delaying the verdict
            return False, None
        try:
            out = fn(self._connect())
        except Exception:  # noqa: BLE001 - RuntimeError, DistStoreError, OSError: all mean "not reachable"
            self._store = None
            self._failed_at = time.monotonic()
            return False, None
        self._last_ok = time.monotonic()
        self._ever_ok = True
        return True, out

    def _write(self, key: str, value: str) -> bool:
        """Set ``key``, trying again for up to fault_timeout_s: a busy store may miss one short timeout,
        and a failure that is never written leaves the other nodes guessing its cause."""
        # a store already silent for the fault timeout gets one try: the others have given up on this node too
        silent = self._ever_ok and time.monotonic() - self._last_ok > self.fault_timeout_s
        deadline = time.monotonic() + (0 if silent else self.fault_timeout_s)
        while True:
            if self._attempt(lambda s: s.set(key, value))[0]:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def _read_json(self, key: str) -> Any:
        def read(store: Any) -> Any:
            return store.get(key) if store.check([key]) else None

        raw = self._call(read)
        if raw is None:
            return None
        try:
            return decode_json(bytes(raw), key, lambda where, why: ValueError(why))
        except ValueError:  # a node of another dlperf, or a torn write: no word from it
            return None

    def close(self) -> None:
        self._store = None

    # while the workers run ---------------------------------------------------------------------
    def rendezvous_met(self) -> None:
        """This node's workers have started, so the rendezvous met on the store: it is up, and an interrupt
        from now on is written for the others even if this board's first call has not answered yet."""
        if not self._ever_ok:
            self._ever_ok = True
            self._last_ok = time.monotonic()

    def beat(self, ranks: list[int]) -> None:
        self._call(lambda s: s.add(f"beat/{self.node_rank}", 1))
        if ranks and not self._ranks_published:
            info = json.dumps({"host": self.host, "ranks": ranks})
            self._ranks_published = self._attempt(lambda s: s.set(f"node/{self.node_rank}", info))[0]

    def others_failed(self) -> bool:
        """Whether another node has given up (its final failures are on the board)."""
        keys = [f"final/{n}" for n in self._others]
        return bool(self._call(lambda s: any(s.check([k]) for k in keys)))

    def lost(self) -> list[FailureRecord]:
        """Nodes whose heartbeat stopped, or the store itself when it stopped answering, for fault_timeout_s."""
        now = time.monotonic()
        out = []
        for n in self._others:
            if self._call(lambda s, n=n: s.check([f"final/{n}"])):
                continue
            count = self._call(lambda s, n=n: s.add(f"beat/{n}", 0))
            if count is None:
                continue
            last = self._beats.get(n)
            if last is None or last[0] != count:
                self._beats[n] = (count, now)
            elif count > 0 and now - last[1] > self.fault_timeout_s:
                out.append(self._lost_node(n, now - last[1]))
        if self._ever_ok and now - self._last_ok > self.fault_timeout_s:
            # the agent's own reads from the store would wait for TCP to give up: let them fail now
            shut_connections_to(self.addr, self.port)
            out.append(FailureRecord(None, "rendezvous store", f"{self.addr}:{self.port}",
                                     f"node 0's rendezvous store stopped answering for "
                                     f"{now - self._last_ok:.0f} s (its launcher was killed or the network "
                                     "is down)", time.time(), False))
        return out

    def _lost_node(self, n: int, silent_s: float) -> FailureRecord:
        info = self._read_json(f"node/{n}") or {}
        ranks = info.get("ranks") if isinstance(info, dict) else None
        host = info.get("host") if isinstance(info, dict) else None
        ranks = [r for r in ranks if isinstance(r, int)] if isinstance(ranks, list) else []
        return FailureRecord(min(ranks) if ranks else None, "node", str(host or f"node {n}"),
                             f"node {n} (ranks {ranks or 'unknown'}) stopped answering for {silent_s:.0f} s "
                             "(its launcher was killed or lost the network)", time.time(), False)

    # after the agent gave up -----------------------------------------------------------------
    def publish(self, records: list[FailureRecord]) -> None:
        """Put this node's failures on the board (an empty list: it only stopped because of others)."""
        self._write(f"final/{self.node_rank}", json.dumps([asdict(r) for r in records]))

    def publish_interrupt(self, record: FailureRecord) -> bool:
        """Say that this node was stopped on purpose; return whether the board took it.

        The node is the cause and gathers nothing, so it marks itself as having read the others' records
        too: node 0 would otherwise wait for it until the fault timeout. Nothing is written to a store that
        never answered (the rendezvous has not met yet): there is no one to tell, and a Ctrl-C must not
        wait out the retries.
        """
        if not self._ever_ok:
            return False
        written = self._write(f"final/{self.node_rank}", json.dumps([asdict(record)]))
        self._call(lambda s: s.set(f"seen/{self.node_rank}", "1"))
        return written

    def gather(self) -> list[FailureRecord]:
        """Every node's failures, waiting up to fault_timeout_s for nodes that have not written theirs.

        A node that stays silent that long and has stopped beating is reported as lost; when the store
        stops answering, what was read so far is all there is.
        """
        deadline = time.monotonic() + self.fault_timeout_s
        found: dict[int, list[FailureRecord]] = {}
        lost: list[FailureRecord] = []
        while True:
            for n in self._others:
                if n not in found:
                    data = self._read_json(f"final/{n}")
                    if isinstance(data, list):
                        found[n] = [r for r in map(FailureRecord.from_dict, data) if r is not None]
            missing = [n for n in self._others if n not in found]
            if not missing:
                break
            lost = [r for r in self.lost() if r.role != "rendezvous store" or self.node_rank != 0]
            if lost or time.monotonic() > deadline or time.monotonic() - self._last_ok > 2.0:
                break
            time.sleep(0.1)
        self._call(lambda s: s.set(f"seen/{self.node_rank}", "1"))
        if self.node_rank == 0:
            self.wait_for_readers(list(found), deadline)
        return [r for records in found.values() for r in records] + lost

    def wait_for_readers(self, nodes: list[int], deadline: float) -> None:
        """On node 0, whose process hosts the store: wait (until ``deadline``) for ``nodes`` to have read
        every record, since leaving closes the store under the nodes still reading."""
        while nodes and time.monotonic() < deadline:
            keys = [f"seen/{n}" for n in nodes]
            done = self._call(lambda s, keys=keys: all(s.check([k]) for k in keys))
            if done is None or done:
                return
            time.sleep(0.1)

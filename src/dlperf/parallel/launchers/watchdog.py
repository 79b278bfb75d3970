"""The launcher's watchdog: the one thread beside torch's agent that stops the workers when they must not go on
(a join timeout, another node's failure, a signal), and the markers the workers leave it."""

from __future__ import annotations

import os
import select
import signal
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from ..._attempt import attempt_number
from ..._threads import ServiceThread
from .faults import FailureRecord, FaultBoard, kill_process_groups
from .launcher import DEFAULT_ROLE

# signals that stop a launch on purpose: the other nodes hear of it at once, not after their fault timeout
INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

__all__ = ["Watchdog", "reported_failures", "spawned_children", "mark", "INTERRUPTS"]


def mark(marker_dir: str, local_rank: int, what: str, text: str = "") -> None:
    # a marker's presence is its message; os.replace makes it appear whole. Names carry the attempt so a
    # restarted worker's markers are not confused with its predecessor's.
    path = Path(marker_dir) / f"{attempt_number()}.{local_rank}.{what}"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text or str(os.getpid()))
    os.replace(tmp, path)


def reported_failures(marker_dir: Path) -> dict[int, tuple[float, str]]:
    """rank -> (when, error) of every worker that raised in the last attempt, from their own markers."""
    found = []
    for path in marker_dir.glob("*.failed"):
        try:
            attempt = int(path.name.split(".")[0])
            when, rank, message = path.read_text().split("\n", 2)
            found.append((attempt, int(rank), float(when), message.strip()))
        except (OSError, ValueError):
            continue
    last = max((f[0] for f in found), default=0)
    return {rank: (when, message) for attempt, rank, when, message in found if attempt == last}


def spawned_children() -> set[int]:
    """Pids of this process's multiprocessing-spawned children (Linux; empty elsewhere)."""
    pids: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{os.getpid()}/task")
    except OSError:
        return pids
    for tid in tasks:
        try:
            pids.update(int(p) for p in Path(f"/proc/{os.getpid()}/task/{tid}/children").read_text().split())
        except (OSError, ValueError):
            continue
    out = set()
    for pid in pids:
        try:
            if b"--multiprocessing-fork" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.add(pid)
        except OSError:
            continue
    return out


class Watchdog:
    """The launcher's one thread beside the agent: it stops the workers when they must not go on.

    The agent itself waits for its workers without a deadline and knows nothing of other nodes;
    killing the workers is the one way to make it return (and stop the rest) through its own shutdown
    path. The watchdog does that when the join timeout passes, and, on a launch over several nodes,
    when another node gives up or is lost (see :class:`~.faults.FaultBoard`, which it keeps beating).
    When this launcher is interrupted (SIGINT, SIGTERM, SIGHUP) the agent stops the workers itself, and
    the watchdog tells the other nodes at once, while the main thread is still busy with that shutdown.
    """

    POLL_S = 0.2

    def __init__(self, marker_dir: str, local_world: int, timeout_s: float, board: FaultBoard | None,
                 roles: Mapping[int, str] | None = None, host: str = "") -> None:
        self.marker_dir = Path(marker_dir)
        self.local_world = local_world
        self.timeout_s = timeout_s
        self.board = board
        self.roles = dict(roles or {})
        self.host = host
        self.before = spawned_children()
        self.still_running: list[int] = []
        self.remote: list[FailureRecord] | None = None  # set when other nodes' failures stopped ours
        self.interrupted: int | None = None  # the signal that stopped this launcher
        self.interrupt_published = False
        self._done = threading.Event()
        # the kernel-level signal handler writes each signal's number here (signal.set_wakeup_fd), however
        # the agent's Python handlers deal with it afterwards
        self._wake_read, self._wake_write = socket.socketpair()
        for end in (self._wake_read, self._wake_write):
            end.setblocking(False)
        self._previous_wakeup: int | None = None
        # one plain thread: it only waits, polls the store and sends signals; tensor work runs elsewhere
        self._thread = ServiceThread(self._run, name="dlperf-launch-watchdog")

    @property
    def fired(self) -> bool:
        return bool(self.still_running)

    def start(self) -> None:
        if threading.current_thread() is threading.main_thread():  # only there can signals be watched
            self._previous_wakeup = signal.set_wakeup_fd(self._wake_write.fileno(), warn_on_full_buffer=False)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and the watch on signals; may be called more than once.

        Raises what the thread raised (once), after the watch on signals is given back.
        """
        self._done.set()
        try:
            self._wake_write.send(b"\0")  # not a signal number: it only ends the thread's wait
        except OSError:
            pass
        try:
            self._thread.join()
        finally:
            if self._previous_wakeup is not None:
                signal.set_wakeup_fd(self._previous_wakeup)
                self._previous_wakeup = None
            self._wake_read.close()
            self._wake_write.close()

    def _wait(self) -> bool:
        """Sleep one poll interval or until a signal arrives; return whether the watchdog must stop."""
        if not self._done.is_set():
            try:
                select.select([self._wake_read], [], [], self.POLL_S)
                received = self._wake_read.recv(256)
            except (BlockingIOError, InterruptedError):
                received = b""
            for signum in received:
                if signum in INTERRUPTS and self.interrupted is None:
                    self.interrupted = signum
        return self._done.is_set()

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._wait():
            if self.interrupted is not None:
                self.publish_interrupt()
                self._done.wait()  # the agent stops its workers itself: they got the signal and may save
                return
            if time.monotonic() > deadline:
                self.still_running = [self._rank(r) for r in range(self.local_world)
                                      if not self._marker(r, "finished").exists()] or [-1]
                break
            if self.board is not None and self._others_failed():
                break
        # keep killing until the agent returns: with restarts left it starts replacements
        while not self._done.is_set():
            self.kill_workers()
            self._done.wait(self.POLL_S)

    def interrupt_record(self, signum: int) -> FailureRecord:
        """This node as the cause of the launch's end: stopped by ``signum``, named by its lowest rank."""
        ranks = self.global_ranks()
        rank = ranks[0] if ranks else None
        node = f"node {self.board.node_rank}" if self.board is not None else "this node"
        return FailureRecord(rank, self.roles.get(rank, DEFAULT_ROLE) if rank is not None else "node", self.host,
                             f"interrupted by {signal.Signals(signum).name} to the launcher of {node} "
                             f"(ranks {ranks or 'not started'})", time.time(), False)

    def publish_interrupt(self) -> None:
        """Tell the other nodes that this one was interrupted (once; the board's thread only)."""
        if self.board is None or self.interrupt_published or self.interrupted is None:
            return
        if self.global_ranks():  # (the signal may come before the board's first call since they started)
            self.board.rendezvous_met()
        self.interrupt_published = self.board.publish_interrupt(self.interrupt_record(self.interrupted))

    def _others_failed(self) -> bool:
        assert self.board is not None
        ranks = self.global_ranks()
        if not ranks:
            # before this node's workers start, the rendezvous (and its join timeout) watches the nodes; a
            # store that is not up yet would cost each poll a connect timeout, past the launch's deadline
            return False
        self.board.rendezvous_met()
        self.board.beat(ranks)
        if self.board.others_failed():
            self.remote = []
            return True
        lost = self.board.lost()
        if lost:
            self.remote = lost
            return True
        return False

    def kill_workers(self) -> None:
        """SIGKILL this launch's workers (also those too young to have said who they are) and their groups."""
        targets = self._targets()
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        kill_process_groups(targets | self.leaders())

    def kill_leftovers(self) -> None:
        """SIGKILL what is left of the process groups of this launch's workers, once the agent is done.

        Only groups its workers announced: children spawned meanwhile may belong to another launch.
        """
        kill_process_groups(self.leaders())

    def _attempts(self) -> list[int]:
        return sorted({int(p.name.split(".")[0]) for p in self.marker_dir.glob("*.started")})

    def _marker(self, local_rank: int, what: str) -> Path:
        return self.marker_dir / f"{max(self._attempts(), default=0)}.{local_rank}.{what}"

    def _rank(self, local_rank: int) -> int:
        """The global rank of a local worker, as it wrote it; its local rank if it has not started."""
        try:
            return int(self._marker(local_rank, "started").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            return local_rank

    def global_ranks(self) -> list[int]:
        """The global ranks of this node's workers in the current attempt (those that have started)."""
        return sorted(self._rank(r) for r in range(self.local_world) if self._marker(r, "started").exists())

    def leaders(self) -> set[int]:
        """Every worker of every attempt: each leads its own process group."""
        pids = set()
        for path in self.marker_dir.glob("*.started"):
            try:
                pids.add(int(path.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                continue
        pids.discard(os.getpid())
        return pids

    def _targets(self) -> set[int]:
        pids = spawned_children() - self.before
        for r in range(self.local_world):
            if self._marker(r, "finished").exists():
                continue
            try:
                pids.add(int(self._marker(r, "started").read_text().split()[0]))
            except (OSError, ValueError):
                continue
        pids.discard(os.getpid())
        return pids

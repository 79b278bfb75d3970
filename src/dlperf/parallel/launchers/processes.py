"""Workers as processes, started by PyTorch's elastic agent (the machinery behind ``torchrun``).

:class:`ProcessLauncher` hands the work to :func:`torch.distributed.launcher.api.elastic_launch`:
the agent meets the other nodes' agents through a c10d rendezvous store on ``master_addr:master_port``,
spawns ``nproc_per_node`` workers with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` set, restarts them up to ``max_restarts`` times, and returns each worker's return value.
Around that the launcher owns what the agent leaves to its caller: the process group's lifetime in each
worker, a join timeout, one clear error per failure naming the lost rank, its role and host, the
failure of every node when one node's rank is lost (see :mod:`.faults`), and a parent process left as it
was found (environment, signal handlers, no child processes, nor any process a worker started).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import pickle
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._attempt import attempt_store
from ..._cliargs import one_line
from ..._hostmem import keep_freed_host_memory
from ..._io import check_writable
from ..._threads import cleanup_step
from ...errors import UsageError
from ...machine import HOST_ENV
from .faults import (
    FailureRecord,
    FaultBoard,
    first_cause,
    host_label,
    interface_with_address,
    local_address,
    set_parent_death_signal,
)
from .launch_config import MAX_TIMEOUT_S, MIN_TIMEOUT_S, LaunchConfig
from .launcher import DEFAULT_ROLE, Launcher, LaunchError, rank_info
from .parent import ParentState
from .watchdog import Watchdog, mark, reported_failures

__all__ = ["MAX_TIMEOUT_S", "MIN_TIMEOUT_S", "LaunchConfig", "ProcessLauncher", "attempt_store", "free_port"]

# how long the agent waits for signalled workers before SIGKILL: time for a worker to finish a checkpoint write
_SHUTDOWN_TIMEOUT_S = 5
_PORT_TRIES = 3  # free ports tried by a launch that picks its own
_KEPT_LOGS = 20  # logs of failed launches kept per user; older ones go as new ones come
_STORE_READ_TIMEOUT_S = 60  # torch's default for the rendezvous store's connect and reads


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class _Setup:
    """What every worker needs from its launcher, besides the function."""

    backend: str | None
    pg_timeout_s: float
    marker_dir: str
    launcher_pid: int
    roles: dict[int, str]
    host: str
    checkpoint: str | None
    nnodes: int


def _prepare_worker(setup: _Setup, rank: int) -> None:
    # Its own process group: whatever the worker starts can be killed with it, even after it died.
    os.setpgid(0, 0)
    set_parent_death_signal(setup.launcher_pid)
    keep_freed_host_memory()  # as dlperf's commands do in their own process (see dlperf._hostmem)
    os.environ["DLPERF_ROLE"] = setup.roles.get(rank, DEFAULT_ROLE)
    os.environ[HOST_ENV] = setup.host
    if setup.checkpoint is not None:
        os.environ["DLPERF_CHECKPOINT"] = setup.checkpoint
    if setup.nnodes > 1:
        choose_socket_interface(os.environ)


def choose_socket_interface(env: MutableMapping[str, str]) -> None:
    """Bind gloo and TensorPipe to the interface that reaches ``MASTER_ADDR``, unless the user chose one.

    Both otherwise bind to the address the host name resolves to, which need not reach the other hosts.
    TensorPipe (``torch.distributed.rpc``, the parameter servers' transport) reads ``TP_SOCKET_IFNAME``,
    gloo ``GLOO_SOCKET_IFNAME``.
    """
    if "GLOO_SOCKET_IFNAME" in env:
        return
    address = local_address(env.get("MASTER_ADDR", "127.0.0.1"))
    interface = interface_with_address(address) if address else None
    if interface:
        env["GLOO_SOCKET_IFNAME"] = interface
        env.setdefault("TP_SOCKET_IFNAME", interface)


class _StoreUnavailable(Exception):
    """The agent could not host or reach the rendezvous store: no worker has started."""


class WorkerInterrupted(RuntimeError):
    """A worker got SIGINT itself: raised in its place so that the agent sees a failed worker."""


@contextlib.contextmanager
def _workers_start_deaf_to_ctrl_c() -> Iterator[None]:
    """SIGINT blocked in this (the main) thread while the agent runs, so the workers it spawns start with it blocked.

    A worker spends its first seconds importing torch in the terminal's process group: a Ctrl-C there would
    print each worker's half-finished import as a traceback, though it is the launcher's to handle (it stops
    the workers). Blocked, the signal waits in the worker until :func:`_worker` has left that group and lets
    it through as an interruption. This process still hears it: the kernel hands it to a thread that does
    not block it (the watchdog's), and Python runs the handler here, in the main thread, as always.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _worker(fn: Callable[..., Any], args: tuple, kwargs: dict, setup: _Setup) -> Any:
    """Entry point of every worker process: the process group around ``fn``."""
    rank, _, local_rank = rank_info()
    _prepare_worker(setup, rank)
    marker_dir, backend = setup.marker_dir, setup.backend
    mark(marker_dir, local_rank, "started", f"{os.getpid()} {rank}")
    try:
        # in its own process group now: a Ctrl-C that came while it started (blocked by the launcher, see
        # _workers_start_deaf_to_ctrl_c) is raised here (pthread_sigmask runs the handler at once), and
        # later ones come from the agent
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    except KeyboardInterrupt:
        raise _stopped_by_ctrl_c(marker_dir, local_rank, rank) from None
    error_file = _spawn_error_file()
    if error_file is not None:  # the launcher removes it once torch has read it
        mark(marker_dir, local_rank, "errorfile", error_file)
    if backend is not None:
        import torch.distributed as dist

        _init_process_group(dist, backend, rank, datetime.timedelta(seconds=setup.pg_timeout_s))
    try:
        result = fn(*args, **kwargs)
    except KeyboardInterrupt:
        raise _stopped_by_ctrl_c(marker_dir, local_rank, rank) from None
    except BaseException as exc:
        # The peers of a failed rank fail too (their collectives lose the connection), and the agent
        # reports whichever it polls first; the time each rank failed tells the cause from the echoes,
        # so it is taken before this rank's connections close.
        mark(marker_dir, local_rank, "failed", f"{time.time()!r}\n{rank}\n{type(exc).__name__}: {exc}")
        raise
    else:
        if backend is not None:
            _leave_together(dist)
    finally:
        if backend is not None:
            from ..allreduce.shm import close_host_allreduce

            close_host_allreduce()  # segments set up on this group go with it
            dist.destroy_process_group()
    mark(marker_dir, local_rank, "finished")
    return result


def _stopped_by_ctrl_c(marker_dir: str, local_rank: int, rank: int) -> WorkerInterrupted:
    # torch's spawn wrapper takes a KeyboardInterrupt for its parent's doing and exits 0 without a
    # result; a worker interrupted on its own (Ctrl-C to its process group) must count as stopped
    message = f"interrupted by SIGINT (Ctrl-C) in rank {rank}'s process"
    mark(marker_dir, local_rank, "failed", f"{time.time()!r}\n{rank}\n{message}")
    return WorkerInterrupted(message)


def _spawn_error_file() -> str | None:
    """Where torch's spawn wrapper, up this worker's stack, writes the traceback if the worker raises: a
    ``pytorch-errorfile-*.pickle`` in the launcher's temporary directory that torch reads and never removes."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_wrap" and frame.f_globals.get("__name__") == "torch.multiprocessing.spawn":
            path = frame.f_locals.get("error_file")
            return path if isinstance(path, str) else None
        frame = frame.f_back
    return None


def _remove_error_files(markers: Path) -> None:
    """Remove the traceback files torch's spawn wrapper left for this launch's workers (named in their markers),
    once the agent has read them; only such files, in this process's temporary directory, owned by this user."""
    for marker in markers.glob("*.errorfile"):
        try:
            path = marker.read_text()
            name = os.path.basename(path)
            if os.path.dirname(path) != tempfile.gettempdir() or not (
                    name.startswith("pytorch-errorfile-") and name.endswith(".pickle")):
                continue
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(path)
        except OSError:
            continue  # never written (the worker did not raise), or gone already


def _leave_together(dist: Any) -> None:
    """Wait until every rank has finished its function before this one takes the group's segments down.

    A rank that leaves its last shared-memory sum first would otherwise close the segment while a slower
    peer is still on its way out of that sum, and the peer fails although nothing went wrong: a peer that
    has not yet seen this rank arrive at the sum's last barrier takes the closed segment for a rank that
    will never come. A peer that
    failed instead breaks this barrier as its connections close; its own error is what the launch reports.
    """
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - a peer that failed: the agent reports it, not this rank
        pass


def _init_process_group(dist: Any, backend: str, rank: int, timeout: datetime.timedelta) -> None:
    store = attempt_store()
    if store is None:
        dist.init_process_group(backend, timeout=timeout)  # env://: rank 0 hosts a fresh store
        return
    store.set_timeout(timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timeout)


class ProcessLauncher(Launcher):
    """Run the workers as processes on this node, ``nproc_per_node`` of them, joined in a process group.

    Built from a :class:`~.LaunchConfig`, or from its fields as keyword arguments
    (``ProcessLauncher(2, join_timeout_s=90)`` is ``ProcessLauncher(LaunchConfig(2, join_timeout_s=90))``).

    Args:
        nproc_per_node: workers on this node.
        nnodes: nodes taking part; each runs its own launcher with the same ``master_addr:master_port``.
        node_rank: 0 on the node that hosts the rendezvous store (ranks are handed out in joining order).
        master_addr, master_port: the rendezvous store; a free port is picked per launch when ``None``
            (one node only: other nodes could not know it).
        backend: the process group's backend (``"gloo"`` on CPU, ``"nccl"`` on GPUs), or ``None`` for none.
        join_timeout_s: the longest a launch may take; workers still running then are killed and the
            launch fails naming them. Also the process group's timeout for one collective unless
            ``collective_timeout_s`` is given.
        max_restarts: how often the agent restarts all workers after a failure before giving up; a
            restarted worker finds the attempt in :func:`~.restart_count` and resumes from ``checkpoint``.
        roles: a role label per global rank (a sequence of ``world_size`` labels, or a mapping from rank to
            label; ranks not named are ``"worker"``); each worker reads its own with :func:`~.rank_role`,
            and failures name it.
        fault_timeout_s: with several nodes, how long a node may stop answering (its launcher killed, the
            network down) before the others give it up; also the longest a failed node waits for the others'
            reports, so that every node names the same cause.
        collective_timeout_s: the process group's timeout for one collective (default: ``join_timeout_s``);
            a rank that skips a collective fails its peers after this long.
        checkpoint: a file the workers save their progress to, handed to them as :func:`~.checkpoint_path`;
            checked for writability before any process starts.
        run_id: names the launch in the rendezvous store; every node must use the same one. Default: one per
            launch on one node, ``dlperf-<master_port>`` on several.

    The function and its arguments travel to freshly spawned interpreters, so ``fn`` must be defined at
    a module's top level and everything must pickle; return values come back the same way (tensors
    through shared memory). Workers print to this process's stdout and stderr; torch's own output (the
    agent's log, with a failed worker's traceback, and C++ log lines) goes to a log file instead, kept
    when the launch fails (:attr:`LaunchError.log_path`), and the :class:`LaunchError` carries the failed
    worker's last line, rank, role, host and cause. Each worker leads its own process group, and whatever
    is left of the groups is killed when the launch ends; a worker whose launcher dies is killed by the
    kernel (Linux).

    A launcher interrupted by SIGINT (Ctrl-C), SIGTERM or SIGHUP has the agent pass the signal on to its
    workers, which may finish what they are saving, and tells the other nodes at once, naming its lowest
    rank as "interrupted" (they fail with that cause instead of waiting ``fault_timeout_s``); it raises
    KeyboardInterrupt for SIGINT and torch's ``SignalException`` for the others. A worker given SIGINT
    itself fails the launch as "interrupted" too.
    """

    def __init__(self, config: LaunchConfig | int | None = None, /, **options: Any) -> None:
        if isinstance(config, LaunchConfig):
            if options:
                raise UsageError(f"ProcessLauncher: give a LaunchConfig or options ({', '.join(options)}), "
                                 "not both")
        else:
            try:
                config = LaunchConfig(**options) if config is None else LaunchConfig(config, **options)
            except TypeError as exc:  # an unknown or missing option: name the ones there are
                names = ", ".join(f.name for f in dataclasses.fields(LaunchConfig))
                raise UsageError(f"ProcessLauncher: {exc}; the options are {names}") from None
        self.config = config
        nproc_per_node, nnodes = config.nproc_per_node, config.nnodes
        self.nproc_per_node = nproc_per_node
        self.nnodes = nnodes
        self.node_rank = config.node_rank
        self.master_addr = config.master_addr
        self.master_port = config.master_port
        self.backend = config.backend
        self.join_timeout_s = float(config.join_timeout_s)
        self.max_restarts = config.max_restarts
        self.roles = _check_roles(config.roles, nproc_per_node * nnodes)
        self.fault_timeout_s = float(config.fault_timeout_s)
        self.collective_timeout_s = config.collective_timeout
        self.checkpoint = None if config.checkpoint is None else os.fspath(config.checkpoint)
        self.run_id = config.run_id

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def role(self, rank: int) -> str:
        """The role label of global rank ``rank``."""
        return self.roles.get(rank, DEFAULT_ROLE)

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        _check_picklable(fn, args, kwargs)
        if self.checkpoint is not None:
            check_writable(self.checkpoint)
        log_path = _log_dir() / f"dlperf-agent-{os.getpid()}-{uuid.uuid4().hex[:8]}.log"
        with ParentState(log_path) as parent:  # removes the log file at the end unless kept
            try:
                return self._launch_with_retries(fn, args, kwargs)
            except LaunchError as exc:
                parent.keep = parent.logged()
                if parent.keep:  # where the rest went, for the one line that reports the error
                    exc.log_path = str(parent.log_path)
                raise

    def _launch_with_retries(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[Any]:
        # A port picked here is only free until the agent binds it: another program may take it between the
        # two. Then no worker has started yet, and the launch simply moves to another free port.
        tries = 1 if self.master_port is not None else _PORT_TRIES
        for attempt in range(tries):
            port = self.master_port or free_port(self.master_addr)
            try:
                results = self._launch_on(port, fn, args, kwargs)
            except _StoreUnavailable as exc:
                if attempt + 1 < tries:
                    continue
                raise LaunchError(f"the rendezvous store on {self.master_addr}:{port} could not be "
                                  f"{'hosted' if self.node_rank == 0 else 'reached'} ({exc}); "
                                  + ("pick another free master_port" if self.node_rank == 0
                                     else "start node 0 first, with the same master address and port, or check "
                                          "that this host reaches it")) from None
            # (had the deadline passed as the last worker finished, the work is still done: it is returned)
            return [results[i] for i in sorted(results)]
        raise AssertionError("unreachable")

    def _launch_on(self, port: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> dict[int, Any]:

        run_id = self.run_id or (f"dlperf-{port}" if self.nnodes > 1 else f"dlperf-{uuid.uuid4().hex[:12]}")
        host = host_label(self.master_addr)
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        with tempfile.TemporaryDirectory(prefix="dlperf-launch-") as tmp:
            markers = Path(tmp, "markers")
            markers.mkdir()
            config = LaunchConfig(
                min_nodes=self.nnodes, max_nodes=self.nnodes, nproc_per_node=self.nproc_per_node,
                run_id=run_id, rdzv_backend="c10d", rdzv_endpoint=f"{self.master_addr}:{port}",
                # torch reads these as whole seconds; the store's connect and reads are bounded by the launch's
                # timeout too, so an unreachable master fails within it
                rdzv_configs={"is_host": self.node_rank == 0, "join_timeout": max(1, math.ceil(self.join_timeout_s)),
                              # (the store tries to connect twice, with up to one timeout's delay between)
                              "read_timeout": max(1, math.ceil(min(self.join_timeout_s, _STORE_READ_TIMEOUT_S) / 4))},
                max_restarts=self.max_restarts, monitor_interval=0.1, start_method="spawn",
                # no redirects: workers print to this process's stdout/stderr; the logs dir holds error files
                logs_specs=DefaultLogsSpecs(log_dir=str(Path(tmp, "logs"))),
                shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
                local_addr=local_address(self.master_addr) if self.nnodes > 1 else None)
            setup = _Setup(self.backend, self.collective_timeout_s, str(markers), os.getpid(), self.roles, host,
                           self.checkpoint, self.nnodes)
            board = (FaultBoard(self.master_addr, port, run_id, self.node_rank, self.nnodes, host,
                                self.fault_timeout_s) if self.nnodes > 1 else None)
            watchdog = Watchdog(str(markers), self.nproc_per_node, self.join_timeout_s, board, self.roles, host)
            try:
                return self._run(elastic_launch(config, _worker), (fn, args, kwargs, setup), watchdog, markers,
                                 host)
            finally:
                _remove_error_files(markers)
                if board is not None:
                    board.close()

    def _run(self, agent: Callable[..., Any], agent_args: tuple, watchdog: Watchdog, markers: Path,
             host: str) -> dict[int, Any]:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError

        failed: Any = None
        lost: BaseException | None = None
        watchdog.start()
        try:
            with _workers_start_deaf_to_ctrl_c():
                results = agent(*agent_args)
        except ChildFailedError as exc:
            failed = exc
        except RendezvousConnectionError as exc:
            if watchdog.global_ranks():
                # workers ran, so the store was there: its host (node 0's launcher) is gone. The agent stopped
                # this node's workers on its way out, and the board, on that store, is gone with it
                lost = exc
            else:
                cause = exc.__cause__ or exc
                raise _StoreUnavailable(one_line(str(cause)).split(" Exception raised from")[0][:300]) from None
        except RendezvousError as exc:  # a node missing at rendezvous (RendezvousTimeoutError), or a closed one
            raise LaunchError(f"the rendezvous on {self.master_addr} did not complete within "
                              f"join_timeout_s={self.join_timeout_s:g} s ({type(exc).__name__}: "
                              f"{one_line(str(exc)).split(' Exception raised from')[0][:200]}); start all "
                              f"{self.nnodes} nodes with the same master_port and nnodes, or raise the timeout"
                              ) from None
        except (SignalException, KeyboardInterrupt) as exc:
            # handled while the exception lives: it holds the agent, and on node 0 the store with it
            self._interrupted(watchdog, getattr(exc, "sigval", signal.SIGINT))
            if isinstance(exc, SignalException) and exc.sigval == signal.SIGINT:
                raise KeyboardInterrupt from None
            raise
        finally:
            try:  # a watchdog that failed is raised, but never instead of the failure or interrupt it follows
                with cleanup_step("the launch watchdog", failed or lost):
                    watchdog.stop()
            finally:
                watchdog.kill_leftovers()  # what the workers started outlives them otherwise
        if lost is not None:
            raise self._store_lost(watchdog)
        if failed is not None:
            raise self._failure(failed, watchdog, markers, host)
        # No word on the board after a success: the agent returns only once every node's workers have
        # finished (its exit barrier), and node 0's agent closes the store as it returns, so a last
        # heartbeat or "done" from any node would only meet a closed socket (a screenful of C++ warnings).
        return results

    def _interrupted(self, watchdog: Watchdog, signum: int) -> None:
        """This launcher was stopped on purpose: make sure the other nodes know, and on node 0 keep the
        store up until they have read it."""
        with cleanup_step("the launch watchdog"):  # the interrupt being handled is raised, and published first
            watchdog.stop()
        board = watchdog.board
        if board is None:
            return
        if watchdog.interrupted is None:  # the signal came before the watch on signals, or it was not seen
            watchdog.interrupted = signum
        watchdog.publish_interrupt()
        if watchdog.interrupt_published and board.node_rank == 0:
            board.wait_for_readers(list(range(1, self.nnodes)), time.monotonic() + self.fault_timeout_s)

    def _failure(self, exc: Any, watchdog: Watchdog, markers: Path, host: str) -> LaunchError:
        if watchdog.fired:
            error = _timeout_error(self.join_timeout_s, watchdog.still_running)
            if watchdog.board is not None:  # the other nodes' workers wait for ours: stop them now
                rank = watchdog.still_running[0]
                watchdog.board.publish([FailureRecord(None if rank < 0 else rank, self.role(rank), host,
                                                      str(error), time.time(), False)])
            return error
        records = [] if watchdog.remote is not None else self._local_records(exc, markers, host)
        if watchdog.board is not None:
            watchdog.board.publish(records)
            records = records + (watchdog.remote or []) + watchdog.board.gather()
        cause = first_cause(records)
        if cause is None:
            return LaunchError("the workers were stopped because another node failed, but no node said why; "
                               "see the other nodes' output")
        return LaunchError(cause.message(), rank=cause.rank, role=cause.role, host=cause.host, cause=cause.cause)

    def _store_lost(self, watchdog: Watchdog) -> LaunchError:
        """The rendezvous store went while the workers ran: a lost node the watchdog named, else the store itself.

        The board lives on that store: nothing more can be read from it or written to it (each try would wait
        out a connect timeout), and the nodes still running find the store gone as this one did.
        """
        board = watchdog.board
        where = self.master_addr if board is None else f"{board.addr}:{board.port}"
        cause = first_cause(watchdog.remote or []) or FailureRecord(
            None, "rendezvous store", where, "node 0's rendezvous store closed while the workers ran (its launcher "
            "was interrupted or killed, or the network is down)", time.time(), False)
        return LaunchError(cause.message(), rank=cause.rank, role=cause.role, host=cause.host, cause=cause.cause)

    def _local_records(self, exc: Any, markers: Path, host: str) -> list[FailureRecord]:
        """This node's failed ranks: their own errors, or, for those that died without one, how they ended.

        The peers of a failed rank fail too (their collectives lose the connection); the time each rank
        failed, and whether it could report at all, tells the cause from the echoes.
        """
        reported = reported_failures(markers)
        records = []
        for rank, failure in exc.failures.items():
            if rank in reported:
                when, message = reported[rank]
                records.append(FailureRecord(rank, self.role(rank), host, message, when, True))
            else:
                records.append(FailureRecord(rank, self.role(rank), host, _failure_message(failure),
                                             float(failure.timestamp), False))
        records += [FailureRecord(rank, self.role(rank), host, message, when, True)
                    for rank, (when, message) in reported.items() if rank not in exc.failures]
        return records


def _log_dir() -> Path:
    """This user's directory of kept launch logs (the newest :data:`_KEPT_LOGS`), made private on first use."""
    path = Path(tempfile.gettempdir(), f"dlperf-logs-{os.getuid()}")
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
        # another user may have made the name first (the temporary directory is shared): not used then
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(f"{path} is not this user's private directory")
        old = sorted(path.glob("dlperf-agent-*.log"), key=lambda p: p.stat().st_mtime)
        for stale in old[:max(0, len(old) - _KEPT_LOGS + 1)]:
            stale.unlink(missing_ok=True)
    except OSError:
        return Path(tempfile.mkdtemp(prefix="dlperf-logs-"))
    return path


def _check_roles(roles: Sequence[str] | Mapping[int, str] | None, world_size: int) -> dict[int, str]:
    if roles is None:
        return {}
    if isinstance(roles, Mapping):
        mapping = dict(roles)
    elif isinstance(roles, Sequence) and not isinstance(roles, str):
        if len(roles) != world_size:
            raise UsageError(f"roles has {len(roles)} labels: expected one per rank, {world_size} "
                             "(nproc_per_node * nnodes), or a mapping from rank to label")
        mapping = dict(enumerate(roles))
    else:
        raise UsageError(f"roles={roles!r}: expected a sequence of labels, one per rank, or a mapping from "
                         "rank to label")
    for rank, label in mapping.items():
        if not (isinstance(rank, int) and 0 <= rank < world_size):
            raise UsageError(f"roles names rank {rank!r}: expected ranks 0..{world_size - 1}")
        if not (isinstance(label, str) and label.strip() and label.isprintable()):
            raise UsageError(f"roles[{rank}]={label!r}: expected a non-empty printable label such as 'server'")
    return mapping


def _timeout_error(timeout_s: float, still_running: list[int]) -> LaunchError:
    ranks = "no worker had started" if still_running == [-1] else f"ranks still running: {still_running}"
    return LaunchError(f"the workers did not finish within join_timeout_s={timeout_s:g} s ({ranks}); they "
                       "were stopped. Raise join_timeout_s if the work needs longer, or find the rank that hangs")


def _failure_message(failure: Any) -> str:
    """The worker's own error line from the agent's error file, else how the process ended."""
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    if isinstance(message, str) and message.strip() and message.strip() not in ("<NONE>", "<N/A>"):
        return message.strip().splitlines()[-1] if "Traceback" in message else message.strip()
    if failure.exitcode is not None and failure.exitcode < 0:
        return f"killed by {failure.signal_name()} (exit code {failure.exitcode})"
    return f"exited with code {failure.exitcode} without an error report; its output is above"


def _check_picklable(fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    try:
        pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise UsageError(f"{getattr(fn, '__qualname__', fn)!r} or its arguments cannot be sent to worker "
                         f"processes ({type(exc).__name__}: {exc}); define the function at a module's top "
                         "level and pass picklable arguments") from None

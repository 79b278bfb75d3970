"""Workers as processes, started by PyTorch's elastic agent (the machinery behind ``torchrun``).

:class:`ProcessLauncher` hands the work to :func:`torch.distributed.launcher.api.elastic_launch`:
the agent meets the other nodes' agents through a c10d rendezvous store on ``master_addr:master_port``,
spawns ``nproc_per_node`` workers with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` set, restarts them up to ``max_restarts`` times, and returns each worker's return value.
Around that the launcher owns what the agent leaves to its caller: the process group's lifetime in each
worker, a join timeout, one clear error per failure, and a parent process left as it was found
(environment, signal handlers, no child processes).
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import UsageError
from .launcher import Launcher, LaunchError, rank_info

__all__ = ["ProcessLauncher", "free_port"]

# torch's process context installs its own handlers for these in the main thread and leaves them there
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# how long the agent waits for SIGTERM'd workers before SIGKILL: a worker being stopped has nothing to save
_SHUTDOWN_TIMEOUT_S = 5


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _mark(marker_dir: str, local_rank: int, what: str, text: str = "") -> None:
    # a marker's presence is its message; os.replace makes it appear whole. Names carry the attempt so a
    # restarted worker's markers are not confused with its predecessor's.
    path = Path(marker_dir) / f"{_attempt()}.{local_rank}.{what}"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text or str(os.getpid()))
    os.replace(tmp, path)


def _worker(fn: Callable[..., Any], args: tuple, kwargs: dict, backend: str | None, pg_timeout_s: float,
            marker_dir: str) -> Any:
    """Entry point of every worker process: the process group around ``fn``."""
    rank, _, local_rank = rank_info()
    _mark(marker_dir, local_rank, "started", f"{os.getpid()} {rank}")
    if backend is not None:
        import torch.distributed as dist

        _init_process_group(dist, backend, rank, datetime.timedelta(seconds=pg_timeout_s))
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        # The peers of a failed rank fail too (their collectives lose the connection), and the agent
        # reports whichever it polls first; the time each rank failed tells the cause from the echoes,
        # so it is taken before this rank's connections close.
        _mark(marker_dir, local_rank, "failed", f"{time.time()!r}\n{rank}\n{type(exc).__name__}: {exc}")
        raise
    finally:
        if backend is not None:
            dist.destroy_process_group()
    _mark(marker_dir, local_rank, "finished")
    return result


def _init_process_group(dist: Any, backend: str, rank: int, timeout: datetime.timedelta) -> None:
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)  # env://: rank 0 hosts a fresh store
        return
    # The agent's store outlives a restart, and env:// keeps no attempt apart from the last: restarted
    # workers would read their predecessors' addresses and fail to connect. A prefix per attempt keeps them
    # apart.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    prefixed = dist.PrefixStore(f"dlperf/attempt_{_attempt()}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timeout)


def _reported_failures(marker_dir: Path) -> dict[int, tuple[float, str]]:
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


def _spawned_children() -> set[int]:
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


class _Watchdog:
    """Kills the workers still running when the join timeout passes, so the agent sees them fail.

    The agent itself waits for its workers without a deadline; killing a hung worker is the one way to
    make it return (and stop the others) through its own shutdown path.
    """

    def __init__(self, marker_dir: str, local_world: int, timeout_s: float) -> None:
        self.marker_dir = Path(marker_dir)
        self.local_world = local_world
        self.timeout_s = timeout_s
        self.before = _spawned_children()
        self.still_running: list[int] = []
        self._done = threading.Event()
        # one plain thread: it only waits and sends signals; the project's device workers run tensors work
        self._thread = threading.Thread(target=self._run, name="dlperf-launch-watchdog", daemon=True)

    @property
    def fired(self) -> bool:
        return bool(self.still_running)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        if self._done.wait(self.timeout_s):
            return
        self.still_running = [self._rank(r) for r in range(self.local_world)
                              if not self._marker(r, "finished").exists()] or [-1]
        # keep killing until the agent returns: with restarts left it starts replacements
        while not self._done.is_set():
            for pid in self._targets():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            self._done.wait(0.2)

    def _marker(self, local_rank: int, what: str) -> Path:
        attempts = [int(p.name.split(".")[0]) for p in self.marker_dir.glob("*.started")]
        return self.marker_dir / f"{max(attempts, default=0)}.{local_rank}.{what}"

    def _rank(self, local_rank: int) -> int:
        """The global rank of a local worker, as it wrote it; its local rank if it has not started."""
        try:
            return int(self._marker(local_rank, "started").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            return local_rank

    def _targets(self) -> set[int]:
        pids = _spawned_children() - self.before
        for r in range(self.local_world):
            if self._marker(r, "finished").exists():
                continue
            try:
                pids.add(int(self._marker(r, "started").read_text().split()[0]))
            except (OSError, ValueError):
                continue
        pids.discard(os.getpid())
        return pids


class _ParentState:
    """The environment and signal handlers the agent changes in the launching process, put back after."""

    def __enter__(self) -> _ParentState:
        self.env = dict(os.environ)
        self.handlers = {}
        if threading.current_thread() is threading.main_thread():
            for name in _AGENT_SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self.handlers[sig] = signal.getsignal(sig)
        return self

    def __exit__(self, *exc: object) -> None:
        for k in set(os.environ) - set(self.env):
            del os.environ[k]
        for k, v in self.env.items():
            if os.environ.get(k) != v:
                os.environ[k] = v
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)


class ProcessLauncher(Launcher):
    """Run the workers as processes on this node, ``nproc_per_node`` of them, joined in a process group.

    Args:
        nproc_per_node: workers on this node.
        nnodes: nodes taking part; each runs its own launcher with the same ``master_addr:master_port``.
        node_rank: 0 on the node that hosts the rendezvous store (ranks are handed out in joining order).
        master_addr, master_port: the rendezvous store; a free port is picked per launch when ``None``
            (one node only: other nodes could not know it).
        backend: the process group's backend (``"gloo"`` on CPU, ``"nccl"`` on GPUs), or ``None`` for none.
        join_timeout_s: the longest a launch may take; workers still running then are killed and the
            launch fails naming them. Also the process group's timeout for one collective.
        max_restarts: how often the agent restarts all workers after a failure before giving up.

    The function and its arguments travel to freshly spawned interpreters, so ``fn`` must be defined at
    a module's top level and everything must pickle; return values come back the same way (tensors
    through shared memory). Workers print to this process's stdout and stderr; a failed worker's
    traceback is logged there by the agent, and the :class:`LaunchError` carries its last line.
    """

    def __init__(self, nproc_per_node: int, nnodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, backend: str | None = "gloo", join_timeout_s: float = 300.0,
                 max_restarts: int = 0) -> None:
        for name, value, low in (("nproc_per_node", nproc_per_node, 1), ("nnodes", nnodes, 1),
                                 ("node_rank", node_rank, 0), ("max_restarts", max_restarts, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise UsageError(f"{name}={value!r}: expected an integer >= {low}")
        if node_rank >= nnodes:
            raise UsageError(f"node_rank={node_rank}: expected less than nnodes={nnodes}")
        if master_port is not None and not (isinstance(master_port, int) and 0 < master_port < 65536):
            raise UsageError(f"master_port={master_port!r}: expected a TCP port 1..65535, or None for a free one")
        if master_port is None and nnodes > 1:
            raise UsageError(f"master_port=None with nnodes={nnodes}: every node must name the same port; "
                             "pass master_port")
        if not join_timeout_s > 0:
            raise UsageError(f"join_timeout_s={join_timeout_s!r}: expected a positive number of seconds")
        self.nproc_per_node = nproc_per_node
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.master_addr = master_addr
        self.master_port = master_port
        self.backend = backend
        self.join_timeout_s = float(join_timeout_s)
        self.max_restarts = max_restarts

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        _check_picklable(fn, args, kwargs)
        port = self.master_port or free_port(self.master_addr)
        with tempfile.TemporaryDirectory(prefix="dlperf-launch-") as tmp:
            markers = Path(tmp, "markers")
            markers.mkdir()
            config = LaunchConfig(
                min_nodes=self.nnodes, max_nodes=self.nnodes, nproc_per_node=self.nproc_per_node,
                # the nodes of one job meet under one run id: every node derives it from the shared endpoint
                run_id=f"dlperf-{uuid.uuid4().hex[:12]}" if self.nnodes == 1 else f"dlperf-{self.master_addr}-{port}",
                rdzv_backend="c10d",
                rdzv_endpoint=f"{self.master_addr}:{port}",
                rdzv_configs={"is_host": self.node_rank == 0, "join_timeout": self.join_timeout_s},
                max_restarts=self.max_restarts, monitor_interval=0.1, start_method="spawn",
                # no redirects: workers print to this process's stdout/stderr; the logs dir holds error files
                logs_specs=DefaultLogsSpecs(log_dir=str(Path(tmp, "logs"))),
                shutdown_timeout=_SHUTDOWN_TIMEOUT_S)
            watchdog = _Watchdog(str(markers), self.nproc_per_node, self.join_timeout_s)
            with _ParentState():
                watchdog.start()
                try:
                    results = elastic_launch(config, _worker)(fn, args, kwargs, self.backend,
                                                              self.join_timeout_s, str(markers))
                except ChildFailedError as exc:
                    raise self._failure(exc, watchdog, markers) from None
                except SignalException as exc:
                    if exc.sigval == signal.SIGINT:
                        raise KeyboardInterrupt from None
                    raise
                finally:
                    watchdog.stop()
        # (had the deadline passed as the last worker finished, the work is still done: it is returned)
        return [results[i] for i in sorted(results)]

    def _failure(self, exc: Any, watchdog: _Watchdog, markers: Path) -> LaunchError:
        if watchdog.fired:
            return _timeout_error(self.join_timeout_s, watchdog.still_running)
        rank, failure = min(exc.failures.items(), key=lambda kv: kv[1].timestamp)
        reported = _reported_failures(markers)
        if rank not in reported:
            # it died outside Python's reach (a signal, os._exit, an import error): the cause; the
            # others' errors are echoes of it
            return LaunchError(f"rank {rank} failed: {_failure_message(failure)}")
        first = min(reported, key=lambda r: reported[r][0])
        return LaunchError(f"rank {first} failed: {reported[first][1]}")


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

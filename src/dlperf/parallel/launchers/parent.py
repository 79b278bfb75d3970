"""What a launch changes in its own process, and puts back: torch's output, signal handlers, environment.

torch's elastic agent, its rendezvous and c10d write to the terminal: Python log records (a failed worker's
traceback block, warnings on every restart) and, from C++, log lines with their exception's stack frames.
While a launch runs, all of it goes to one log file instead, which the launch names in its error line if it
fails; the terminal keeps the workers' own output and dlperf's one line.
"""

from __future__ import annotations

import logging
import os
import re
import select
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..._threads import ServiceThread, cleanup_step

__all__ = ["ParentState"]

# torch's process context installs its own handlers for these in the main thread and leaves them there
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_FILTER_POLL_S = 0.05
_FILTER_DRAIN_READS = 64

# every log of torch.distributed (the elastic agent, rendezvous, c10d) goes to the launch's log file
_TORCH_LOGGER = "torch.distributed"
# loggers of the agent that log a failed worker's traceback
_AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")


class _PlainTracebacks(logging.Filter):
    """Formats a record's traceback with the standard formatter before torch's handler sees it.

    torch's log formatter imports torch._dynamo to format any traceback, seconds on a busy machine,
    spent between a worker's death and the teardown of the others.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            record.msg = f"{record.getMessage()}\n{logging.Formatter().formatException(record.exc_info)}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


# a line of torch's C++ log ("[W1125 19:11:23.767 TCPStore.cpp:340] ..."), and what follows one: the C++
# exception's text and its stack ("Exception raised from ...", "frame #3: ...")
_CPP_LOG = re.compile(rb"^\[?[EWIF]\d{4} \d\d:\d\d:\d\d\.\d+ ")
_CPP_TAIL = re.compile(rb"^(Exception raised from |frame #\d+|<omitting python frames>)")


class _StderrFilter:
    """Torch's C++ log lines and stack frames go to the launch's log file, everything else to stderr.

    C++ writes them to descriptor 2 itself, past Python's logging: while the launch runs, descriptor 2 is a
    pipe that this one thread reads line by line. The workers inherit it, so their own output passes through
    unchanged, and their C++ frames are kept off the terminal too.
    """

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.saved = -1
        self._thread: ServiceThread | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        # multiprocessing's resource tracker outlives the launch: it keeps the real stderr, not the pipe
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        try:
            read_end, write_end = os.pipe()
            self.saved = os.dup(2)
        except OSError:  # no descriptor 2, or none left: torch's lines stay where they go
            return
        sys.stderr.flush()
        os.dup2(write_end, 2)
        os.close(write_end)
        self._thread = ServiceThread(self._run, read_end, name="dlperf-launch-stderr")
        self._thread.start()

    def _lines(self, read_end: int) -> Iterator[bytes]:
        """The pipe's lines until its end, or until :meth:`stop` and what was written before it is read."""
        pending = b""
        drained = 0
        while True:
            ready, _, _ = select.select([read_end], [], [], _FILTER_POLL_S)
            chunk = os.read(read_end, 1 << 16) if ready else b""
            if ready and not chunk:  # every writer is gone
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line + b"\n"
            if self._stopping.is_set():
                drained += 1
                if not ready or drained > _FILTER_DRAIN_READS:  # a writer that never stops is not waited for
                    break
        if pending:
            yield pending

    def _run(self, read_end: int) -> None:
        try:
            self._filter(read_end)
        finally:
            os.close(read_end)

    def _filter(self, read_end: int) -> None:
        in_block = False
        with open(self.log_path, "ab") as log:
            for line in self._lines(read_end):
                if _CPP_LOG.match(line) or _CPP_TAIL.match(line):
                    in_block = True
                elif in_block and line.strip() and not line.startswith((b" ", b"\t")):
                    in_block = False
                if in_block:
                    log.write(line)
                    log.flush()
                    if not line.strip():
                        in_block = False
                else:
                    os.write(self.saved, line)

    def stop(self) -> None:
        if self._thread is None:
            return
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        # a process the launch started may still hold the pipe: the thread reads what is there and ends
        self._stopping.set()
        thread, self._thread = self._thread, None
        try:
            thread.join()  # raises what the filter raised: the lines it lost went nowhere
        finally:
            os.close(self.saved)


def _raise_signal(signum: int, frame: Any) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    raise SignalException(f"process {os.getpid()} got signal {signum}", sigval=signal.Signals(signum))


class _ProcessWide:
    """What a launch changes for the whole process (loggers, descriptor 2, the environment), held once.

    Launches may overlap (the planner keeps a process candidate's launch open on a thread while it starts
    the next): the first to start makes the changes and the last to end undoes them, since undoing each
    launch's own changes out of order would put back a pipe already closed or a variable an earlier agent
    set. Their torch lines share the first launch's log file, removed at the end unless a launch kept it.
    """

    _filter = _PlainTracebacks()

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.keep = False

    def enter(self, log_path: Path) -> Path:
        with self.lock:
            if self.users == 0:
                self._install(log_path)
            self.users += 1
            return self.log_path

    def exit(self, keep: bool) -> None:
        with self.lock:
            self.keep |= keep
            self.users -= 1
            if self.users == 0:
                self._remove()

    def _install(self, log_path: Path) -> None:
        self.log_path, self.keep = log_path, False
        for name in _AGENT_LOGGERS:
            logging.getLogger(name).addFilter(self._filter)
        self.log_handler = logging.FileHandler(log_path, delay=True, encoding="utf-8")
        self.log_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        # torch gives some of its loggers a handler of their own (to stderr): each of those writes to the file
        # instead while the launch runs; the others reach it through torch.distributed
        self.loggers: dict[str, tuple[list[logging.Handler], bool]] = {}
        for name, found in list(logging.Logger.manager.loggerDict.items()):
            if isinstance(found, logging.Logger) and found.handlers and name.startswith(_TORCH_LOGGER + "."):
                self.loggers[name] = (list(found.handlers), found.propagate)
        torch_log = logging.getLogger(_TORCH_LOGGER)
        self.loggers[_TORCH_LOGGER] = (list(torch_log.handlers), torch_log.propagate)
        for name in self.loggers:
            found = logging.getLogger(name)
            found.handlers = [self.log_handler]
            found.propagate = False
        self.stderr = _StderrFilter(log_path)
        self.stderr.start()
        self.env = dict(os.environ)

    def _remove(self) -> None:
        try:
            self.stderr.stop()
        finally:
            self._restore()

    def _restore(self) -> None:
        for name, (handlers, propagate) in self.loggers.items():
            found = logging.getLogger(name)
            found.handlers, found.propagate = handlers, propagate
        self.log_handler.close()
        for name in _AGENT_LOGGERS:
            logging.getLogger(name).removeFilter(self._filter)
        for k in set(os.environ) - set(self.env):
            del os.environ[k]
        for k, v in self.env.items():
            if os.environ.get(k) != v:
                os.environ[k] = v
        if not self.keep:
            self.log_path.unlink(missing_ok=True)


_PROCESS_WIDE = _ProcessWide()


class _SignalHandlers:
    """The launches that replaced this process's signal handlers (on the main thread), in the order they began.

    Each keeps the handlers it replaced. The latest to begin puts its own back when it ends; one that ends while
    a later one runs leaves the handlers to that one (they are its own, or its agent's) and hands it what it
    kept, so that the last to end puts back what was there before the first began, in any order of ending.
    Only the main thread changes handlers, so no lock is needed.
    """

    def __init__(self) -> None:
        self.launches: list[ParentState] = []

    def replace(self, launch: ParentState) -> None:
        launch.handlers = {}
        for name in _AGENT_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                launch.handlers[sig] = signal.getsignal(sig)
        self.launches.append(launch)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _raise_signal)

    def restore(self, launch: ParentState) -> None:
        at = next((i for i, found in enumerate(self.launches) if found is launch), None)
        if at is None:  # begun on another thread: it replaced nothing
            return
        del self.launches[at]
        if at < len(self.launches):
            self.launches[at].handlers = launch.handlers
        else:
            for sig, handler in launch.handlers.items():
                signal.signal(sig, handler)


_SIGNAL_HANDLERS = _SignalHandlers()


class ParentState:
    """The environment, signal handlers and log filters the launch changes in this process, put back after.

    torch's own log output (the agent's traceback blocks, the rendezvous' retries) goes to ``log_path``,
    never to the terminal (with overlapping launches, to the first one's file: :attr:`log_path` says which);
    SIGTERM and SIGHUP raise torch's ``SignalException`` from the start, so a launch stopped before the agent
    installs its handlers (in rendezvous) still unwinds and removes what it made; once the last launch begun on
    the main thread has ended, in whatever order, the handlers from before the first are back. Set :attr:`keep`
    to keep the log file once every launch has ended (it is removed otherwise).
    """

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.keep = False

    def __enter__(self) -> ParentState:
        self.log_path = _PROCESS_WIDE.enter(self.log_path)
        self.handlers: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            _SIGNAL_HANDLERS.replace(self)
        return self

    def logged(self) -> bool:
        """Whether torch wrote anything to the log file."""
        try:
            return self.log_path.stat().st_size > 0
        except OSError:
            return False

    def __exit__(self, *exc: object) -> None:
        leaving = exc[1] if len(exc) > 1 and isinstance(exc[1], BaseException) else None
        try:  # the stderr filter's error is raised after the handlers are back, and never instead of `leaving`
            with cleanup_step("the launch's stderr filter", leaving):
                _PROCESS_WIDE.exit(self.keep)
        finally:
            _SIGNAL_HANDLERS.restore(self)

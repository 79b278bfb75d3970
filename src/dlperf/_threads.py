"""Threads: the one place dlperf makes them, and per-thread intra-op budgets that do not leak.

:class:`ServiceThread` is how every dlperf thread is made (the engine's device workers, the launcher's
watchdog and stderr filter, the loader's producer, a kvstore server's control threads, the planner's
process candidates): a daemon thread named ``dlperf-...``, whose target's exception is kept and raised
by :meth:`ServiceThread.join` in the thread that waits for it, as well as reported when it dies. It lives
here, below every package, because the data loader and the budgets below need it too; the engine,
whose workers run on it, offers it as :class:`dlperf.engine.ServiceThread`. ``tests/test_threads.py``
fails if any other module constructs a thread.

``torch.set_num_threads`` sets the calling thread's OpenMP budget, but it also stores the value as
the process-wide default that every thread which has not used torch yet picks up on first use (a
user's thread, a DataLoader's). A worker that gives itself one thread must therefore put that
default back; the only setter also sets its caller's count, so a throw-away thread does it.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

__all__ = ["PREFIX", "ServiceThread", "cleanup_step", "fresh_thread_default", "intra_op_threads", "join_all",
           "on_fresh_thread", "restore_process_default", "set_thread_budget"]

log = logging.getLogger(__name__)

PREFIX = "dlperf-"
"""Every thread dlperf makes is named with this, so a leak or a stack dump names its owner."""

T = TypeVar("T")


class ServiceThread(threading.Thread):
    """A daemon thread running ``target(*args)``; what it raises is raised again by :meth:`join`.

    Daemon, because a thread of dlperf's must never keep the interpreter alive after the program
    ends: its owner stops and joins it on close. The target's result is kept in :attr:`result`. An
    error is reported through :func:`threading.excepthook` as the thread dies (once: a thread that dies
    unnoticed leaves its owner waiting for it, or running without it), and raised again by the join.

    Args:
        target: what the thread runs.
        *args: passed to ``target``.
        name: the thread's name, starting with ``dlperf-`` (a ValueError otherwise).

    >>> t = ServiceThread(lambda x: 1 / x, 4, name="dlperf-example")
    >>> t.start()
    >>> t.join(10)
    >>> t.result
    0.25
    """

    def __init__(self, target: Callable[..., Any], *args: Any, name: str) -> None:
        if not name.startswith(PREFIX):
            raise ValueError(f"thread name {name!r} does not start with {PREFIX!r}; name it after its owner, "
                             f"e.g. {PREFIX + name!r}")
        super().__init__(name=name, daemon=True)
        self._call: tuple[Callable[..., Any], tuple[Any, ...]] | None = (target, args)
        self.result: Any = None
        self.error: BaseException | None = None  # what the target raised, kept until a join raises it
        self._raised = False

    def run(self) -> None:
        assert self._call is not None
        target, args = self._call
        # dropped before the thread ends, as threading.Thread drops its target: a bound method would
        # keep its object (an engine, a server) alive for as long as this thread object is referenced
        self._call = None
        try:
            self.result = target(*args)
        except BaseException as exc:  # noqa: BLE001 - kept for join, which raises it in the owner's thread
            self.error = exc
            # and reported now, as threading reports any thread's death: an owner that joins only when it
            # closes (a worker's loop, a watchdog) would otherwise go on without this thread and say nothing
            threading.excepthook(threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, self)))
        finally:
            del target, args

    def join(self, timeout: float | None = None) -> None:
        """Wait until the thread ends, or ``timeout`` seconds; then raise what its target raised (once).

        A thread still running after ``timeout`` raises nothing: check :meth:`is_alive`.
        """
        super().join(timeout)
        if self.error is not None and not self._raised and not self.is_alive():
            self._raised = True
            raise self.error


def join_all(threads: Iterable[threading.Thread], timeout: float | None = None) -> None:
    """Join every thread (each up to ``timeout`` seconds), then raise the first error one of them raised.

    Every thread is waited for even when an earlier one failed, so a failure never leaves the rest running.
    """
    first: BaseException | None = None
    for thread in threads:
        if thread is threading.current_thread():
            continue
        try:
            thread.join(timeout)
        except BaseException as exc:  # noqa: BLE001 - the first is raised once all are joined
            first = first or exc
    if first is not None:
        raise first


class cleanup_step:  # noqa: N801 - used as a statement, like contextlib.suppress
    """Run a step of clean-up (a thread's stop and join) without letting its error hide an earlier one.

    An ``Exception`` the block raises is raised as usual when nothing else is, but when an error is already
    on its way out (the block runs in an ``except`` or ``finally`` clause) or ``pending`` is given (an error
    caught to be raised after the clean-up), that error wins: the step's is reported on stderr in one line
    (a thread's traceback was printed when it died) and the code after the block runs.

    Args:
        what: what the step stops, for the report (e.g. ``"the launch watchdog"``).
        pending: an error that will be raised once the clean-up is done, if any.
    """

    def __init__(self, what: str, pending: BaseException | None = None) -> None:
        self.what = what
        self.pending = pending

    def __enter__(self) -> None:
        if self.pending is None:
            self.pending = sys.exc_info()[1]

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> bool:
        if error is None or self.pending is None or not isinstance(error, Exception):
            return False
        first = (str(error).strip().splitlines() or [""])[0]
        log.warning("dlperf: %s failed too (%s: %s) while %s was raised; that is raised", self.what,
                    type(error).__name__, first, type(self.pending).__name__)
        return True


def on_fresh_thread(fn: Callable[..., T], *args: Any, name: str) -> T:
    """``fn(*args)`` on a new thread, waited for: its result, or what it raised."""
    thread = ServiceThread(fn, *args, name=name)
    thread.start()
    thread.join()
    return thread.result


def restore_process_default(n: int) -> None:
    """Make threads that have not used torch yet start with ``n`` intra-op threads again."""
    on_fresh_thread(torch.set_num_threads, n, name="dlperf-threads-reset")


def set_thread_budget(n: int, process_default: int) -> None:
    """Give the calling thread ``n`` intra-op threads; threads started later still get ``process_default``.

    Call it from the thread that should get the budget (a device worker), once, at its start.
    """
    torch.get_num_threads()  # initialise this thread from the current default before changing it
    torch.set_num_threads(n)
    if n != process_default:
        restore_process_default(process_default)


def fresh_thread_default() -> int:
    """The intra-op thread count a newly started thread gets (for tests and diagnostics)."""
    return on_fresh_thread(torch.get_num_threads, name="dlperf-threads-probe")


@contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads (None: leave them), then give the caller its count back.

    >>> import torch
    >>> before = torch.get_num_threads()
    >>> with intra_op_threads(1):
    ...     torch.get_num_threads()
    1
    >>> torch.get_num_threads() == before
    True
    """
    before = torch.get_num_threads()
    if n is None or n == before:  # nothing to change, so nothing to restore (set_num_threads is not free)
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

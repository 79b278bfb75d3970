"""Per-thread intra-op thread budgets that do not leak into threads started later.

``torch.set_num_threads`` sets the calling thread's OpenMP budget, but it also stores the value as
the process-wide default that every thread which has not used torch yet picks up on first use (a
user's thread, a DataLoader's). A worker that gives itself one thread must therefore put that
default back; the only setter also sets its caller's count, so a throw-away thread does it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def restore_process_default(n: int) -> None:
    """Make threads that have not used torch yet start with ``n`` intra-op threads again."""
    helper = threading.Thread(target=torch.set_num_threads, args=(n,), name="dlperf-threads-reset")
    helper.start()
    helper.join()


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
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(torch.get_num_threads()), name="dlperf-threads-probe")
    t.start()
    t.join()
    return out[0]


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

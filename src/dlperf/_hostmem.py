"""Host memory that stays in the process between training steps (glibc's malloc).

A CPU training step allocates its activations and gradients afresh every step: tensors of a few
to tens of megabytes. glibc serves a block larger than its mmap threshold with a fresh ``mmap`` and
returns it to the kernel when freed, and it gives the top of its heap back once more than the trim
threshold is free there. Both thresholds start low and adapt to the largest block freed so far, so
a loop's blocks can go back to the kernel every step, and come back as page faults that zero every
page again: LeNet, batch 256, 2 threads, in the main thread: 34.6 ms a step with 11,000 page faults,
21.9 ms with none once the thresholds are fixed (docs/design/measuring.md). Whether a loop hits that depends
on the order its blocks happened to be freed in, so the same loop's time is bimodal run to run.

:func:`keep_freed_host_memory` fixes the thresholds where glibc's own rule would end (32 MiB, the
largest it allows, and twice that for trimming): blocks up to 32 MiB are reused from the heap,
and at most 64 MiB of free memory stays at its top. Peak memory is unchanged (the same blocks are
live at the peak); only freed memory is kept for the next step. dlperf's commands call it at
start (``DLPERF_HOST_MALLOC=system`` leaves the C library's defaults alone); the library never
changes the process's allocator on import. Other C libraries (musl, macOS) are left as they are.
"""

from __future__ import annotations

import ctypes
import os
import sys

from .errors import UsageError

__all__ = ["keep_freed_host_memory", "host_malloc_state", "is_glibc", "HOST_MALLOC_ENV", "MMAP_THRESHOLD_BYTES",
           "TRIM_THRESHOLD_BYTES"]

HOST_MALLOC_ENV = "DLPERF_HOST_MALLOC"
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit machines
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES  # what glibc's adaptive rule sets beside it

# <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_applied: bool | None = None  # None: not asked yet in this process


def keep_freed_host_memory() -> bool:
    """Keep freed blocks of up to 32 MiB in the process (glibc); True if the allocator was tuned.

    Idempotent. Returns False, changing nothing, under another C library, when
    ``DLPERF_HOST_MALLOC=system`` is set, or if glibc refuses the values.
    """
    global _applied
    choice = _choice()  # checked at every call: a bad value is one clear error wherever it is met
    if _applied is not None:
        return _applied
    _applied = False
    if choice == "system" or not is_glibc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _applied


def is_glibc() -> bool:
    """Whether this process runs on glibc (whose malloc these settings are for)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
        return version is not None and version.startswith("glibc")
    except (ValueError, OSError):  # another C library does not know the name
        return False


def _choice() -> str:
    value = os.environ.get(HOST_MALLOC_ENV, "")
    choice = value.strip().lower() or "keep"
    if choice not in ("keep", "system"):
        raise UsageError(f"{HOST_MALLOC_ENV}={value!r} is not valid; expected 'keep' (the default: freed "
                         f"blocks stay in the process) or 'system' (the C library's defaults)")
    return choice


def host_malloc_state() -> str:
    """One line for reports: how host memory is allocated in this process."""
    if _applied:
        return (f"glibc malloc keeps freed blocks up to {MMAP_THRESHOLD_BYTES >> 20} MiB "
                f"({HOST_MALLOC_ENV}=system: the C library's defaults)")
    return "the C library's malloc defaults"

"""dlperf: fast deep-learning training on the hardware you have, and where the time goes.

The top level re-exports the device API (d2l's vocabulary); the capabilities live in
subpackages: :mod:`dlperf.models`, :mod:`dlperf.bench`, and the others listed in README.md.
"""

from __future__ import annotations

from ._hostmem import keep_freed_host_memory
from .devices import (
    Device,
    as_in,
    check_same_device,
    copy_to,
    cpu,
    device_of,
    gpu,
    num_gpus,
    to_device,
    try_all_gpus,
    try_gpu,
)
from .errors import DlperfError, UsageError

__version__ = "0.1.0"

__all__ = [
    "Device",
    "DlperfError",
    "UsageError",
    "as_in",
    "check_same_device",
    "copy_to",
    "cpu",
    "device_of",
    "gpu",
    "keep_freed_host_memory",
    "num_gpus",
    "to_device",
    "try_all_gpus",
    "try_gpu",
]

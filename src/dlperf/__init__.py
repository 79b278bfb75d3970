"""dlperf: fast deep-learning training on the hardware you have, and where the time goes.

The top level re-exports the device API (d2l's vocabulary) and :class:`Loop`, the entry for training loops of
the user's own; the capabilities live in subpackages: :mod:`dlperf.models`, :mod:`dlperf.bench`, and the others
listed in README.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._hostmem import keep_freed_host_memory
from .errors import DlperfError, UsageError

if TYPE_CHECKING:
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
    from .parallel.training.own_loop import Loop, LoopTuning

# The device API imports torch, which takes a second or more: it is loaded on first use, so that
# `dlperf` can answer Ctrl-C (or --help) during start-up in one line instead of a traceback from
# inside `import torch`.
_DEVICE_NAMES = frozenset({
    "Device", "as_in", "check_same_device", "copy_to", "cpu", "device_of", "gpu", "num_gpus", "to_device",
    "try_all_gpus", "try_gpu",
})
_LOOP_NAMES = frozenset({"Loop", "LoopTuning"})


def __getattr__(name: str) -> Any:
    if name in _DEVICE_NAMES:
        from . import devices

        return getattr(devices, name)
    if name in _LOOP_NAMES:  # the façade re-exports the entry for users' own loops, loaded on first use
        from .parallel.training import own_loop

        return getattr(own_loop, name)
    raise AttributeError(f"module 'dlperf' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _DEVICE_NAMES | _LOOP_NAMES)


__version__ = "0.1.0"

__all__ = [
    "Device",
    "DlperfError",
    "Loop",
    "LoopTuning",
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

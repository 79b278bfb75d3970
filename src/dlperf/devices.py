"""Devices: where a tensor lives and where an operation runs.

Vocabulary (d2l calls these *contexts*; PyTorch calls them *devices*):

* ``cpu(i)`` is a **logical CPU device**. All logical CPU devices share host memory and the same
  ``torch.device('cpu')``, but dlperf treats them as distinct, so multi-device code (data
  parallelism, the engine's per-device workers) runs and is tested on a machine without GPUs.
  A tensor's logical CPU device is recorded on the tensor (*tagged*, see :func:`tag`) when
  :func:`copy_to` or :func:`as_in` puts it there; an untagged host tensor belongs to ``cpu(0)``.
* ``gpu(i)`` is CUDA device ``i``. Creating ``gpu(3)`` on a machine with one GPU is allowed (as in
  d2l); using it raises :class:`~dlperf.errors.DeviceUnavailableError`.

Examples:
    >>> from dlperf.devices import cpu, try_gpu, as_in, copy_to
    >>> import torch
    >>> x = torch.ones(2)
    >>> as_in(x, cpu(0)) is x          # already there: the same object
    True
    >>> copy_to(x, cpu(0)) is x        # always a new copy
    False
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from .errors import DeviceMismatchError, DeviceUnavailableError, UsageError

__all__ = [
    "Device",
    "DeviceLike",
    "cpu",
    "gpu",
    "num_gpus",
    "try_gpu",
    "try_all_gpus",
    "to_device",
    "device_of",
    "as_in",
    "copy_to",
    "tag",
    "check_same_device",
    "require_available",
    "cpu_count",
]

# Attribute that records a tensor's or module's logical CPU device. Plain attributes are used
# because they cost nothing on the hot path; results of ordinary torch ops are untagged and so
# count as cpu(0) unless code that knows better (a device worker) tags them.
_LOGICAL_CPU_ATTR = "_dlperf_cpu_index"


@dataclass(frozen=True, order=True)
class Device:
    """A device: ``Device("cpu", 1)`` is ``cpu(1)``, ``Device("gpu", 0)`` is ``gpu(0)``."""

    kind: str
    index: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "gpu"):
            raise UsageError(f"device kind {self.kind!r} is not valid; expected 'cpu' or 'gpu'")
        if not isinstance(self.index, int) or self.index < 0:
            raise UsageError(f"device index {self.index!r} is not valid; expected an integer >= 0")

    @property
    def torch_device(self) -> torch.device:
        """The PyTorch device that holds this device's memory."""
        if self.kind == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", self.index)

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    def synchronize(self) -> None:
        """Block until all work queued on this device has finished (no-op on the CPU)."""
        if self.is_gpu:
            torch.cuda.synchronize(self.torch_device)

    def __repr__(self) -> str:
        return f"{self.kind}({self.index})"

    __str__ = __repr__


DeviceLike = Device | torch.device | str

_SPEC = re.compile(r"^\s*(cpu|gpu|cuda)\s*(?::\s*(\d+)|\(\s*(\d+)\s*\))?\s*$", re.IGNORECASE)
_VALID_SPECS = "cpu, cpu:N, cpu(N), gpu, gpu:N, gpu(N), cuda, cuda:N, or a torch.device"


def cpu(i: int = 0) -> Device:
    """Logical CPU device ``i`` (all share host memory)."""
    return Device("cpu", i)


def gpu(i: int = 0) -> Device:
    """CUDA device ``i``; it need not exist until used."""
    return Device("gpu", i)


def num_gpus() -> int:
    """How many CUDA devices this process can see."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def try_gpu(i: int = 0) -> Device:
    """``gpu(i)`` if it exists, else ``cpu()``.

    >>> try_gpu(99)
    cpu(0)
    """
    return gpu(i) if i < num_gpus() else cpu()


def try_all_gpus() -> list[Device]:
    """Every GPU, or ``[cpu()]`` when there is none."""
    n = num_gpus()
    return [gpu(i) for i in range(n)] if n else [cpu()]


def cpu_count() -> int:
    """Cores this process may run on (respects affinity masks and containers' CPU sets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def to_device(spec: DeviceLike) -> Device:
    """Parse a device given as a :class:`Device`, a ``torch.device`` or a string.

    >>> to_device("cuda:1"), to_device("gpu(1)"), to_device("cpu:1"), to_device("cpu")
    (gpu(1), gpu(1), cpu(1), cpu(0))
    """
    if isinstance(spec, Device):
        return spec
    if isinstance(spec, torch.device):
        if spec.type == "cpu":
            return cpu(spec.index or 0)
        if spec.type == "cuda":
            if spec.index is not None:
                return gpu(spec.index)
            # torch.device("cuda") means the current device; without CUDA there is none to ask.
            return gpu(torch.cuda.current_device() if torch.cuda.is_available() else 0)
        raise UsageError(f"device {str(spec)!r} is not supported; expected {_VALID_SPECS}")
    if isinstance(spec, str):
        m = _SPEC.match(spec)
        if m:
            kind = "cpu" if m.group(1).lower() == "cpu" else "gpu"
            return Device(kind, int(m.group(2) or m.group(3) or 0))
    raise UsageError(f"device {spec!r} is not valid; expected {_VALID_SPECS}")


def require_available(device: DeviceLike) -> Device:
    """Return the parsed device, or raise a clear error when this machine lacks it."""
    dev = to_device(device)
    if dev.is_gpu and dev.index >= num_gpus():
        have = num_gpus()
        raise DeviceUnavailableError(
            f"{dev} was requested but this machine has {have} GPU{'s' if have != 1 else ''}"
            f"{' (CUDA is not available to PyTorch)' if have == 0 else ''}; "
            f"use try_gpu() to fall back to the CPU, or pick one of: "
            + ", ".join(str(d) for d in [cpu(), *(gpu(i) for i in range(have))])
        )
    return dev


TagT = TypeVar("TagT", torch.Tensor, nn.Module)


def tag(x: TagT, device: DeviceLike) -> TagT:
    """Record that ``x`` (a host tensor or a module) belongs to ``device``; return ``x`` itself.

    Tagging moves no data. Logical CPU devices share host memory, so a host tensor's
    ``torch.device`` cannot say which of them holds it; the tag can, and :func:`device_of`
    reads it. Tagging a module tags it and every parameter and buffer it has now. The tag is a
    plain attribute of the tensor object: results of torch ops are untagged (``cpu(0)``) unless
    code that knows better tags them, and a view made with ``t.view(t.shape)`` is a separate
    object that can be tagged without touching ``t``. On a GPU the CUDA device already says where
    a tensor is, so tagging with ``gpu(i)`` changes nothing.

    >>> t = torch.zeros(3)
    >>> part = tag(t.view(t.shape), cpu(1))   # same memory, another logical device
    >>> device_of(part), device_of(t)
    (cpu(1), cpu(0))
    >>> device_of(tag(nn.Linear(2, 2), "cpu:2").weight)
    cpu(2)
    """
    dev = device if isinstance(device, Device) else to_device(device)
    if dev.kind != "cpu":
        return x
    setattr(x, _LOGICAL_CPU_ATTR, dev.index)
    if isinstance(x, nn.Module):
        for t in (*x.parameters(), *x.buffers()):
            setattr(t, _LOGICAL_CPU_ATTR, dev.index)
    return x


def device_of(x: torch.Tensor | nn.Module) -> Device:
    """The dlperf device of a tensor or module (a module's first parameter or buffer decides)."""
    if isinstance(x, nn.Module):
        tagged = getattr(x, _LOGICAL_CPU_ATTR, None)
        first = next(iter((*x.parameters(), *x.buffers())), None)
        if first is None:
            return cpu(tagged or 0)
        if first.device.type == "cpu" and tagged is not None:
            return cpu(tagged)
        return device_of(first)
    if not isinstance(x, torch.Tensor):
        raise UsageError(f"expected a torch.Tensor or nn.Module, got {type(x).__name__}")
    if x.device.type == "cpu":
        return cpu(getattr(x, _LOGICAL_CPU_ATTR, 0))
    return to_device(x.device)


T = TypeVar("T", torch.Tensor, nn.Module)


def copy_to(x: T, device: DeviceLike) -> T:
    """Always return a new copy of ``x`` on ``device`` (d2l's ``copyto``).

    Modules are deep-copied, so the original keeps its parameters.
    """
    dev = require_available(device)
    if isinstance(x, nn.Module):
        out = copy.deepcopy(x).to(dev.torch_device)
        return tag(out, dev)
    if not isinstance(x, torch.Tensor):
        raise UsageError(f"copy_to expects a torch.Tensor or nn.Module, got {type(x).__name__}")
    return tag(x.to(dev.torch_device, copy=True), dev)


def as_in(x: T, device: DeviceLike) -> T:
    """Return ``x`` itself if it is already on ``device``, else a copy there (d2l's ``as_in_ctx``).

    Unlike ``copy_to``, no memory is spent when nothing has to move, so changes through the
    result are visible in ``x`` exactly when no copy was needed.
    """
    dev = require_available(device)
    if device_of(x) == dev:
        return x
    return copy_to(x, dev)


def check_same_device(*operands: torch.Tensor, names: tuple[str, ...] | None = None,
                      op: str = "this operation") -> Device:
    """Raise one clear error when tensors live on different devices; return their common device.

    0-d CPU tensors act as scalars and are allowed beside any device, as in PyTorch.

    >>> check_same_device(torch.ones(1), torch.ones(1))
    cpu(0)
    """
    if names is None:
        names = tuple(f"operand {i}" for i in range(len(operands)))
    placed = [(n, t, device_of(t)) for n, t in zip(names, operands)
              if not (t.dim() == 0 and t.device.type == "cpu")]
    if not placed:
        return cpu()
    first_dev = placed[0][2]
    if all(d == first_dev for _, _, d in placed):
        return first_dev
    where = ", ".join(f"{n} on {d}" for n, _, d in placed)
    off = next(n for n, _, d in placed if d != first_dev)
    raise DeviceMismatchError(
        f"{op} needs all operands on one device, but got {where}; move them first, "
        f"e.g. {off} = dlperf.as_in({off}, {first_dev})"
    )

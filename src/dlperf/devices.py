"""Devices: where a tensor lives and where an operation runs.

Vocabulary (d2l calls these *contexts*; PyTorch calls them *devices*):

* ``cpu(i)`` is a **logical CPU device**. All logical CPU devices share host memory and the same
  ``torch.device('cpu')``, but dlperf treats them as distinct, so multi-device code (data
  parallelism, the engine's per-device workers) runs and is tested on a machine without GPUs.
  A tensor's logical CPU device is recorded on the tensor (*tagged*, see :func:`tag`) when
  :func:`copy_to`, :func:`as_in` or ``split_and_load`` puts it there, and it follows the tensor
  through torch operations and autograd: ``copy_to(x, cpu(1)) * 2`` is on ``cpu(1)``, and so is
  the gradient of a parameter on ``cpu(1)``. An untagged host tensor belongs to ``cpu(0)``.
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
from typing import Any, TypeVar, cast

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
    "LogicalCpuTensor",
    "LogicalCpuParameter",
    "check_same_device",
    "require_available",
    "cpu_count",
]

# Attribute that records a logical CPU device: a class attribute of LogicalCpuTensor's per-device
# classes, an instance attribute of tagged modules, parameters and buffers.
_LOGICAL_CPU_ATTR = "_dlperf_cpu_index"


_DEVICES: dict[tuple[str, int], Device] = {}


@dataclass(frozen=True, order=True)
class Device:
    """A device: ``Device("cpu", 1)`` is ``cpu(1)``, ``Device("gpu", 0)`` is ``gpu(0)``."""

    kind: str
    index: int = 0

    # One object per device: the engine's hot paths compare devices by identity (`is` costs a
    # pointer comparison, dataclass `==` builds two tuples), so every way of naming cpu(1) (the
    # constructor, cpu(1), "cpu:1", a copy, a pickle) must give the same object.
    def __new__(cls, kind: str, index: int = 0) -> Device:
        # Only exact types hit the cache: __init__ runs again on what this returns, and must not
        # store an equal stand-in (True for 1) in the shared object.
        dev = _DEVICES.get((kind, index)) if type(index) is int and type(kind) is str else None
        return dev if dev is not None else super().__new__(cls)

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "gpu"):
            raise UsageError(f"device kind {self.kind!r} is not valid; expected 'cpu' or 'gpu'")
        if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
            raise UsageError(f"device index {self.index!r} is not valid; expected an integer >= 0")
        _DEVICES.setdefault((self.kind, self.index), self)

    def __reduce__(self) -> tuple:
        return (Device, (self.kind, self.index))

    def __copy__(self) -> Device:
        return self

    def __deepcopy__(self, memo: dict) -> Device:
        return self

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


def try_all_gpus(k: int | None = None) -> list[Device]:
    """Every GPU, or ``[cpu()]`` when there is none; with ``k``, exactly ``k`` distinct devices.

    ``try_all_gpus(k)`` is the first ``k`` GPUs when the machine has that many, else the logical
    CPU devices ``cpu(0)`` ... ``cpu(k-1)``, so multi-device code (d2l's
    ``[try_gpu(i) for i in range(k)]``, which repeats ``cpu(0)`` without GPUs) runs anywhere.
    It never mixes GPUs with CPU devices: data-parallel replicas should be alike.

    >>> try_all_gpus(2) if num_gpus() < 2 else [cpu(0), cpu(1)]
    [cpu(0), cpu(1)]
    """
    n = num_gpus()
    if k is None:
        return [gpu(i) for i in range(n)] if n else [cpu()]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UsageError(f"try_all_gpus(k={k!r}) is not valid; expected a number of devices >= 1, "
                         "or no argument for every GPU")
    return [gpu(i) for i in range(k)] if n >= k else [cpu(i) for i in range(k)]


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


_plain_call = torch._C._disabled_torch_function_impl

# Accessors whose tensor result must not take the caller's device: ``_base`` returns the tensor a
# view was made from (the caller's, possibly untagged, object), ``as_subclass`` asks for a class.
_KEEP_RESULT = frozenset({cast(Any, torch.Tensor)._base.__get__, torch.Tensor.as_subclass})  # _base: a property


def _is_argument(out: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    for a in args:
        if a is out:
            return True
        if type(a) is list or type(a) is tuple:
            for b in a:
                if b is out:
                    return True
    return any(v is out for v in kwargs.values())


def _operand_index(a: object) -> int | None:
    """A tensor operand's logical CPU index, or None where it does not decide (not a tensor, a 0-d host scalar)."""
    if isinstance(a, LogicalCpuTensor):
        return a._dlperf_cpu_index
    if isinstance(a, torch.Tensor) and (a.dim() or not a.is_cpu):
        return 0
    return None


def _result_index(args: tuple, kwargs: dict) -> int:
    """The device of the first tensor operand, as torch decides for real devices; 0-d host tensors are scalars."""
    for a in args:
        if type(a) is list or type(a) is tuple:
            for b in a:
                index = _operand_index(b)
                if index is not None:
                    return index
        else:
            index = _operand_index(a)
            if index is not None:
                return index
    for a in kwargs.values():
        index = _operand_index(a)
        if index is not None:
            return index
    return 0


class LogicalCpuTensor(torch.Tensor):
    """A host tensor on logical CPU device ``cpu(i)``, ``i >= 1``; torch ops on it give such tensors.

    Propagating the device costs one Python call per operation (2-5 us, docs/from-the-book.md),
    and only on tagged tensors: plain tensors (``cpu(0)``, the common case) never reach this code.
    A result is on the device of the first tensor operand (0-d host tensors act as scalars), where
    torch would put it on real devices; logical CPU devices share memory, so mixing them does not
    fail here:
    :func:`check_same_device` does that. ``.grad`` of a tagged tensor is tagged when read.
    Pickling and ``torch.save`` store a plain tensor (like ``map_location="cpu"``), so files load
    with ``weights_only=True``.
    """

    _dlperf_cpu_index: int

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        out = _plain_call(func, types, args, kwargs)
        if func in _KEEP_RESULT:
            return out
        if type(out) is torch.Tensor:
            if out.is_cpu and not _is_argument(out, args, kwargs):
                index = _result_index(args, kwargs)
                if index:
                    out.__class__ = LogicalCpuTensor
                    out._dlperf_cpu_index = index
        elif isinstance(out, (tuple, list)) and out and type(out[0]) is torch.Tensor:
            # split, chunk, unbind, max(dim); not tolist() or shape, whose items are numbers
            index = _result_index(args, kwargs)
            for o in out if index else ():
                if type(o) is torch.Tensor and o.is_cpu and not _is_argument(o, args, kwargs):
                    o.__class__ = LogicalCpuTensor
                    o._dlperf_cpu_index = index
        return out

    def _plain(self) -> torch.Tensor:
        alias = _plain_call(torch.Tensor.detach, (), (self,), {})
        return alias.requires_grad_(self.requires_grad) if self.is_leaf else alias

    def __reduce_ex__(self, proto):
        return self._plain().__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        alias = self._plain()
        grad = self.grad
        if grad is not None:
            alias.grad = _plain_call(torch.Tensor.detach, (), (grad,), {})
        new = copy.deepcopy(alias, memo)
        new.__class__ = type(self)
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        memo[id(self)] = new
        return new

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # same as torch.Tensor's
        text = repr(self._plain())
        return f"{text[:-1]}, device=cpu({self._dlperf_cpu_index}))"


class LogicalCpuParameter(LogicalCpuTensor, nn.Parameter):
    """An ``nn.Parameter`` on logical CPU device ``cpu(i)``, ``i >= 1``: its results and gradient are there too."""

    def __reduce_ex__(self, proto):
        return nn.Parameter(self._plain(), self.requires_grad).__reduce_ex__(proto)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # same as torch.Tensor's
        return "Parameter containing:\n" + LogicalCpuTensor.__repr__(self)


# class of a tensor on cpu(0) (untagged) -> its class on cpu(i), i >= 1, and back
_ON_LOGICAL_CPU: dict[type, type] = {torch.Tensor: LogicalCpuTensor, nn.Parameter: LogicalCpuParameter}
_ON_CPU0: dict[type, type] = {LogicalCpuTensor: torch.Tensor, LogicalCpuParameter: nn.Parameter}


def _tag_tensor(t: torch.Tensor, index: int) -> None:
    kind = type(t)
    on_cpu0 = _ON_CPU0.get(kind, kind)
    target = _ON_LOGICAL_CPU.get(on_cpu0) if index else on_cpu0
    if target is None:  # another tensor subclass: keep its class, record the device beside it
        setattr(t, _LOGICAL_CPU_ATTR, index)
        return
    if index:
        t.__class__ = target
        setattr(t, _LOGICAL_CPU_ATTR, index)
    else:
        t.__dict__.pop(_LOGICAL_CPU_ATTR, None)
        t.__class__ = target


TagT = TypeVar("TagT", torch.Tensor, nn.Module)


def tag(x: TagT, device: DeviceLike) -> TagT:
    """Record that ``x`` (a host tensor or a module) belongs to ``device``; return ``x`` itself.

    Tagging moves no data. Logical CPU devices share host memory, so a host tensor's
    ``torch.device`` cannot say which of them holds it; the tag can, and :func:`device_of`
    reads it. A tagged tensor becomes a :class:`LogicalCpuTensor` (a parameter a
    :class:`LogicalCpuParameter`, still an ``nn.Parameter``; tagging with ``cpu(0)`` makes them
    plain again), and results of torch operations on it, views and its gradient carry the tag too.
    A view made with ``t.view(t.shape)`` is a separate object that can be tagged without touching
    ``t``. Tagging a module tags it and every parameter and buffer it has now. On a GPU the CUDA
    device already says where a tensor is, so tagging with ``gpu(i)`` changes nothing.

    >>> t = torch.zeros(3)
    >>> part = tag(t.view(t.shape), cpu(1))   # same memory, another logical device
    >>> device_of(part), device_of(t), device_of(part * 2 + 1)
    (cpu(1), cpu(0), cpu(1))
    >>> device_of(tag(nn.Linear(2, 2), "cpu:2").weight)
    cpu(2)
    """
    dev = device if isinstance(device, Device) else to_device(device)
    if dev.kind != "cpu":
        return x
    if isinstance(x, nn.Module):
        setattr(x, _LOGICAL_CPU_ATTR, dev.index)
        for t in (*x.parameters(), *x.buffers()):
            if t.is_cpu:
                _tag_tensor(t, dev.index)
        return x
    if not isinstance(x, torch.Tensor):
        raise UsageError(f"tag expects a torch.Tensor or nn.Module, got {type(x).__name__}")
    if x.is_cpu:
        _tag_tensor(x, dev.index)
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

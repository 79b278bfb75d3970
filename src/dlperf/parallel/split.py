"""Split a mini-batch along its first axis and place each part on one device (d2l 12.5.5).

Parts are equal unless ``even_split=False`` (Gluon's rule). The parts' tags follow them through
the forward and backward (see :mod:`dlperf.devices`), so a loss computed from the part on ``cpu(1)``
is on ``cpu(1)`` too.

On logical CPU devices the parts are *views* of the batch tagged with their device: host memory is
shared, so a copy would cost memory bandwidth and buy nothing. On GPUs each part is copied with
``non_blocking=True``; from pinned host memory that copy overlaps with compute already queued.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..devices import Device, DeviceLike, device_of, require_available, tag, to_device
from ..errors import DeviceMismatchError, UsageError

__all__ = ["split_sizes", "split_and_load", "split_batch", "place_parts", "check_devices", "check_placed"]


def check_devices(devices: Sequence[DeviceLike]) -> list[Device]:
    """Parse a device list; raise one clear error for an empty list, a duplicate or an absent GPU.

    >>> check_devices(["cpu:0", "cpu:1"])
    [cpu(0), cpu(1)]
    """
    if isinstance(devices, (str, Device, torch.device)):
        devices = [devices]
    parsed = [to_device(d) for d in devices]
    if not parsed:
        raise UsageError("the device list is empty; give at least one device, e.g. [cpu(0)]")
    seen: set[Device] = set()
    for d in parsed:
        if d in seen:
            raise UsageError(f"device {d} is listed twice in {parsed}; each device may appear once")
        seen.add(d)
    return [require_available(d) for d in parsed]


def split_sizes(n: int, k: int) -> list[int]:
    """Sizes of ``k`` near-equal parts of ``n`` rows; the first ``n % k`` parts get one extra row.

    >>> split_sizes(10, 3)
    [4, 3, 3]
    """
    if k < 1:
        raise UsageError(f"cannot split across {k} devices; need at least one")
    if n < k:
        raise UsageError(f"a batch of {n} example{'s' if n != 1 else ''} cannot be split across {k} "
                         f"devices: each device needs at least one; use a batch of at least {k}")
    base, extra = divmod(n, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def _place(part: torch.Tensor, dev: Device) -> torch.Tensor:
    if dev.is_gpu:
        # non_blocking only overlaps when the source is pinned host memory; otherwise it is a sync copy.
        return part.to(dev.torch_device, non_blocking=True)
    if part.device.type != "cpu":
        part = part.to("cpu")
    else:
        part = part.view(part.shape)  # a fresh view object, so the tag does not touch the caller's tensor
    return tag(part, dev)


def _check_even(n: int, k: int, even_split: bool, what: str) -> list[int]:
    sizes = split_sizes(n, k)
    if even_split and n % k:
        raise UsageError(f"{what} cannot split {n} examples evenly across {k} devices "
                         f"({' + '.join(map(str, sizes))}); pass even_split=False to allow parts of "
                         f"different sizes, or use a batch size divisible by {k}")
    return sizes


def split_and_load(batch: torch.Tensor, devices: Sequence[DeviceLike], even_split: bool = True) -> list[torch.Tensor]:
    """Split ``batch`` along dim 0 into one equal part per device and put each part there.

    As in Gluon, a batch that does not divide evenly is an error unless ``even_split=False``, which
    gives the first ``n % k`` parts one extra row: silently unequal parts would weight the devices'
    gradients unequally in code that averages per device.

    >>> from dlperf.devices import cpu, device_of
    >>> parts = split_and_load(torch.arange(20).reshape(4, 5), [cpu(0), cpu(1)])
    >>> [tuple(p.shape) for p in parts], [device_of(p) for p in parts]
    ([(2, 5), (2, 5)], [cpu(0), cpu(1)])
    >>> [len(p) for p in split_and_load(torch.zeros(5, 2), [cpu(0), cpu(1)], even_split=False)]
    [3, 2]
    """
    devs = check_devices(devices)
    if not isinstance(batch, torch.Tensor):
        raise UsageError(f"split_and_load expects a torch.Tensor, got {type(batch).__name__}")
    if batch.dim() == 0:
        raise UsageError("split_and_load needs a batch with a first (example) axis; got a 0-d tensor")
    sizes = _check_even(batch.shape[0], len(devs), even_split, "split_and_load")
    return place_parts(batch, devs, sizes)


def place_parts(batch: torch.Tensor, devices: Sequence[Device], sizes: Sequence[int]) -> list[torch.Tensor]:
    """``batch`` cut into parts of ``sizes`` rows, part i placed on ``devices[i]`` (checked devices, valid sizes).

    The per-step path of a trainer whose devices were checked once: it skips parsing them again.
    """
    return [_place(p, d) for p, d in zip(torch.split(batch, list(sizes)), devices)]


def split_batch(X: torch.Tensor, y: torch.Tensor, devices: Sequence[DeviceLike],
                even_split: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split features and labels the same way (d2l's ``split_batch``); ``even_split`` as in :func:`split_and_load`.

    >>> from dlperf.devices import cpu
    >>> Xs, ys = split_batch(torch.zeros(5, 2), torch.arange(5), [cpu(0), cpu(1)], even_split=False)
    >>> [len(t) for t in ys]
    [3, 2]
    """
    if X.shape[0] != y.shape[0]:
        raise UsageError(f"features have {X.shape[0]} examples but labels have {y.shape[0]}; they must match")
    return split_and_load(X, devices, even_split), split_and_load(y, devices, even_split)


def check_placed(parts: Sequence[torch.Tensor], devices: Sequence[Device], what: str = "input") -> None:
    """Raise :class:`DeviceMismatchError` unless ``parts[i]`` lives on ``devices[i]``."""
    if len(parts) != len(devices):
        raise UsageError(f"got {len(parts)} {what} parts for {len(devices)} devices; give one per device")
    for i, (p, d) in enumerate(zip(parts, devices)):
        have = device_of(p)
        if have != d:
            raise DeviceMismatchError(
                f"{what} part {i} is on {have} but its replica is on {d}; "
                f"split the batch with split_and_load(batch, devices) or move it with dlperf.as_in(x, {d})")

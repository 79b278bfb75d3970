"""Split a mini-batch along its first axis (or another) and place each part on one device (d2l 12.5.5).

A mini-batch is what PyTorch users pass a model: a tensor, or a tuple, list or dict of tensors of any
dtype (see :mod:`dlperf.batch`).

Parts are equal unless ``even_split=False`` (Gluon's rule). The parts' tags follow them through
the forward and backward (see :mod:`dlperf.devices`), so a loss computed from the part on ``cpu(1)``
is on ``cpu(1)`` too.

On logical CPU devices the parts are *views* of the batch tagged with their device: host memory is
shared, so a copy would cost memory bandwidth and buy nothing. On GPUs each part is copied with
``non_blocking=True``; from pinned host memory that copy overlaps with compute already queued.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..batch import Batch, batch_size, describe, split_tree, tensors_of
from ..devices import Device, DeviceLike, device_of, require_available, tag, to_device
from ..errors import DeviceMismatchError, UsageError

__all__ = ["split_sizes", "split_and_load", "split_data", "split_batch", "split_step", "place_parts",
           "check_devices", "check_placed"]


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


def split_and_load(batch: Batch, devices: Sequence[DeviceLike], even_split: bool = True, *,
                   batch_axis: int = 0) -> list[Batch]:
    """Split ``batch`` along ``batch_axis`` into one equal part per device and put each part there.

    ``batch`` is a tensor or a tuple, list or dict (nested) of them, of any dtype: every tensor with
    a first axis is cut along it, and 0-d tensors and plain values (strings, ints, None) go to every
    part, as DDP's scatter does (:func:`dlperf.batch.split_tree`). As in Gluon, a batch that does not
    divide evenly is an error unless ``even_split=False``, which gives the first ``n % k`` parts one
    extra row: silently unequal parts would weight the devices' gradients unequally in code that
    averages per device. ``batch_axis`` (Gluon's, for a tensor batch) cuts along another axis, e.g. 1
    for a time-major sequence batch.

    >>> from dlperf.devices import cpu, device_of
    >>> parts = split_and_load(torch.arange(20).reshape(4, 5), [cpu(0), cpu(1)])
    >>> [tuple(p.shape) for p in parts], [device_of(p) for p in parts]
    ([(2, 5), (2, 5)], [cpu(0), cpu(1)])
    >>> [len(p) for p in split_and_load(torch.zeros(5, 2), [cpu(0), cpu(1)], even_split=False)]
    [3, 2]
    >>> [tuple(p.shape) for p in split_and_load(torch.zeros(7, 4), [cpu(0), cpu(1)], batch_axis=1)]
    [(7, 2), (7, 2)]
    >>> [describe(p) for p in split_and_load({"ids": torch.zeros(4, 3, dtype=torch.int64), "lang": "en"},
    ...                                      [cpu(0), cpu(1)])]
    ['dict{ids: int64[2,3], lang: str}', 'dict{ids: int64[2,3], lang: str}']
    """
    devs = check_devices(devices)
    if batch_axis != 0:
        axis = _tensor_axis(batch, batch_axis, "split_and_load")
        sizes = _check_even(batch.shape[axis], len(devs), even_split, "split_and_load")
        return [_place(p, d) for p, d in zip(torch.split(batch, sizes, dim=axis), devs)]
    sizes = _check_even(batch_size(batch, "batch split_and_load was given"), len(devs), even_split, "split_and_load")
    return place_parts(batch, devs, sizes)


def split_data(data: Batch, num_slice: int, batch_axis: int = 0, even_split: bool = True) -> list[Batch]:
    """``data`` cut into ``num_slice`` parts along ``batch_axis``, left where it is (Gluon's ``split_data``).

    The parts are views of ``data`` (see :func:`split_and_load` for the rules, and for placing the parts
    on devices too). ``batch_axis`` other than 0 takes a tensor.

    >>> [tuple(p.shape) for p in split_data(torch.zeros(4, 6), 3, batch_axis=1)]
    [(4, 2), (4, 2), (4, 2)]
    >>> [len(p) for p in split_data(torch.zeros(10, 2), 3, even_split=False)]
    [4, 3, 3]
    """
    if isinstance(num_slice, bool) or not isinstance(num_slice, int):
        raise UsageError(f"num_slice={num_slice!r}: expected an integer >= 1")
    if batch_axis != 0:
        axis = _tensor_axis(data, batch_axis, "split_data")
        return list(torch.split(data, _check_even(data.shape[axis], num_slice, even_split, "split_data"), dim=axis))
    sizes = _check_even(batch_size(data, "data split_data was given"), num_slice, even_split, "split_data")
    if isinstance(data, torch.Tensor):
        return list(torch.split(data, sizes))
    return split_tree(data, sizes, lambda t, i: t)


def _tensor_axis(batch: Any, batch_axis: int, call: str) -> int:
    """``batch_axis`` as an axis of the tensor ``batch`` (one line when it is not a tensor or has no such axis)."""
    if not isinstance(batch, torch.Tensor):
        raise UsageError(f"{call}(..., batch_axis={batch_axis}) cuts a tensor, got {describe(batch)}; cut a "
                         "structure of tensors along their first axis (batch_axis=0)")
    if isinstance(batch_axis, bool) or not isinstance(batch_axis, int) or not -batch.dim() <= batch_axis < batch.dim():
        raise UsageError(f"{call}: batch_axis={batch_axis!r} is not an axis of a {batch.dim()}-d tensor "
                         f"{tuple(batch.shape)}; expected an integer in [{-batch.dim()}, {batch.dim() - 1}]")
    return batch_axis % batch.dim()


def place_parts(batch: Batch, devices: Sequence[Device], sizes: Sequence[int]) -> list[Batch]:
    """``batch`` cut into parts of ``sizes`` rows, part i placed on ``devices[i]`` (checked devices, valid sizes).

    The per-step path of a trainer whose devices were checked once: it skips parsing them again.
    """
    if isinstance(batch, torch.Tensor):
        return [_place(p, d) for p, d in zip(torch.split(batch, list(sizes)), devices)]
    if batch is None:  # no separate targets: the batch carries its labels
        return [None] * len(sizes)
    return split_tree(batch, sizes, lambda t, i: _place(t, devices[i]))


def split_batch(X: Batch, y: Batch, devices: Sequence[DeviceLike],
                even_split: bool = True) -> tuple[list[Batch], list[Batch]]:
    """Split features and labels the same way (d2l's ``split_batch``); ``even_split`` as in :func:`split_and_load`.

    Either may be a structure, as in :func:`split_and_load`; both must hold the same examples.

    >>> from dlperf.devices import cpu
    >>> Xs, ys = split_batch(torch.zeros(5, 2), torch.arange(5), [cpu(0), cpu(1)], even_split=False)
    >>> [len(t) for t in ys]
    [3, 2]
    """
    devs = check_devices(devices)
    n = _examples(X, y)
    sizes = _check_even(n, len(devs), even_split, "split_batch")
    return place_parts(X, devs, sizes), place_parts(y, devs, sizes)


def _examples(X: Batch, y: Batch) -> int:
    """The examples of a batch of inputs and targets, which must agree (one line naming both otherwise); ``y``
    None: a batch that carries its own labels."""
    n = batch_size(X, "input")
    if y is None:
        return n
    m = batch_size(y, "target")
    if n != m:
        raise UsageError(f"features have {n} examples but labels have {m}; they must match (inputs {describe(X)}, "
                         f"targets {describe(y)})")
    return n


def _presplit(X: Any, y: Any, devices: Sequence[Device]) -> bool:
    """Whether ``X`` and ``y`` are lists of one part per device rather than one batch.

    A tuple or list of ``k`` parts is pre-split when part ``i`` is on ``devices[i]``, or when its parts
    are spread over several devices (misplaced parts, which :func:`check_placed` then names). A batch
    structure has all its tensors in one place: a tuple ``(ids, mask)`` on the host is one batch,
    whatever the devices.
    """
    k = len(devices)
    if not (isinstance(X, (list, tuple)) and isinstance(y, (list, tuple)) and len(X) == len(y) == k):
        return False
    where = [_part_devices(part) for part in X]
    if any(not w for w in where):
        return False
    if all(w == {d} for w, d in zip(where, devices)):
        return True
    return len(set().union(*where)) > 1


def _part_devices(part: Batch) -> set[Device]:
    return {device_of(t) for t in tensors_of(part)}


def split_step(X: Batch, y: Batch, devices: Sequence[Device], world: int = 1,
               rank: int = 0) -> tuple[list[Batch], list[Batch], int]:
    """A training step's parts for this process's (checked) ``devices``, and the examples of the whole batch.

    In one process ``X`` and ``y`` are one batch (split near-evenly) or lists of one part per device,
    placed already (:func:`check_placed`). Across ``world`` processes they are the global batch, the
    same in every process, and process ``rank`` takes its slice
    (:func:`~dlperf.parallel.communication.process_group.local_parts`).
    """
    k = len(devices)
    if world == 1 and isinstance(X, torch.Tensor) and isinstance(y, torch.Tensor) and X.dim() > 0 and \
            X.shape[0] == y.shape[0] >= k:  # the common case
        sizes = split_sizes(X.shape[0], k)
        return place_parts(X, devices, sizes), place_parts(y, devices, sizes), int(X.shape[0])
    # one device in each of several processes: a 1-tuple is the model's one input, not a part
    if _presplit(X, y, devices) and not (world > 1 and k == 1):
        if world > 1:
            raise UsageError(f"a trainer of {world} processes takes the global batch, the same in every process, "
                             f"not per-device parts ({type(X).__name__} of {len(X)} parts)")
        check_placed(X, devices, "input")
        check_placed(y, devices, "label")
        return list(X), list(y), sum(batch_size(part, "input part") for part in X)
    n = _examples(X, y)
    # the same check, on the same global batch, fails in every process: none is left waiting
    every = split_sizes(n, world * k)
    mine = slice(rank * k, (rank + 1) * k)
    if world == 1:  # losses are weighted by share, so uneven parts are fine
        return place_parts(X, devices, every), place_parts(y, devices, every), n
    # this process's parts: the rows of the parts before it skipped, the rest cut as its devices take them
    start = sum(every[:rank * k])
    sizes = [start, *every[mine], n - start - sum(every[mine])]

    def place(t: torch.Tensor, i: int) -> torch.Tensor:
        return _place(t, devices[i - 1]) if 0 < i <= k else t

    Xs = split_tree(X, sizes, place)[1:k + 1]
    return Xs, [None] * k if y is None else split_tree(y, sizes, place)[1:k + 1], n


def check_placed(parts: Sequence[Batch], devices: Sequence[Device], what: str = "input") -> None:
    """Raise :class:`DeviceMismatchError` unless every tensor of ``parts[i]`` lives on ``devices[i]``."""
    if len(parts) != len(devices):
        raise UsageError(f"got {len(parts)} {what} parts for {len(devices)} devices; give one per device")
    for i, (p, d) in enumerate(zip(parts, devices)):
        for have in sorted(_part_devices(p), key=str):
            if have != d:
                raise DeviceMismatchError(
                    f"{what} part {i} is on {have} but its replica is on {d}; "
                    f"split the batch with split_and_load(batch, devices) or move it with dlperf.as_in(x, {d})")

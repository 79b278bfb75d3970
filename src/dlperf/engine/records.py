"""Record kernels: the functions engine workers run for array operations.

An elementwise operation is pushed as a *record*, a tuple whose first item is the function that
runs it, given the whole tuple (``(rec_scalar, torch.add, x, 1, out)``), so that collecting one
costs a single allocation (see :mod:`dlperf.engine.batches`); the other operations run one of the
``run_*`` functions here. Each writes its output array's value and drops its shape recipe.
Arrays are typed ``Any`` here: this module sits below :mod:`dlperf.engine.ndarray`, which uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..devices import Device, LogicalCpuTensor, tag
from ..errors import UsageError
from .batches import RECORD_GROUPS

__all__ = ["RECORDS", "FOREACH_SCALAR", "rec_unary", "rec_scalar", "rec_binary", "group_scalar", "run_binary",
           "run_make", "run_copy", "run_copy_into", "run_grad", "tag_result", "record_streams", "storages",
           "unalias"]


def tag_result(res: Any, dev: Device) -> Any:
    # Results of ops on cpu(i), i > 0, carry their logical device (see dlperf.devices).
    if dev.index and dev.kind == "cpu" and isinstance(res, torch.Tensor):
        tag(res, dev)
    return res



def record_streams(arrays: Sequence[Any]) -> None:
    # The caching allocator must not hand these blocks to another stream while this one uses them.
    stream = torch.cuda.current_stream()
    for a in arrays:
        if isinstance(a._data, torch.Tensor) and a._data.is_cuda:
            a._data.record_stream(stream)



def storages(inputs: Sequence[Any]) -> set[int]:
    return {a._data.untyped_storage().data_ptr() for a in inputs if isinstance(a._data, torch.Tensor)}


def unalias(res: Any, storages: set[int]) -> Any:
    # A result sharing memory with an input (a view, or the input itself) would escape the
    # engine's ordering: a later write to the input would change it behind its readers' backs.
    if isinstance(res, torch.Tensor):
        return res.clone() if res.untyped_storage().data_ptr() in storages else res
    if type(res) is tuple or type(res) is list:  # split, chunk, unbind, ...
        return type(res)(unalias(r, storages) for r in res)
    return res



# Records (see Engine._push_rec): a tuple whose first item is the function that runs it, given
# the whole tuple, so that collecting one costs a single allocation.
def rec_unary(rec: tuple) -> None:
    _, func, a, out = rec
    res = func(a._data)
    dev = out.device
    out._data = tag_result(res, dev) if dev.index else res
    out._meta = None


def rec_scalar(rec: tuple) -> None:
    _, func, a, b, out = rec
    res = func(a._data, b)
    dev = out.device
    out._data = tag_result(res, dev) if dev.index else res
    out._meta = None


# One multi-tensor call for a run of scalar records: torch's foreach kernels on host tensors call
# the same per-tensor operator for each item (so results, dtypes and errors are those of one call
# each), but cross from Python into C++ once: about 0.4 us less an operation than one call each.
FOREACH_SCALAR: dict[Any, Callable[..., Any]] = {
    torch.add: torch._foreach_add, torch.sub: torch._foreach_sub, torch.mul: torch._foreach_mul,
    torch.true_divide: torch._foreach_div, torch.pow: torch._foreach_pow}
_HOST_TENSORS = (torch.Tensor, LogicalCpuTensor)


def group_scalar(recs: list[tuple], i: int) -> int:
    """Run ``recs[i]`` and the scalar records after it with the same function on host tensors that
    do not need gradients, in one foreach call (see batches.RECORD_GROUPS for the result). A batch's
    records share its device; the scalars are checked by the call itself (one that it refuses runs
    the records one by one)."""
    first = recs[i]
    func = first[1]
    many = FOREACH_SCALAR.get(func)
    if many is None:
        rec_scalar(first)
        return i + 1
    tensors: list[torch.Tensor] = []
    scalars: list[Any] = []
    seen = None  # runs of records often share their input: check each input once
    scalar = first[3]
    same = True  # one scalar object for all (identity, not ==: 1, 1.0 and True differ in dtype)
    j, n = i, len(recs)
    while j < n:
        rec = recs[j]
        if rec[1] is not func or rec[0] is not rec_scalar:
            break
        a = rec[2]
        if a is not seen:
            data = a._data  # None: the result of an earlier record of this run, not computed yet
            if data is None or type(data) not in _HOST_TENSORS or data.requires_grad or not data.is_cpu:
                break
            seen = a
        tensors.append(data)
        b = rec[3]
        if b is not scalar:
            same = False
        scalars.append(b)
        j += 1
    if j - i < 2:
        rec_scalar(first)
        return i + 1
    dev = first[-1].device
    arg = scalar if same else scalars  # one Scalar parses faster than a list of them
    try:
        if dev.index:  # tagged inputs: compute plain, tag the results as tag_result does
            with torch._C.DisableTorchFunctionSubclass():
                results = many(tensors, arg)
            for res in results:
                tag(res, dev)
        else:
            results = many(tensors, arg)
    except Exception:
        return -j
    for rec, res in zip(recs[i:j], results):
        out = rec[-1]
        out._data = res
        out._meta = None
    return j


def run_binary(func: Any, a: Any, b: Any, out: Any) -> None:
    if out.device.is_gpu:
        record_streams((a, b))
    out._data = tag_result(func(a._data, b._data), out.device)
    out._meta = None


def rec_binary(rec: tuple) -> None:
    _, func, a, b, out = rec
    dev = out.device
    if dev.is_gpu:
        record_streams((a, b))
    res = func(a._data, b._data)
    out._data = tag_result(res, dev) if dev.index else res
    out._meta = None



def run_make(factory: Any, args: tuple, kwargs: dict, out: Any) -> None:
    out._data = tag_result(factory(*args, **kwargs), out.device)
    out._meta = None


def run_copy(src: Any, out: Any) -> None:
    data = src._data
    dst = out.device
    if dst.is_gpu or data.is_cuda:
        record_streams((src,))
        if dst.is_gpu:
            out._data = data.to(dst.torch_device, non_blocking=True, copy=True)
        else:  # to pinned host memory, so the copy is asynchronous on the copy stream
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            host.copy_(data, non_blocking=True)
            out._data = tag_result(host, dst)
    else:
        out._data = tag_result(data.clone(), dst)
    out._meta = None


def run_copy_into(src: Any, out: Any) -> None:
    if out._data is not None and tuple(out._data.shape) != tuple(src._data.shape):
        raise UsageError(f"copyto: the target has shape {tuple(out._data.shape)} but the source "
                         f"{tuple(src._data.shape)}; copy into an array of the same shape, or copy to a device")
    run_copy(src, out)



def run_grad(a: Any, out: Any) -> None:
    g = a._data.grad
    out._data = tag_result(torch.zeros_like(a._data) if g is None else g.detach().clone(), out.device)
    out._meta = None



RECORDS = (rec_unary, rec_scalar, rec_binary)
RECORD_GROUPS[rec_scalar] = group_scalar

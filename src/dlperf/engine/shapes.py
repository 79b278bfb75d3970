"""Shape inference: an array's shape and dtype without waiting for its value.

A pending array keeps the recipe of the operation that makes it (a record, or ``(func, args,
kwargs)``); asking its shape runs that recipe on PyTorch's ``meta`` device (shapes only, no data),
recursively through pending inputs up to a bound. Where that cannot work (data-dependent shapes,
Python callables, an in-place change of shape) the caller waits for the value instead.
"""

from __future__ import annotations

from typing import Any

import torch

from .records import RECORDS

__all__ = ["Inferable", "UNKNOWN", "NO_KWARGS", "RESHAPING_INPLACE", "infer"]

UNKNOWN = object()  # _meta: the shape is only known once the value is (wait for it)
NO_KWARGS: dict = {}  # shared by recipes of operators; never modified


class Inferable:
    """Base of engine arrays: a value an operation computes (``_data``, None until then) and the
    recipe that describes it meanwhile (``_meta``: a meta tensor, a recipe, ``UNKNOWN`` or None)."""

    __slots__ = ()
    _data: Any
    _meta: Any


# In-place methods after which the shape is only known from the value.
RESHAPING_INPLACE = frozenset({"resize_", "resize_as_", "squeeze_", "unsqueeze_", "t_", "transpose_",
                                "as_strided_", "swapdims_", "swapaxes_", "set_"})



def _to_meta(x: Any, depth: int) -> Any:
    t = type(x)
    if isinstance(x, Inferable):
        described = _meta_of(x, depth)
        if described is None:
            raise _NotInferable
        return described
    if t is tuple or t is list:
        return t(_to_meta(v, depth) for v in x)
    if t is dict:
        return {k: _to_meta(v, depth) for k, v in x.items()}
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return torch.empty_like(x, device="meta")
    if isinstance(x, torch.device):
        return torch.device("meta")
    return x


class _NotInferable(Exception):
    pass


_MAX_DEPTH = 64  # a longer chain of pending operations is waited for rather than inferred


def _meta_of(a: Inferable, depth: int) -> torch.Tensor | None:
    meta = a._meta
    if meta is None:
        data = a._data
        return torch.empty_like(data, device="meta") if isinstance(data, torch.Tensor) else None
    if meta is UNKNOWN:
        return None
    if isinstance(meta, torch.Tensor):
        return meta
    if depth >= _MAX_DEPTH:
        return None
    inferred = infer(meta, depth + 1)
    if inferred is not None and a._meta is meta:
        a._meta = inferred
    return inferred


def infer(recipe: tuple, depth: int = 0) -> torch.Tensor | None:
    if recipe[0] in RECORDS:  # a record (runner, func, inputs..., output)
        func, args, kwargs = recipe[1], recipe[2:-1], NO_KWARGS
    else:
        func, args, kwargs = recipe
    try:
        with torch.no_grad():
            margs, mkwargs = _to_meta(args, depth), _to_meta(kwargs, depth)
            if "device" in mkwargs:
                mkwargs["device"] = "meta"
            res = func(*margs, **mkwargs)
    except Exception:  # not expressible on meta (data-dependent shapes, Python callables): wait
        return None
    return res if isinstance(res, torch.Tensor) and res.device.type == "meta" else None


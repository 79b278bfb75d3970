"""The wire format of the distributed stores' requests: operation codes, and tensors packed per message.

A request carries ``(store id, sender rank, op, meta, tensors)``; tensors below 64 KB travel packed in one
buffer, so a model with many small parameters pays the per-message cost once per server, not once per key
(bytedance/byteps#237). Everything read off the wire is checked: a dtype, a count or a key name that does
not fit is one :class:`~dlperf.errors.UsageError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import UsageError
from .base import Key

__all__ = ["INIT", "PUSH", "PULL", "PUSHPULL", "STATE", "LOAD", "BYE", "OK", "ERROR", "DTYPES", "wire_dtype",
           "to_wire", "from_wire", "key_of"]

INIT, PUSH, PULL, PUSHPULL, STATE, LOAD, BYE = range(1, 8)
OK, ERROR = 0, 1
_SMALL_BYTES = 64 * 1024  # tensors below this travel packed into one buffer per message
_ALIGN = 8  # every packed tensor starts at a multiple of this, so a dtype view of the buffer is legal
DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                               torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)}


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it owns exactly its storage, else a copy: RPC ships a view's whole storage."""
    t = t.detach()
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0
    return t if whole and t.is_contiguous() else t.contiguous().clone()


def _pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 buffer holding every tensor's bytes, each at an aligned offset."""
    views = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    sizes = [-(-v.numel() // _ALIGN) * _ALIGN for v in views]
    buf = torch.empty(sum(sizes), dtype=torch.uint8)
    offset = 0
    for v, size in zip(views, sizes, strict=True):
        buf[offset:offset + v.numel()].copy_(v)
        offset += size
    return buf


def _unpack(buf: torch.Tensor, specs: Sequence[tuple[str, int]]) -> list[torch.Tensor]:
    """Views of ``buf`` as the packed tensors, given each one's (dtype name, element count)."""
    out, offset = [], 0
    for dtype_name, numel in specs:
        dtype = wire_dtype(dtype_name)
        nbytes = numel * dtype.itemsize
        if offset + nbytes > buf.numel():
            raise UsageError(f"kvstore message is {buf.numel()} bytes, too short for its tensors")
        out.append(buf[offset:offset + nbytes].view(dtype))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return out


def wire_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise UsageError(f"kvstore message holds dtype {name!r}; expected one of {', '.join(DTYPES)}") from None


def to_wire(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Small tensors packed into one leading buffer (if any), big ones after it, each sent as is."""
    small = [t for t in tensors if t.numel() * t.element_size() < _SMALL_BYTES]
    big = [_own(t) for t in tensors if t.numel() * t.element_size() >= _SMALL_BYTES]
    return ([_pack(small)] if small else []) + big


def from_wire(wire: Sequence[torch.Tensor], specs: Sequence[tuple[str, int]]) -> list[torch.Tensor]:
    """Undo :func:`to_wire`, given each tensor's (dtype name, element count) in the original order."""
    is_small = [n * wire_dtype(d).itemsize < _SMALL_BYTES for d, n in specs]
    wire = list(wire)
    if any(is_small) and not wire:
        raise UsageError(f"kvstore message carries no tensors; its metadata names {len(specs)}")
    small = iter(_unpack(wire.pop(0), [s for s, k in zip(specs, is_small, strict=True) if k])
                 if any(is_small) else [])
    if len(wire) != len(specs) - sum(is_small):
        raise UsageError(f"kvstore message carries {len(wire)} large tensors; its metadata names "
                         f"{len(specs) - sum(is_small)}")
    big = iter(wire)
    return [next(small) if k else next(big).reshape(-1).view(wire_dtype(d)) for (d, _), k in
            zip(specs, is_small, strict=True)]


def key_of(name: Any) -> Key:
    if isinstance(name, bool) or not isinstance(name, (int, str)):
        raise UsageError(f"kvstore message names key {name!r}; expected an int or a str")
    return name

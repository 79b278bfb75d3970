"""Same-host payloads of the dist kvstores: tensors through shared memory, not through sockets.

When a worker and a server run on one host, the server takes slots for each slice from an anonymous memory file
(an arena, a :class:`~dlperf._shm.Segment`) and names them in its reply; a worker that can map the arena (same
host, same pid namespace, matching token) pushes by writing its slot and pulls by copying the value slot, while
the requests go through the control channel (:mod:`dlperf.kvstore.control`). Every slot a peer names is checked
against the arena and the slice. ``DLPERF_KVSTORE_SHM=off`` (or ``shared_memory=False``) keeps everything on
RPC. The slots, and what push and pull do with them: docs/design/kvstore.md.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

from .._shm import Segment
from ..errors import UsageError

__all__ = ["SHM_ENV", "SLOT_ALIGN", "ARENA_MIN_BYTES", "Arena", "ArenaPlan", "ServerSlots", "WorkerSlots", "cut_slots",
           "shm_wanted", "slot_bytes"]

SHM_ENV = "DLPERF_KVSTORE_SHM"
SLOT_ALIGN = 64  # every slot starts on a cache line, so a view of any dtype is aligned
ARENA_MIN_BYTES = 4 << 20
"""An arena holds at least this much, so keys initialized one at a time share arenas (and descriptors)."""
_MAX_ARENA_BYTES = 1 << 44  # a reply naming a bigger arena is not ours: refuse before mapping anything
_ON = ("", "on", "1", "yes", "true", "auto")
_OFF = ("off", "0", "no", "false")


def shm_wanted(given: bool | None) -> bool:
    """Whether this process offers shared memory to its peers: ``given``, else ``DLPERF_KVSTORE_SHM``."""
    if given is not None:
        if not isinstance(given, bool):
            raise UsageError(f"shared_memory={given!r}: expected True, False, or None (the {SHM_ENV} setting)")
        return given and _available()
    text = os.environ.get(SHM_ENV, "").strip().lower()
    if text in _OFF:
        return False
    if text not in _ON:
        raise UsageError(f"{SHM_ENV}={text!r}: expected on (same-host payloads through shared memory) or off "
                         "(every payload through RPC); unset it for on")
    return _available()


def _available() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def slot_bytes(numel: int, dtype: torch.dtype) -> int:
    return -(-numel * dtype.itemsize // SLOT_ALIGN) * SLOT_ALIGN


class Arena:
    """A mapped segment seen as bytes: the server's own, or a worker's mapping of it."""

    def __init__(self, segment: Segment, nbytes: int, owner_pid: int, handle: dict[str, int] | None = None) -> None:
        self.segment = segment
        self.nbytes = nbytes
        self.owner_pid = owner_pid  # the creator's process: its control channel is the one to trust
        self.handle = handle  # what a peer needs to map it (the creator only)
        self.ident = 0  # the creator's number for it, which replies name
        self._bytes: torch.Tensor | None = torch.frombuffer(segment.buffer(), dtype=torch.uint8, count=nbytes)

    @classmethod
    def create(cls, nbytes: int) -> Arena:
        segment, handle = Segment.create(1, 0, nbytes)
        return cls(segment, nbytes, os.getpid(), handle)

    @classmethod
    def attach(cls, handle: object, nbytes: object) -> Arena:
        """Map a peer's arena; :class:`ShmUnavailableError` if it cannot be mapped from here."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes <= _MAX_ARENA_BYTES:
            raise UsageError(f"a kvstore server named a shared-memory arena of {nbytes!r} bytes; expected an "
                             f"integer from 1 to {_MAX_ARENA_BYTES}: every rank must run the same dlperf")
        segment = Segment.attach(handle, 1, 0, nbytes)  # checks that handle holds a pid, a descriptor, a token
        assert isinstance(handle, dict)
        return cls(segment, nbytes, handle["pid"])

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The flat slot at ``offset``, checked to lie inside the arena."""
        nbytes = numel * dtype.itemsize
        if self._bytes is None:
            raise UsageError("a kvstore shared-memory arena was used after its store closed")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset % SLOT_ALIGN \
                or offset + nbytes > self.nbytes:
            raise UsageError(f"a kvstore peer named slot offset {offset!r} for {nbytes} bytes in an arena of "
                             f"{self.nbytes}; expected a multiple of {SLOT_ALIGN} inside it: every rank must run "
                             "the same dlperf")
        return self._bytes[offset:offset + nbytes].view(dtype)

    def close(self) -> None:
        self._bytes = None  # the views go first, or the mapping could not be closed
        self.segment.close()


@dataclass
class ServerSlots:
    """One stored slice's slots on its server: two value slots (one holds the value) and the exchange slots."""

    arena: Arena
    values: list[torch.Tensor]
    exchange: dict[int, torch.Tensor]  # by worker rank
    offsets: list[int]  # value slot 0, value slot 1
    exchange_offsets: dict[int, int]
    current: int = 0

    def spare(self) -> torch.Tensor:
        return self.values[1 - self.current]

    def swap(self) -> torch.Tensor:
        """Make the spare slot the value; return it."""
        self.current = 1 - self.current
        return self.values[self.current]


@dataclass
class WorkerSlots:
    """A worker's views of one remote slice's slots.

    ``lock``: one call of this worker at a time writes the exchange slot or waits for an answer in it; a
    push from one thread would otherwise overwrite an async pull's answer that another is still copying.
    """

    values: list[torch.Tensor]
    exchange: torch.Tensor
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reply(self, where: int) -> torch.Tensor:
        return self.exchange if where == 2 else self.values[where]


@dataclass
class ArenaPlan:
    """Where each new slice's slots go in one arena about to be made."""

    nbytes: int = 0
    offsets: list[tuple[list[int], dict[int, int]]] = field(default_factory=list)

    def add(self, numel: int, dtype: torch.dtype, workers: list[int]) -> None:
        size = slot_bytes(numel, dtype)
        values = [self.nbytes, self.nbytes + size]
        exchange = {w: self.nbytes + (2 + i) * size for i, w in enumerate(workers)}
        self.offsets.append((values, exchange))
        self.nbytes += (2 + len(workers)) * size


def cut_slots(arena: Arena, plan: ArenaPlan, shapes: list[tuple[int, torch.dtype]]) -> list[ServerSlots]:
    """The planned slots as views of ``arena``, one :class:`ServerSlots` per (numel, dtype) of ``shapes``."""
    out = []
    for (numel, dtype), (values, exchange) in zip(shapes, plan.offsets, strict=True):
        out.append(ServerSlots(arena, [arena.view(o, numel, dtype) for o in values],
                               {w: arena.view(o, numel, dtype) for w, o in exchange.items()}, values, exchange))
    return out

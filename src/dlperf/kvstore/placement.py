"""Key placement for the distributed stores: a small key whole on one server, a big one cut in even slices.

A key below ``big_array_bound`` elements lives on one server picked by a stable hash of the key, so many
small keys spread over the servers; a bigger key is split into one even slice of its flattened value per
server, so no server carries every big array (apache/mxnet#8290).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from .base import Key

__all__ = ["BIG_ARRAY_BOUND", "Placement", "Slice"]

BIG_ARRAY_BOUND = 1_000_000
"""Keys with at least this many elements are split across all servers (MXNet's default bound)."""


def _stable_hash(key: Key) -> int:
    # Python's hash of a str differs per process; placement must agree across them
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class Slice:
    server: int  # global rank of the server
    part: int
    start: int  # in the flattened value
    stop: int


@dataclass
class Placement:
    """Where each key lives: a list of slices (one for a small key) per key; ``str()`` is a table."""

    servers: list[int]
    big_array_bound: int
    keys: dict[Key, list[Slice]] = field(default_factory=dict)

    def place(self, key: Key, numel: int) -> list[Slice]:
        n = len(self.servers)
        if numel < max(self.big_array_bound, n):
            where = [Slice(self.servers[_stable_hash(key) % n], 0, 0, numel)]
        else:
            bounds = [numel * i // n for i in range(n + 1)]
            where = [Slice(s, i, bounds[i], bounds[i + 1]) for i, s in enumerate(self.servers)]
        self.keys[key] = where
        return where

    def by_server(self) -> dict[int, int]:
        """Elements held by each server."""
        load = dict.fromkeys(self.servers, 0)
        for slices in self.keys.values():
            for s in slices:
                load[s.server] += s.stop - s.start
        return load

    def __str__(self) -> str:
        lines = [f"{'key':<24} {'server':>6} {'part':>4} {'elements':>20}"]
        for key, slices in self.keys.items():
            for s in slices:
                lines.append(f"{key!r:<24} {s.server:>6} {s.part:>4} {f'[{s.start}, {s.stop})':>20}")
        lines.append("per server: " + ", ".join(f"rank {r}: {n} elements" for r, n in self.by_server().items()))
        return "\n".join(lines)

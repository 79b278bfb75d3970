"""Single-process stores: ``local`` sums on the host, ``device`` sums on the devices themselves."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Key, KVStore, register_kvstore

__all__ = ["LocalKVStore", "DeviceKVStore"]


class LocalKVStore(KVStore):
    """Every key lives in host memory; pushes are copied to the host and summed there.

    Costs each device's link one copy up and one down per key, and the host's memory bandwidth; it
    keeps GPU memory free, which is why MXNet made it the default.
    """

    type = "local"

    def _home(self, key: Key, like: torch.Tensor, devices: Sequence[torch.device]) -> torch.device:
        return torch.device("cpu")


class DeviceKVStore(KVStore):
    """Keys are spread round-robin over the devices that pushed them; each sum runs on its key's device.

    Spreading keys balances the summing work and link traffic across devices (d2l 12.7.1's split
    aggregation at key granularity). On logical CPU devices this is the host, like ``local``.
    """

    type = "device"

    def __init__(self, kind: str | None = None) -> None:
        super().__init__(kind)
        self._placed = 0

    def _home(self, key: Key, like: torch.Tensor, devices: Sequence[torch.device]) -> torch.device:
        home = devices[self._placed % len(devices)]
        self._placed += 1
        return home

    def push(self, key, value, priority: int = 0) -> None:
        # The first push of a GPU key moves it to one of the pushing devices, chosen round-robin.
        if not isinstance(key, (list, tuple)) and key in self._store and not isinstance(value, torch.Tensor):
            stored = self._store[key]
            devs = sorted({v.device for v in value}, key=str)
            if stored.device.type == "cpu" and any(d.type == "cuda" for d in devs) and key not in self._params:
                self._store[key] = stored.to(self._home(key, stored, devs))
        super().push(key, value, priority)


register_kvstore("local", LocalKVStore)
register_kvstore("device", DeviceKVStore)

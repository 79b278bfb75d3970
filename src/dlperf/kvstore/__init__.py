"""KVStore: parameter synchronization as a key-value store (d2l 12.7.4).

>>> import torch
>>> with KVStore("device") as kv:
...     kv.init(3, torch.ones(2))
...     grads = [torch.ones(2), 2 * torch.ones(2)]
...     kv.pushpull(3, grads)
...     grads[1].tolist()
[3.0, 3.0]

The ``dist_*`` types share keys across the processes of a job (see :mod:`dlperf.kvstore.dist`).
"""

from __future__ import annotations

from .base import Key, KVStore, create_kvstore, kvstore_types, register_kvstore, register_kvstore_alias
from .dist import DistAsyncKVStore, DistDeviceSyncKVStore, DistKVStore, DistSyncKVStore, Placement
from .local import DeviceKVStore, LocalKVStore

__all__ = ["KVStore", "Key", "LocalKVStore", "DeviceKVStore", "DistKVStore", "DistSyncKVStore", "DistAsyncKVStore",
           "DistDeviceSyncKVStore", "Placement", "create_kvstore", "kvstore_types", "register_kvstore",
           "register_kvstore_alias"]

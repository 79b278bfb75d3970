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

# MXNet's other names for these stores. Where the update runs differs between them in MXNet (on the host, or
# on each device after the sum), which here the Trainer's update_on_kvstore decides; the store's sums are the same.
register_kvstore_alias("local_update_cpu", "local")
register_kvstore_alias("local_allreduce_cpu", "local")
register_kvstore_alias("local_allreduce_device", "device")
register_kvstore_alias("dist_sync_device", "dist_device_sync")

__all__ = ["KVStore", "Key", "LocalKVStore", "DeviceKVStore", "DistKVStore", "DistSyncKVStore", "DistAsyncKVStore",
           "DistDeviceSyncKVStore", "Placement", "create_kvstore", "kvstore_types", "register_kvstore",
           "register_kvstore_alias"]

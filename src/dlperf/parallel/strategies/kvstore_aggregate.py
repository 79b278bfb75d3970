"""Through a KVStore, aggregation only: each gradient bucket is one key, push-pulled while backward runs."""

from __future__ import annotations

import torch

from ...engine import Var
from ...kvstore import KVStore
from ..communication.buckets import GradientBuckets
from .context import StepContext
from .store import BoundStore
from .strategy import ReplicaOptimizers, StrategyOptions, register_strategy

__all__ = ["KVStoreAggregate"]


@register_strategy
class KVStoreAggregate(ReplicaOptimizers):
    """The store sums each bucket over the devices and hands the sum back; every replica then updates itself.

    With one device there is nothing to sum: the store stays unused and the replica updates itself.
    """

    name = "kvstore"

    @classmethod
    def unusable(cls, options: StrategyOptions) -> str | None:
        if options.kvstore is None or options.distributed or options.processes != 1:
            return "needs a local store in one process: kvstore='local' or 'device'"
        return "sums only: with update_on_kvstore use 'update-on-kvstore'" if options.update_on_kvstore else None

    def __init__(self, kvstore: str | KVStore | None = None) -> None:
        super().__init__(kvstore)
        if kvstore is None:
            raise RuntimeError("the kvstore strategy needs a kvstore")
        self.store = BoundStore(kvstore)

    def attach(self, ctx: StepContext) -> None:
        super().attach(ctx)
        kv = self.store.open(ctx)
        if ctx.k > 1:
            self.buckets = GradientBuckets(ctx.replicas, ctx.algorithm, ctx.bucket_bytes, lanes=ctx.lanes,
                                           reduce=self.on_bucket)
            for b, row in enumerate(self.buckets.flats):
                kv.init(b, torch.zeros_like(row[0], device="cpu"))

    def on_bucket(self, b: int) -> list[Var]:
        if self.buckets is None:
            raise RuntimeError("the kvstore strategy has no buckets with one device")
        row = self.buckets.flats[b]
        op = self.store.kv.pushpull_async(b, row, out=row, priority=self.buckets.priorities[b])
        return list(op.writes)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.store.close()

"""Parameter servers across processes (d2l 12.7): a distributed store sums, updates and serves the weights.

The servers are the job's last ``num_servers`` ranks, or with none every worker hosts one for its share
of the keys (see :mod:`dlperf.parallel.communication.servers`). The store is opened as the trainer joins the processes,
before any replica exists, and the trainer then spans the worker ranks only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from ...errors import UsageError
from ..communication.process_group import ProcessAxis
from ..communication.servers import close_and_report, open_dist_kvstore
from .kvstore_update import UpdateOnKVStore, gradients
from .strategy import StrategyOptions, register_strategy

__all__ = ["ParameterServers"]


@register_strategy
class ParameterServers(UpdateOnKVStore):
    """Every key pushed and pulled in one request per server; the servers run the optimizer."""

    name = "parameter-servers"

    costs = ("parameter-servers-1", "parameter-servers-2")

    @classmethod
    def unusable(cls, options: StrategyOptions) -> str | None:
        if not options.distributed:
            return "needs a distributed store: kvstore='dist_sync' (or dist_device_sync)"
        return "needs several processes: start them with dlperf launch" if options.processes < 2 else None

    def join(self, axis: ProcessAxis | None) -> ProcessAxis | None:
        if axis is None:
            return None
        if axis.group is not None:
            raise UsageError(f"kvstore={self.kvstore_option!r} with a process group of its own: a distributed store "
                             "spans the default process group; pass processes='auto'")
        kv, group = open_dist_kvstore(self.store.option)
        self.store.adopt(kv)
        return ProcessAxis(kv.rank, kv.num_workers, axis.local_world, group, axis.owns_default_group)

    exchange_report = None
    """Every worker's time in pushes and pulls, every server's, and the straggler: on the first rank, closed."""
    _failed = False

    def abort_step(self) -> None:
        self._failed = True
        super().abort_step()

    def close(self) -> None:
        self.exchange_report = close_and_report(self.store, gather=not self._failed)

    def _push_and_pull(self, scale: float) -> None:
        params = [list(r.parameters()) for r in self.ctx.replicas]
        grads = [gradients([ps[i] for ps in params], scale) for i in range(len(params[0]))]
        keys = list(range(len(grads)))
        out = [[ps[i] for ps in params] for i in keys]
        # the batched form: one list of per-device tensors per key, one request per server for them all
        self.store.kv.pushpull(keys, cast(Sequence[torch.Tensor], grads), out=cast(Sequence[torch.Tensor], out))

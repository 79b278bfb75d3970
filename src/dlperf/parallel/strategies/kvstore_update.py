"""Through a KVStore that updates: gradients pushed per parameter, the store's optimizer steps, weights pulled."""

from __future__ import annotations

import copy
from typing import Any

import torch

from ...errors import UsageError
from ...kvstore import KVStore
from .context import StepContext
from .store import BoundStore
from .strategy import Strategy, StrategyOptions, register_strategy

__all__ = ["UpdateOnKVStore", "gradients"]


def gradients(params: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """Each parameter's gradient (zeros where it got none), times ``scale``."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    return [g * scale for g in grads] if scale != 1.0 else grads


@register_strategy
class UpdateOnKVStore(Strategy):
    """Update on the store (d2l 12.7): one key per parameter, the store runs the optimizer."""

    name = "update-on-kvstore"

    @classmethod
    def unusable(cls, options: StrategyOptions) -> str | None:
        if options.kvstore is None or options.distributed or options.processes != 1:
            return "needs a local store in one process: kvstore='local' or 'device'"
        return None
    state_key = "kvstore"

    def __init__(self, kvstore: str | KVStore | None = None) -> None:
        super().__init__(kvstore)
        if kvstore is None:
            raise RuntimeError(f"the {self.name!r} strategy needs a kvstore")
        self.store = BoundStore(kvstore)

    def attach(self, ctx: StepContext) -> None:
        super().attach(ctx)
        kv = self.store.open(ctx)
        kv.set_optimizer(ctx.make_optimizer)
        for i, p in enumerate(ctx.replicas[0].parameters()):
            kv.init(i, p.detach())

    def finish(self, scale: float) -> None:
        ctx = self.ctx
        if ctx.check_finite:
            ctx.raise_if_nonfinite("gradient", ctx.replica_grads())
        with torch.no_grad():
            self._push_and_pull(scale)
        for r in ctx.replicas:
            r.zero_grad(set_to_none=True)

    def _push_and_pull(self, scale: float) -> None:
        kv = self.store.kv
        params = [list(r.parameters()) for r in self.ctx.replicas]
        for i in range(len(params[0])):
            # Keys are pushed in layer order. The priority (first layers first: the next forward needs them
            # first) is for a store that queues traffic; the single-process stores run each call at once
            # and ignore it.
            kv.push(i, gradients([ps[i] for ps in params], scale), priority=-i)
            kv.pull(i, out=[ps[i] for ps in params], priority=-i)

    def state_dict(self) -> dict[str, Any]:
        return {"kvstore": copy.deepcopy(self.store.kv.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "kvstore" not in state:
            raise UsageError(f"the state holds no 'kvstore' (keys: {sorted(state)}); the {self.name!r} strategy "
                             "keeps the optimizer on the store: resume with the settings that wrote it")
        self.store.kv.load_state_dict(state["kvstore"])

    def close(self) -> None:
        self.store.close()

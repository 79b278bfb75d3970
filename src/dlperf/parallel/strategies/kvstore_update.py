"""Through a KVStore that updates: gradients pushed per parameter, the store's optimizer steps, weights pulled."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

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
        self._loaded = False  # a replica's parameters were loaded since the store last took them
        self._restoring = False
        self._load_hooks: list[RemovableHandle] = []

    def attach(self, ctx: StepContext) -> None:
        super().attach(ctx)
        kv = self.store.open(ctx)
        kv.set_optimizer(ctx.make_optimizer)
        for i, p in enumerate(ctx.replicas[0].parameters()):
            kv.init(i, p.detach())
        self._watch_loads(ctx.replicas)

    # The store holds the weights and every step pulls them into the replicas: parameters loaded into a
    # replica would be overwritten by the store's stale copy. MXNet resets the store when parameters are
    # loaded, so the next step starts from them; so does this strategy, from the first replica's.
    def _watch_loads(self, replicas: list[nn.Module]) -> None:
        self._load_hooks = [m.register_load_state_dict_post_hook(self._on_load)
                            for r in replicas for m in r.modules()]

    def _on_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        if not self._restoring:
            self._loaded = True

    def _unwatch_loads(self) -> None:
        for handle in self._load_hooks:
            handle.remove()
        self._load_hooks = []

    @contextmanager
    def restoring(self) -> Iterator[None]:
        self._restoring = True
        try:
            yield
        finally:
            self._restoring = False

    def _take_loaded_weights(self) -> None:
        """The store's values become the first replica's (loaded) parameters; its update state starts afresh."""
        params = [p.detach() for p in self.ctx.replicas[0].parameters()]
        self.store.kv.reset(list(range(len(params))), params)
        self._loaded = False

    def update_optimizers(self) -> list[torch.optim.Optimizer]:
        return self.store.kv.optimizer.members

    def finish(self, scale: float) -> None:
        ctx = self.ctx
        if self._loaded:
            self._take_loaded_weights()
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
        self._unwatch_loads()
        self.store.close()

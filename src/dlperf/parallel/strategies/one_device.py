"""One device in one process: nothing to synchronize; the update runs in the replica's own operation."""

from __future__ import annotations

from ...kvstore import KVStore
from .strategy import ReplicaOptimizers, StrategyOptions, register_strategy

__all__ = ["OneDevice"]


@register_strategy
class OneDevice(ReplicaOptimizers):
    """The replica updates itself right after its backward, saving a second engine push per step.

    With ``check_finite`` the update waits for the finiteness check instead, in an operation of its own.
    """

    name = "one-device"

    @classmethod
    def unusable(cls, options: StrategyOptions) -> str | None:
        if options.devices != 1 or options.processes != 1:
            return f"trains one device in one process, not {options.devices} in {options.processes}"
        return "has no store: drop kvstore" if options.kvstore is not None else None

    def __init__(self, kvstore: str | KVStore | None = None) -> None:
        super().__init__(kvstore)
        self._update_in_step = False

    def begin_step(self) -> None:
        super().begin_step()
        self._update_in_step = not self.ctx.update_waits

    def after_backward(self, i: int) -> None:
        if self._update_in_step:
            self.optimizers[i].step()

    def finish(self, scale: float) -> None:
        if self._in_step and self._update_in_step:  # the replica's operation updated it
            self._in_step = False
            return
        super().finish(scale)

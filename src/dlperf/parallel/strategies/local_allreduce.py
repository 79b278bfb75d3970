"""Allreduce among this process's devices: gradient buckets reduced on the lanes while backward runs.

The updates are pushed from backward too, right after the last bucket's reduction, as operations that
read the buckets' variables (one per GPU; on logical CPU devices one that steps every replica's
optimizer), so the caller is woken once per step, when they are done.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ...engine import Op
from ...engine.var import DONE
from ...kvstore import KVStore
from ..communication.buckets import GradientBuckets
from ..optimizers import optimizer_name
from .context import StepContext, wait_each
from .strategy import ReplicaOptimizers, StrategyOptions, register_strategy

__all__ = ["LocalAllreduce"]


@register_strategy
class LocalAllreduce(ReplicaOptimizers):
    """Several devices in one process, gradients summed by the allreduce algorithm."""

    name = "allreduce"

    costs = ("allreduce-naive", "allreduce-ring", "allreduce-sharded")
    planned = True

    @classmethod
    def unusable(cls, options: StrategyOptions) -> str | None:
        if options.processes != 1:
            return "sums one process's devices; across processes use 'processes'"
        return "has no store: drop kvstore, or use 'kvstore'" if options.kvstore is not None else None

    def __init__(self, kvstore: str | KVStore | None = None) -> None:
        super().__init__(kvstore)
        self._update_ops: list[Op] = []
        self._updates_pushed = threading.Event()
        self._push_updates_now = False  # while a step's backward runs
        self._pushed_in_step = False

    def attach(self, ctx: StepContext) -> None:
        super().attach(ctx)
        self.buckets = GradientBuckets(ctx.replicas, ctx.algorithm, ctx.bucket_bytes, lanes=ctx.lanes,
                                       on_all_pushed=self._on_all_pushed)

    def begin_step(self) -> None:
        buckets = self._buckets()
        # the updates are pushed from backward unless a finiteness check must see the sums first (and
        # a model without buckets has nothing in backward that would push them)
        self._push_updates_now = not self.ctx.update_waits and bool(buckets.buckets)
        self._pushed_in_step = False
        self._update_ops = []
        self._updates_pushed.clear()
        super().begin_step()

    def _buckets(self) -> GradientBuckets:
        if self.buckets is None:
            raise RuntimeError("the allreduce strategy is not attached to a trainer yet")
        return self.buckets

    def after_backward(self, i: int) -> None:
        if self._buckets().replica_done() and self._update_ops:
            self._updates_pushed.set()  # the last replica: every update is pushed (see _await_update_push)

    def _on_all_pushed(self) -> None:
        if self._push_updates_now:
            self._push_updates()

    def _push_updates(self) -> None:
        """Push the optimizer steps behind the reductions (runs inside a replica's backward).

        On logical CPU devices one operation steps every replica's optimizer in turn: an update is mostly
        Python, so two run side by side hand the GIL back and forth at every tensor call (LeNet: two
        updates side by side took 0.5-1.3 ms each on a busy machine, one after the other 0.25 ms each).
        GPU updates stay one operation per device, each on its own worker and stream.
        """
        ctx = self.ctx
        reads = (*self._buckets().done_vars(), *ctx.step_vars)
        if any(d.is_gpu for d in ctx.devices):
            self._update_ops = ctx.push_optimizer_steps(self.optimizers, reads)
        else:
            # on the worker of the replica that ended last (this thread): it runs right after, unwoken
            place = ctx.engine.running_on()
            device = place[0] if place is not None and place[0] in ctx.devices else ctx.devices[0]
            name = f"{optimizer_name(self.optimizers[0])} {','.join(map(str, ctx.devices))}"
            self._update_ops = [ctx.engine.push(self._step_every_optimizer, reads=reads,
                                                writes=tuple(ctx.replica_vars), device=device, name=name)]

    def _step_every_optimizer(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def wait_replicas(self, ops: Sequence[Op]) -> list[Any]:
        if self._push_updates_now and self._await_update_push(ops):
            # Every replica's operation has ended its work, so waiting on them cannot run one in this thread.
            # The updates come first: a queued one is run here, which saves waking its worker. (They read
            # every replica's step variable: done, they imply the replicas' operations are.)
            try:
                wait_each(self._update_ops)
            except Exception as exc:
                wait_each(ops)  # a replica's own error comes first
                raise exc from None
            return wait_each(ops)
        return self.ctx.wait_ops(ops)

    def _await_update_push(self, ops: Sequence[Op]) -> bool:
        """Wait until the last replica ended backward with the updates pushed (True), or every replica's
        operation ended without that (False).

        The updates are pushed from inside a replica's operation, so this thread cannot wait on them before;
        the last replica says so as it ends (one wake-up of this thread per step, after the replicas' work).
        One that failed says nothing, so the operations' states are looked at now and then.
        """
        while not self._updates_pushed.wait(0.02):
            if all(op.state == DONE for op in ops):
                return self._updates_pushed.is_set()
        return True

    def abort_step(self) -> None:
        super().abort_step()
        # wait for updates already pushed, so none writes after the caller saw the error
        for op in self._update_ops:
            try:
                op.wait()
            except BaseException:
                pass
        self._update_ops = []

    def end_step(self) -> None:
        super().end_step()
        self._update_ops = []
        # a caller-driven step's reductions (Trainer.step) push no updates
        self._pushed_in_step, self._push_updates_now = self._push_updates_now, False

    def finish(self, scale: float) -> None:
        if self._in_step and self._pushed_in_step:  # the updates ran behind the reductions already
            self._in_step = False
            return
        super().finish(scale)

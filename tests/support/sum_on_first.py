"""A gradient synchronization strategy defined outside dlperf, in one file: registered, it can be named by the
Trainer, ``dlperf train --strategy`` and the planner. Every replica's gradients are summed on the first replica
and copied back (d2l 12.5's allreduce written plainly), then each replica's optimizer steps."""

from __future__ import annotations

import torch

from dlperf.parallel.strategies import ReplicaOptimizers, StrategyOptions, register_strategy


@register_strategy
class SumOnFirst(ReplicaOptimizers):
    name = "sum-on-first"
    planned = True
    calls = 0

    @classmethod
    def unusable(cls, options: StrategyOptions) -> str | None:
        if options.processes != 1 or options.kvstore is not None:
            return "sums one process's devices, without a store"
        return None

    def finish(self, scale: float) -> None:
        type(self).calls += 1
        self._in_step = False
        grads = [[p.grad for p in r.parameters()] for r in self.ctx.replicas]
        with torch.no_grad():
            for j, first in enumerate(grads[0]):
                if first is None:
                    continue
                for row in grads[1:]:
                    first.add_(row[j].to(first.device))
                first.mul_(scale)
                for row in grads[1:]:
                    row[j].copy_(first)
        self.ctx.step_optimizers(self.optimizers)

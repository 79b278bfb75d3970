"""Across processes: buckets summed among this process's devices, then across the processes.

The sum across processes is
:func:`~dlperf.parallel.communication.process_group.allreduce_across_processes`: shared memory
between the processes of one host, gloo between hosts, or both (hierarchical), as the job's links
say. One more engine operation per bucket on the processes' lane runs it, in bucket order (see
:mod:`dlperf.parallel.communication.buckets`). With one device per process the last bucket's operation updates the
weights right after its sum.
"""

from __future__ import annotations

from ...kvstore import KVStore
from ..communication.buckets import Across, GradientBuckets
from ..communication.process_group import ExchangeClock, ExchangeReport, allreduce_across_processes, gather_exchanges
from .context import StepContext
from .strategy import ReplicaOptimizers, StrategyOptions, register_strategy

__all__ = ["AcrossProcesses"]


@register_strategy
class AcrossProcesses(ReplicaOptimizers):
    """Gradients summed locally by the allreduce algorithm, then across processes bucket by bucket."""

    name = "processes"

    costs = ("processes",)

    @classmethod
    def unusable(cls, options: StrategyOptions) -> str | None:
        if options.processes < 2:
            return "needs several processes: start them with dlperf launch or torchrun"
        if options.kvstore is not None:
            return "has no store: drop kvstore, or use 'parameter-servers' with a dist_* store"
        return "sums on host memory (gloo): use CPU devices" if options.gpus else None

    def __init__(self, kvstore: str | KVStore | None = None) -> None:
        super().__init__(kvstore)
        # Read by the last bucket's operation when it runs, which may be after the caller saw the
        # replicas end: set only as a step begins and cleared only by a caller-driven step, both after
        # that operation has been waited for.
        self._update_after_sum = False
        self.exchanges = ExchangeClock()
        """Time in sums across processes; every rank's is gathered as the trainer closes (the straggler)."""
        self.exchange_report: ExchangeReport | None = None
        """Every rank's time in those sums and the straggler, on the first rank once the trainer closed."""
        self._failed = False

    def attach(self, ctx: StepContext) -> None:
        super().attach(ctx)
        if ctx.processes is None:
            raise RuntimeError("the processes strategy needs the processes the trainer spans")
        group = ctx.processes.group
        across = Across(self.exchanges.timed(lambda flat: allreduce_across_processes(flat, group)),
                        ctx.process_lane(), ctx.across_var, then=self._after_last_sum)
        self.buckets = GradientBuckets(ctx.replicas, ctx.algorithm, ctx.bucket_bytes, lanes=ctx.lanes, across=across)

    def _after_last_sum(self) -> None:
        if self._update_after_sum:
            self.optimizers[0].step()

    def begin_step(self) -> None:
        self._update_after_sum = self.ctx.k == 1 and not self.ctx.update_waits
        super().begin_step()

    def abort_step(self) -> None:
        self._failed = True
        super().abort_step()

    def close(self) -> None:
        super().close()
        if not self._failed and self._ctx is not None and self._ctx.processes is not None:
            self.exchange_report = gather_exchanges(self.exchanges, self._ctx.processes)

    def reduce_gradients(self) -> None:
        if not self._in_step:  # a caller-driven sum updates nothing by itself
            self._update_after_sum = False
        super().reduce_gradients()

    def finish(self, scale: float) -> None:
        if self._in_step and self._update_after_sum:
            self._in_step = False
            try:
                self._gradient_buckets().wait()
            except BaseException:
                self.ctx.renew_failed_vars()
                raise
            return
        if not self._in_step:  # a caller-driven step: its sums update nothing by themselves
            self._update_after_sum = False
        super().finish(scale)

    def _gradient_buckets(self) -> GradientBuckets:
        if self.buckets is None:
            raise RuntimeError("the processes strategy is not attached to a trainer yet")
        return self.buckets

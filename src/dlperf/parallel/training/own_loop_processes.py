"""A loop of the user's own across processes: gradients summed while backward runs, each rank's rows of a batch.

The machinery is the processes strategy's (:mod:`~dlperf.parallel.strategies.across_processes`): the model's
gradients live in flat buckets (:class:`~dlperf.parallel.communication.buckets.GradientBuckets`), and each
bucket, once backward has filled it, is summed across the processes by one engine operation on a lane of its
own (:func:`~dlperf.parallel.communication.process_group.allreduce_across_processes`: shared memory between
the processes of a host, gloo between hosts), while backward goes on through earlier layers. As DDP does,
each process's share is divided by the processes first, so every rank ends with the mean of their gradients.
The user's optimizer then steps on them as it would in one process.

Data: every process iterates the same global batches; each trains on its rows (:class:`RankRows`), so the loop
computes on N processes what it computes on one. When a batch's rows do not divide evenly, each rank's
gradient is weighted by its share of the batch (:meth:`ProcessSums.weight`), so the update is still the
global batch's mean: the one-process loop's, where DDP would weight the ranks equally.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ...batch import batch_size, describe, map_tensors, tensors_of
from ...devices import cpu
from ...engine import Engine, create_engine
from ...errors import UsageError
from ..allreduce import DEFAULT_ALGORITHM
from ..allreduce.lanes import EngineLanes, comm_lanes
from ..communication.buckets import Across, GradientBuckets
from ..communication.process_group import ProcessAxis, allreduce_across_processes, broadcast_from_first, local_parts

__all__ = ["ProcessSums", "RankRows", "mean_over"]


class ProcessSums:
    """One model's gradients averaged over the processes of ``axis`` during each synchronized backward, and
    every other sum the loop needs (figures, the tuning's timings), all in one order on one engine lane."""

    def __init__(self, axis: ProcessAxis) -> None:
        self.axis = axis
        # one lane thread for the sums; the caller's thread runs forward and backward
        self.engine: Engine = create_engine("threaded", cpu_threads=1)
        lanes, kind = comm_lanes([cpu(0)])
        self._lanes = EngineLanes(self.engine, lanes, kind)
        self._lane = cpu(max(lane.index for lane in lanes) + 1)
        self._var = self.engine.new_var("across processes")
        self.buckets: GradientBuckets | None = None
        self.share = 1.0
        """This rank's share of the batch it trains on (``1 / world`` unless :class:`RankRows` said else)."""

    def attach(self, module: nn.Module, bucket_bytes: int | None = None) -> None:
        """Start every process from the first one's weights, and give ``module``'s gradients their buckets."""
        if any(t.device.type != "cpu" for t in [*module.parameters(), *module.buffers()]):
            raise UsageError("a loop across processes sums gradients on host memory; keep the model on the CPU "
                             "(one process per GPU is not supported yet)")
        broadcast_from_first([*module.parameters(), *module.buffers()], self.axis.group)
        world, group = self.axis.world, self.axis.group

        def mean(flat: torch.Tensor) -> None:
            flat.div_(world)  # DDP's order: each share divided by the processes, then summed
            allreduce_across_processes(flat, group)

        self.buckets = GradientBuckets([module], DEFAULT_ALGORITHM, bucket_bytes, lanes=self._lanes,
                                       across=Across(mean, self._lane, self._var))
        self.share = 1.0 / world

    def _buckets(self) -> GradientBuckets:
        if self.buckets is None:
            raise RuntimeError("no model is set up for gradient sums yet")
        return self.buckets

    def weight(self) -> float:
        """What this rank's loss gradient is multiplied by so the averaged gradients are the global batch's mean
        (1.0 when the rows divide evenly)."""
        return self.share * self.axis.world

    def bind(self) -> None:
        """Every gradient a view of its bucket (after the user's ``zero_grad`` set them to None), without a sum:
        a backward under ``no_backward_sync`` accumulates into the buckets the next synchronized one sums."""
        self._buckets().bind()

    def backward(self, run: Callable[[], None]) -> None:
        """``run()`` (the backward) with every bucket summed across the processes as it fills; returns once every
        sum has ended, so the gradients are the processes' mean, as after DDP's backward."""
        buckets = self._buckets()
        buckets.bind()
        buckets.arm()
        try:
            run()
        except BaseException:
            buckets.drain()  # no sum may still write into buffers the next step zeroes
            raise
        try:
            buckets.replica_done()  # buckets whose parameters got no gradient go now, in order
            buckets.wait()
        finally:
            buckets.disarm()

    def sum_(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (host memory) summed over the processes in place, in order with the gradient sums."""
        op = self.engine.push(allreduce_across_processes, args=(flat, self.axis.group), writes=(self._var,),
                              device=self._lane, name="sum across processes")
        op.wait()
        return flat

    def close(self) -> None:
        try:
            if self.buckets is not None:
                self.buckets.close()
            self.engine.close()
        finally:
            self.axis.close()


def _rows(start: int, end: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def cut(t: torch.Tensor) -> torch.Tensor:
        return t[start:end] if t.dim() > 0 else t  # 0-d tensors go to every rank, as DDP's scatter does
    return cut


def _fingerprint(batch: Any) -> float:
    """A number two equal batches share: the sum of every tensor's values and sizes (float64)."""
    total = 0.0
    for t in tensors_of(batch):
        total += float(t.detach().double().sum()) + 1e-3 * t.numel()
    return total


class RankRows:
    """Each batch of ``data`` cut to this rank's rows (its near-equal part, in rank order), for ``for`` loops.

    Every rank reads the whole global batch, so the batches must come in the same order everywhere: the first
    batch of every pass is compared across the ranks, and a mismatch (a shuffle seeded differently) is one
    error saying so rather than training on batches that overlap.
    """

    def __init__(self, data: Iterable[Any], sums: ProcessSums) -> None:
        self.data = data
        self._sums = sums

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]  # a loader or list has one; a generator raises, as bare

    def __iter__(self) -> Iterator[Any]:
        axis = self._sums.axis
        first = True
        for batch in self.data:
            n = batch_size(batch)
            if n < axis.world:
                raise UsageError(f"a batch of {n} example{'s' * (n != 1)} cannot be shared by {axis.world} "
                                 f"processes; use batches of at least {axis.world}")
            if first:
                self._check_same(batch)
                first = False
            start, (size,) = local_parts(n, axis.world, axis.rank, 1)
            self._sums.share = size / n
            yield map_tensors(_rows(start, start + size), batch)

    def _check_same(self, batch: Any) -> None:
        axis = self._sums.axis
        seen = torch.zeros(axis.world, dtype=torch.float64)
        seen[axis.rank] = _fingerprint(batch)
        seen = self._sums.sum_(seen)
        if not torch.equal(seen, seen[:1].expand_as(seen)):
            raise UsageError(f"the processes read different batches (rank {axis.rank} got {describe(batch)} unlike "
                             "rank 0's): every process must iterate the same batches in the same order; seed torch "
                             "alike in every process (torch.manual_seed) before making the loader, or give its "
                             "shuffle a torch.Generator with a fixed seed")


def _number(key: object, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise UsageError(f"all_mean: {key!r} is {describe(value)}, not a number; give numbers or one-element tensors "
                     "in a mapping, or average a tensor on its own")


def mean_over(sums: ProcessSums | None, value: Any) -> Any:
    """``value`` (a tensor, a number, or a mapping of numbers) averaged over the processes (``sums`` None: this one
    alone): a tensor comes back detached, a number as a float, a mapping as a dict of floats."""
    world = sums.axis.world if sums is not None else 1
    if isinstance(value, Mapping):
        keys = list(value)
        flat = torch.tensor([_number(k, value[k]) for k in keys], dtype=torch.float64)
        if sums is not None:
            sums.sum_(flat)
        return {k: v / world for k, v in zip(keys, flat.tolist(), strict=True)}
    if isinstance(value, torch.Tensor):
        if sums is None:
            return value.detach()
        flat = value.detach().to("cpu", torch.float64, copy=True).contiguous()
        sums.sum_(flat)
        dtype = value.dtype if value.is_floating_point() else torch.float64
        return (flat / world).to(value.device, dtype)
    number = _number("value", value)
    if sums is None:
        return number
    flat = torch.tensor([number], dtype=torch.float64)
    sums.sum_(flat)
    return float(flat[0]) / world

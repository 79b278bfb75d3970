"""Gradient buckets: flat per-replica gradient buffers reduced as engine operations while backward runs.

Every parameter's ``.grad`` is a view into a flat buffer of its bucket, so a bucket is reduced as one
tensor with no packing copy. Buckets are filled in reverse parameter order, the order autograd
produces gradients, and a post-accumulate hook counts arrivals: once a bucket is complete on every
replica, the hook (running inside a replica's backward operation) pushes the bucket's reduction to the
engine, one operation per phase and device lane, while the replicas continue backward through earlier
layers. The reduction's priority is higher for buckets holding earlier layers: when several wait for a
lane, those go first, as the next forward pass needs them first.

There is no thread here: the engine's workers run the reductions, and each bucket's reduction leaves
one engine variable per lane that the optimizer operations read (see :attr:`GradientBuckets.done`).

With replicas in several processes (:class:`Across`), a bucket reduced among this process's replicas
is then summed across processes by one more operation on the processes' lane. Those operations are
pushed strictly in bucket order and each writes the same variable, so every process issues the same
sequence of collectives whatever order its buckets fill in: a parameter that gets a gradient in one
process but not in another only delays its bucket to the end of backward, it cannot cross the
processes' collectives (which would pair different buckets, or hang).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ...devices import Device, device_of, tag
from ...engine.var import Var
from ..allreduce import AllreduceAlgorithm, AutoAllreduce, get_algorithm
from ..allreduce.lanes import EngineLanes

__all__ = ["GradientBuckets", "DEFAULT_BUCKET_BYTES", "MAX_BUCKETS", "auto_bucket_bytes"]

# 1 MiB: large enough that per-bucket overhead (a few engine pushes, ~20 us) stays small. A small
# model (LeNet: 0.5 MB) forms one bucket, reduced as backward ends by the last replica's worker (see
# GradientBuckets._finish_on): on two cores that both run replicas, lanes reducing smaller buckets
# during backward only took cores from it (LeNet in 3 buckets: no faster, up to 8% slower per step).
DEFAULT_BUCKET_BYTES = 1 << 20
# The step's last bucket, when at most this large, is reduced by the worker of the replica that
# completes it (see GradientBuckets._finish_on).
FINISH_HERE_BYTES = 1 << 20
# Without an explicit size, a model's gradients form at most this many buckets (larger buckets for
# larger models): enough to overlap backward, while the per-bucket cost stays a small share of the
# reduction (64 MB in 1 MiB buckets reduced at 0.79x the standalone bus bandwidth, in 4 MiB ones ~0.95x).
MAX_BUCKETS = 16


def auto_bucket_bytes(params: Sequence[nn.Parameter]) -> int:
    """The default bucket size: :data:`DEFAULT_BUCKET_BYTES`, or larger so there are at most :data:`MAX_BUCKETS`.

    >>> auto_bucket_bytes([nn.Parameter(torch.zeros(1 << 24))]) // (1 << 20)  # 64 MB of float32
    4
    """
    total = sum(p.numel() * p.element_size() for p in params)
    return max(DEFAULT_BUCKET_BYTES, -(-total // MAX_BUCKETS))


def _plan(params: Sequence[nn.Parameter], cap_bytes: int) -> list[list[int]]:
    """Parameter indices per bucket, last parameters first; a new bucket on overflow or dtype change."""
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if cur and (size + nbytes > cap_bytes or p.dtype != params[cur[0]].dtype):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


class Across:
    """Where and how buckets are summed across processes: ``reduce(flat)`` on an engine lane of its own.

    ``var`` is the engine variable every operation that talks to the other processes writes, so that they
    run in the order pushed. ``then`` runs in the last bucket's operation after its sum (a trainer of one
    device per process updates its weights there: one hand-off between threads fewer per step, which
    counts on a machine whose cores are all busy).
    """

    def __init__(self, reduce: Callable[[torch.Tensor], None], lane: Device, var: Var, kind: str = "compute",
                 then: Callable[[], object] | None = None) -> None:
        self.reduce = reduce
        self.lane = lane
        self.var = var
        self.kind = kind
        self.then = then


def _after(events: list[torch.cuda.Event], task: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        stream = torch.cuda.current_stream()
        for ev in events:
            stream.wait_event(ev)  # device-side ordering: no host sync
        task()
    return run


class GradientBuckets:
    """Flat gradient buffers for k replicas, reduced on the engine's lanes as they fill.

    ``reduce(b)`` pushes bucket ``b``'s reduction and returns the variables it leaves written; by
    default it is :meth:`allreduce_bucket` (the allreduce algorithm on ``lanes``); a strategy with a
    KVStore passes the store's ``pushpull_async`` instead. ``on_all_pushed()`` is called (under the
    lock, in the thread that pushed it) once a step's last bucket is pushed: a strategy pushes its
    updates there, so they follow the reductions without a round trip through the caller's thread.
    """

    def __init__(self, replicas: Sequence[nn.Module], algorithm: str | AllreduceAlgorithm,
                 bucket_bytes: int | None = None, lanes: EngineLanes | None = None,
                 across: Across | None = None, *, reduce: Callable[[int], list[Var]] | None = None,
                 on_all_pushed: Callable[[], None] | None = None) -> None:
        self.algorithm = get_algorithm(algorithm)
        self.lanes = lanes
        self.across = across
        if across is not None and lanes is None:
            raise RuntimeError("reducing across processes needs engine lanes")
        self._next_across = 0
        self.params = [[p for p in r.parameters() if p.requires_grad] for r in replicas]
        self.k = len(replicas)
        devices = [device_of(r) for r in replicas]
        if bucket_bytes is None:
            bucket_bytes = auto_bucket_bytes(self.params[0])
        self.buckets = _plan(self.params[0], bucket_bytes)
        self.flats: list[list[torch.Tensor]] = []  # [bucket][replica]
        self._views: list[list[tuple[nn.Parameter, torch.Tensor]]] = [[] for _ in range(self.k)]
        for idx in self.buckets:
            dtype = self.params[0][idx[0]].dtype
            n = sum(self.params[0][i].numel() for i in idx)
            row = []
            for r in range(self.k):
                flat = torch.zeros(n, dtype=dtype, device=self.params[r][idx[0]].device)
                tag(flat, devices[r])  # logical CPU devices share memory: the tag tells them apart
                off = 0
                for i in idx:
                    p = self.params[r][i]
                    # same strides as the parameter (channels-last weights too), so autograd accumulates
                    # in place without a layout conversion
                    self._views[r].append((p, flat[off:off + p.numel()].as_strided(p.shape, p.stride())))
                    off += p.numel()
                row.append(flat)
            self.flats.append(row)
        # earlier layers first: the next forward needs them first (engine: higher runs first)
        n_params = len(self.params[0])
        self.priorities = [n_params - min(idx) for idx in self.buckets]
        self._reduce: Callable[[int], list[Var]] = reduce if reduce is not None else self.allreduce_bucket
        self.done: list[list[Var]] = [[] for _ in self.buckets]
        # per bucket: CUDA events of its producers
        self._ready: list[list[torch.cuda.Event]] = [[] for _ in self.buckets]
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._lock = threading.Lock()
        self._armed = False
        self._on_all_pushed = on_all_pushed
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(r, i))
                       for r in range(self.k) for i, p in enumerate(self.params[r])]
        self.bind()

    # -- gradient storage -------------------------------------------------------------------------
    def bind(self, replica: int | None = None) -> None:
        """Make every ``.grad`` a view of its bucket again (after someone replaced or cleared it)."""
        for r in range(self.k) if replica is None else [replica]:
            for p, view in self._views[r]:
                g = p.grad
                if g is view:
                    continue
                with torch.no_grad():
                    if g is None:
                        view.zero_()
                    else:
                        view.copy_(g)
                p.grad = view

    def zero_(self, replica: int) -> None:
        for row in self.flats:
            row[replica].zero_()

    def scale_(self, factor: float) -> None:
        for row in self.flats:
            for f in row:
                f.mul_(factor)

    # -- reductions as engine operations --------------------------------------------------------------
    def _engine_lanes(self) -> EngineLanes:
        if self.lanes is None:
            raise RuntimeError("these gradient buckets have no engine lanes to reduce on")
        return self.lanes

    def allreduce_bucket(self, b: int) -> list[Var]:
        """Push bucket ``b``'s allreduce among the replicas on the lanes; the variables it leaves written."""
        lanes = self._engine_lanes()
        row = self.flats[b]
        algo = self.algorithm
        phases = algo.schedule(row, True) if isinstance(algo, AutoAllreduce) else algo.schedule(row)
        events = self._ready[b]
        if events:  # GPU: the lanes' streams wait for the backward kernels that produced the bucket
            phases = [[None if t is None else _after(events, t) for t in phase] for phase in phases]
        return lanes.push_schedule(phases, priority=self.priorities[b], name=f"allreduce bucket {b}",
                                   on=self._finish_on(b))

    def _finish_on(self, b: int) -> tuple[Device, str] | None:
        """Where the step's last small bucket of host memory is reduced: the worker pushing it.

        It is pushed as the last replica's backward ends, when nothing is left to overlap: on that
        replica's own worker it runs right after, where on the lanes it waits for their threads to
        wake (~0.15 ms on two loaded cores, more than summing a megabyte takes).
        """
        if self._unpushed != 1 or self.flats[b][0].numel() * self.flats[b][0].element_size() > FINISH_HERE_BYTES:
            return None
        place = self._engine_lanes().engine.running_on()
        if place is None or place[0].is_gpu or any(f.is_cuda for f in self.flats[b]):
            return None
        return place

    def done_vars(self) -> list[Var]:
        """Every variable the pushed reductions leave written (what an update must read)."""
        return [v for vs in self.done for v in vs]

    def arm(self) -> None:
        """Start a step: the next backward on every replica pushes bucket reductions as buckets fill."""
        with self._lock:
            self._pending = [[len(idx) for idx in self.buckets] for _ in range(self.k)]
            self._arrived = [0] * len(self.buckets)
            self._pushed = [False] * len(self.buckets)
            self._unpushed = len(self.buckets)
            self._replicas_done = 0
            self.done = [[] for _ in self.buckets]
            self._ready = [[] for _ in self.buckets]
            self._next_across = 0
            self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def _hook(self, r: int, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self._armed:
                return
            b = self._bucket_of[i]
            with self._lock:
                self._pending[r][b] -= 1
                if self._pending[r][b] == 0:
                    if param.is_cuda:  # the gradient is complete once this stream's queued kernels ran
                        ev = torch.cuda.Event()
                        ev.record(torch.cuda.current_stream(param.device))
                        self._ready[b].append(ev)
                    self._arrived[b] += 1
                    if self._arrived[b] == self.k:
                        self._push(b)
        return hook

    def _push(self, b: int) -> None:
        # caller holds the lock: a bucket is pushed once, and done[] is complete when the last replica ends
        if self._armed and not self._pushed[b]:
            self._pushed[b] = True
            # one replica in this process: nothing to reduce locally before the processes' sum
            self.done[b] = self._reduce(b) if self.k > 1 or self.across is None else []
            if self.across is not None:
                self._push_across_in_order(self.across)
            self._unpushed -= 1
            if self._unpushed == 0 and self._on_all_pushed is not None:
                self._on_all_pushed()

    def _push_across_in_order(self, across: Across) -> None:
        # caller holds the lock; buckets go across in index order only (see the module's docstring)
        engine = self._engine_lanes().engine
        while self._next_across < len(self.buckets) and self._pushed[self._next_across]:
            b = self._next_across
            self._next_across += 1
            row = self.flats[b]
            then = across.then if b == len(self.buckets) - 1 else None

            def task(row=row, across=across, then=then) -> None:
                across.reduce(row[0])
                for f in row[1:]:  # every local replica holds the same local sum: give each the total
                    f.copy_(row[0])
                if then is not None:
                    then()

            events = self._ready[b]
            run = _after(events, task) if events else task
            engine._push(run, (), tuple(self.done[b]), (across.var,), across.lane, self.priorities[b],
                         f"allreduce bucket {b} across processes", across.kind)
            self.done[b] = [*self.done[b], across.var]

    def replica_done(self) -> bool:
        """A replica finished backward; after the last one (True), push buckets whose parameters got no grad."""
        with self._lock:
            self._replicas_done += 1
            if self._replicas_done == self.k:
                for b in range(len(self.buckets)):
                    self._push(b)
                return True
            return False

    def wait(self) -> None:
        """Block until every pushed reduction is done; raise the first error once."""
        if self.lanes is not None:
            self.lanes.wait(self.done_vars())

    def drain(self) -> None:
        """Wait for every pushed reduction, ignoring errors (after a failed step, before buffers are reused)."""
        self._armed = False
        try:
            self.wait()
        except BaseException:  # the step's own error is what the caller reports
            pass

    def allreduce_all(self) -> None:
        """Reduce every bucket now (for gradients computed outside an armed step)."""
        self.bind()
        self.arm()
        with self._lock:
            for b in range(len(self.buckets)):
                self._push(b)
        self._armed = False
        self.wait()

    def close(self) -> None:
        """Detach the gradient hooks (the engine that ran the reductions is closed by its owner)."""
        self._armed = False
        for h in self._hooks:
            h.remove()
        self._hooks = []

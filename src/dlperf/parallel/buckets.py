"""Gradient buckets: flat per-replica gradient buffers synchronized while backward is still running.

Every parameter's ``.grad`` is a view into a flat buffer of its bucket, so a bucket is allreduced as
one tensor with no packing copy. Buckets are filled in reverse parameter order, the order autograd
produces gradients, and a post-accumulate hook counts arrivals: once a bucket is complete on every
replica it is queued for a communication thread, which reduces it while the workers continue backward
through earlier layers. When several buckets wait at once, the one holding the earliest layers goes
first: those are the parameters the next forward pass needs first.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence

import torch
from torch import nn

from .._threads import set_thread_budget
from ..devices import device_of, tag
from .allreduce import AllreduceAlgorithm, allreduce, get_algorithm
from .workers import DeviceWorkers

__all__ = ["GradientBuckets", "DEFAULT_BUCKET_BYTES"]

# 1 MiB: small enough that LeNet's 1.7 MB of gradients form two buckets (so communication overlaps
# backward), large enough that per-bucket overhead (a queue hop, ~20 us) stays below 2%.
DEFAULT_BUCKET_BYTES = 1 << 20
_STOP = (float("inf"), -1, -1)  # (priority, generation, bucket)


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


class GradientBuckets:
    """Flat gradient buffers for k replicas and the machinery that allreduces them as they fill."""

    def __init__(self, replicas: Sequence[nn.Module], algorithm: str | AllreduceAlgorithm,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.algorithm = get_algorithm(algorithm)
        self.params = [[p for p in r.parameters() if p.requires_grad] for r in replicas]
        self.k = len(replicas)
        devices = [device_of(r) for r in replicas]
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
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._lock = threading.Lock()
        self._armed = False
        # Each armed step is a generation; queue entries carry theirs, so reductions left over from a
        # failed step are skipped instead of completing (or failing) buckets of the next one.
        self._gen = 0
        self._busy = False  # the comm thread is reducing a bucket (guarded by _lock)
        self._idle = threading.Condition(self._lock)
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(r, i))
                       for r in range(self.k) for i, p in enumerate(self.params[r])]
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._done = [threading.Event() for _ in self.buckets]
        self._error: BaseException | None = None
        # Set to a list to record (bucket, start_s, end_s) of each overlapped reduction (perf_counter).
        self.trace: list[tuple[int, float, float]] | None = None
        self._process_default = torch.get_num_threads()
        self._comm = threading.Thread(target=self._comm_loop, name="dlperf-grad-sync", daemon=True)
        self._comm.start()
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

    # -- overlapped synchronization -----------------------------------------------------------------
    def arm(self) -> None:
        """Start a step: the next backward on every replica triggers bucket reductions."""
        with self._lock:
            self._gen += 1  # entries still queued from an earlier step are now stale
            # a reduction already running writes into the buffers this step is about to zero: let it end
            self._idle.wait_for(lambda: not self._busy)
        self._pending = [[len(idx) for idx in self.buckets] for _ in range(self.k)]
        self._arrived = [0] * len(self.buckets)
        self._queued = [False] * len(self.buckets)
        self._replicas_done = 0
        self._error = None
        for ev in self._done:
            ev.clear()
        self._armed = True

    def _hook(self, r: int, i: int):
        def hook(_p: torch.Tensor) -> None:
            if not self._armed:
                return
            b = self._bucket_of[i]
            with self._lock:
                self._pending[r][b] -= 1
                if self._pending[r][b] == 0:
                    self._arrived[b] += 1
                    if self._arrived[b] == self.k:
                        self._enqueue(b)
        return hook

    def _enqueue(self, b: int) -> None:
        # caller holds the lock; priority = the bucket's first layer in forward order
        if not self._queued[b]:
            self._queued[b] = True
            self._queue.put((min(self.buckets[b]), self._gen, b))

    def replica_done(self) -> None:
        """A replica finished backward; after the last one, flush buckets whose parameters got no grad."""
        with self._lock:
            self._replicas_done += 1
            if self._replicas_done == self.k:
                for b in range(len(self.buckets)):
                    self._enqueue(b)

    def abort(self, exc: BaseException) -> None:
        """A replica failed: release every replica waiting in :meth:`wait` with that error."""
        self._error = exc
        for ev in self._done:
            ev.set()

    def wait(self) -> None:
        """Block until every bucket of this step is reduced on every replica."""
        for ev in self._done:
            ev.wait()
        self._armed = False
        if self._error is not None:
            raise self._error

    def _comm_loop(self) -> None:
        # reductions are memory-bound; more threads would steal compute cores
        set_thread_budget(1, self._process_default)
        while True:
            _, gen, b = self._queue.get()
            if b < 0:
                return
            with self._lock:
                if gen != self._gen:
                    continue  # left over from a step that failed: its waiters were already released
                self._busy = True
            t0 = time.perf_counter()
            error: BaseException | None = None
            try:
                allreduce(self.flats[b], self.algorithm)
                for f in self.flats[b]:
                    if f.is_cuda:
                        torch.cuda.current_stream(f.device).synchronize()
            except BaseException as exc:  # reported by wait()
                error = exc
            with self._lock:
                if error is not None:
                    self._error = error
                if self.trace is not None:
                    self.trace.append((b, t0, time.perf_counter()))
                self._done[b].set()
                self._busy = False
                self._idle.notify_all()

    # -- all at once -------------------------------------------------------------------------------
    def allreduce_all(self, workers: DeviceWorkers | None = None) -> None:
        """Reduce every bucket now (for gradients computed outside an armed step)."""
        self.bind()
        for row in self.flats:
            allreduce(row, self.algorithm, workers=workers)

    def close(self, timeout: float | None = None) -> None:
        """Release every replica still waiting in :meth:`wait`, then stop the communication thread.

        Waiters are released first: a step interrupted half-way (Ctrl-C) has replicas waiting for
        buckets that will never complete, and the thread that would complete them is stopping.
        """
        with self._lock:
            self._gen += 1  # queued reductions belong to the abandoned step: skip them
        self.abort(RuntimeError("the gradient buckets were closed while a step was waiting for them"))
        if self._comm.is_alive():
            self._queue.put(_STOP)
            self._comm.join(timeout)
        for h in self._hooks:
            h.remove()
        self._hooks = []

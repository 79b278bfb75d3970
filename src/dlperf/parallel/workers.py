"""One persistent worker thread per device, each with its own intra-op thread budget.

PyTorch operators release the GIL while they compute, so k Python threads that each drive one device
really run k forward/backward passes at once. Logical CPU devices share the cores: each worker calls
``torch.set_num_threads(budget)`` from inside its own thread. With the OpenMP backend that sets the
calling thread's OpenMP ``nthreads`` value only (an OpenMP per-thread setting), so two workers with one
thread each use two cores without oversubscribing them, and the main thread's count is untouched. The
same call also stores the value as the default for threads that have not used torch yet, so each
worker puts that default back (``dlperf._threads.set_thread_budget``).
Measured here (2 cores, LeNet, batch 256): one thread 96 ms/step, two workers x 128 examples x 1
thread 47.5 ms/step.

>>> from dlperf.devices import cpu
>>> with DeviceWorkers([cpu(0), cpu(1)]) as w:
...     w.run_each([lambda: 1, lambda: 2])
[1, 2]
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from .._threads import set_thread_budget
from ..devices import Device, cpu_count

__all__ = ["DeviceWorkers", "thread_budget"]

_STOP = object()


def thread_budget(devices: Sequence[Device], cores: int | None = None) -> list[int]:
    """Intra-op threads for each device's worker: the cores split evenly among logical CPU devices.

    A GPU worker only launches kernels and copies, so one host thread is enough for it.

    >>> from dlperf.devices import cpu, gpu
    >>> thread_budget([cpu(0), cpu(1)], cores=4), thread_budget([gpu(0)], cores=4)
    ([2, 2], [1])
    """
    cores = cores or cpu_count()
    n_cpu = sum(1 for d in devices if not d.is_gpu)
    share = max(1, cores // n_cpu) if n_cpu else 1
    return [1 if d.is_gpu else share for d in devices]


class _Worker(threading.Thread):
    def __init__(self, device: Device, threads: int, name: str, process_default: int) -> None:
        super().__init__(name=name, daemon=True)
        self.device = device
        self.threads = threads
        self.process_default = process_default
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()

    def run(self) -> None:
        # Per-thread settings: they affect this worker only, never the caller's thread nor threads started later.
        set_thread_budget(self.threads, self.process_default)
        if self.device.is_gpu:
            torch.cuda.set_device(self.device.index)
        while True:
            item = self.tasks.get()
            if item is _STOP:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller through the future
                fut.set_exception(exc)


class DeviceWorkers:
    """A pool of one FIFO worker thread per device; tasks for one device run in submission order."""

    def __init__(self, devices: Sequence[Device], threads: Sequence[int] | None = None,
                 name: str = "dlperf") -> None:
        self.devices = list(devices)
        budget = list(threads) if threads is not None else thread_budget(self.devices)
        if len(budget) != len(self.devices):
            raise ValueError(f"got {len(budget)} thread budgets for {len(self.devices)} devices")
        self.threads = budget
        process_default = torch.get_num_threads()
        self._workers = [_Worker(d, t, f"{name}-{d}", process_default) for d, t in zip(self.devices, budget)]
        for w in self._workers:
            w.start()
        self._closed = False

    def __len__(self) -> int:
        return len(self._workers)

    def submit(self, i: int, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)`` on device ``i``'s worker; return its future."""
        if self._closed:
            raise RuntimeError("these device workers are closed")
        fut: Future = Future()
        self._workers[i].tasks.put((fut, fn, args))
        return fut

    def run_each(self, fns: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``fns[i]`` on worker ``i`` concurrently; wait for all; re-raise the first failure."""
        futs = [self.submit(i, fn) for i, fn in enumerate(fns)]
        return wait_all(futs)

    def cancel_pending(self) -> None:
        """Cancel every queued task that has not started (their futures report cancelled)."""
        for w in self._workers:
            _cancel_queued(w.tasks)

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop and join every worker.

        Queued tasks finish first, unless ``cancel``: then tasks not yet started are cancelled (after
        an interrupt nobody waits for them). ``timeout`` bounds the wait for each worker; a worker
        still inside a task after it is a daemon thread and does not keep the process alive.
        """
        if self._closed:
            return
        self._closed = True
        if cancel:
            self.cancel_pending()
        for w in self._workers:
            w.tasks.put(_STOP)
        for w in self._workers:
            w.join(timeout)

    def __enter__(self) -> DeviceWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cancel_queued(tasks: queue.SimpleQueue) -> None:
    while True:
        try:
            item = tasks.get_nowait()
        except queue.Empty:
            return
        if item is not _STOP:
            item[0].cancel()


def wait_all(futs: Sequence[Future]) -> list[Any]:
    """Wait for every future (even after a failure, so no task still runs), then return or raise."""
    errors = [f.exception() for f in futs]
    for e in errors:
        if e is not None:
            raise e
    return [f.result() for f in futs]

"""Batches prepared ahead of the devices by a background thread.

The producer gathers the next batch's examples, converts uint8 pixels to float in [0, 1] and, when a
GPU is the target, copies them into pinned (page-locked) host memory so the host-to-device copy can be
asynchronous. A bounded queue of ``prefetch`` batches keeps it ahead without unbounded memory.

>>> X, y = torch.zeros(10, 28, 28, dtype=torch.uint8), torch.arange(10)
>>> loader = ArrayLoader(X, y, batch_size=4, shuffle=False)
>>> [tuple(xb.shape) for xb, _ in loader]
[(4, 1, 28, 28), (4, 1, 28, 28), (2, 1, 28, 28)]
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import torch

from .._threads import ServiceThread, set_thread_budget
from ..errors import UsageError

__all__ = ["ArrayLoader"]

_END = object()


class ArrayLoader:
    """Mini-batches of in-memory images and labels; each epoch's order is a function of (seed, epoch)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, prefetch: int = 2, pin_memory: bool | None = None) -> None:
        if batch_size < 1:
            raise UsageError(f"batch size must be >= 1, got {batch_size}")
        if images.shape[0] != labels.shape[0]:
            raise UsageError(f"{images.shape[0]} images but {labels.shape[0]} labels")
        self.images, self.labels = images, labels
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.prefetch = max(1, prefetch)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.epoch = 0

    def __len__(self) -> int:
        return -(-self.images.shape[0] // self.batch_size)

    def _order(self, epoch: int) -> torch.Tensor:
        n = self.images.shape[0]
        if not self.shuffle:
            return torch.arange(n)
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))

    def _batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        X = self.images[idx]
        X = X.float().div_(255) if X.dtype == torch.uint8 else X.float()
        if X.dim() == 3:
            X = X.unsqueeze(1)  # (N, 1, H, W): one channel
        y = self.labels[idx]
        if self.pin_memory:
            X, y = X.pin_memory(), y.pin_memory()
        return X, y

    def epoch_batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of epoch ``epoch`` (same order every time for the same seed and epoch)."""
        order = self._order(epoch)
        chunks = list(torch.split(order, self.batch_size))
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        process_default = torch.get_num_threads()

        def put(item: object) -> bool:
            # every put polls ``stop``: a consumer that quit early never drains a full queue again
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                set_thread_budget(1, process_default)  # gathers are memory-bound; leave the cores to the devices
                for idx in chunks:
                    if not put(self._batch(idx)):
                        return
            except BaseException as exc:
                put(exc)
                return
            put(_END)

        worker = ServiceThread(produce, name="dlperf-loader")
        worker.start()
        try:
            while True:
                item = q.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            # also runs when the consumer stops early: the producer must not outlive the iteration
            stop.set()
            worker.join()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch = self.epoch
        self.epoch += 1
        return self.epoch_batches(epoch)

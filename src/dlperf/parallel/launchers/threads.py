"""Workers as threads of this process: one per logical CPU device, no process group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...devices import cpu
from ...engine import create_engine
from ...errors import UsageError
from .launcher import Launcher, LaunchError, RankInfo, thread_rank

__all__ = ["ThreadLauncher"]


class ThreadLauncher(Launcher):
    """Run the workers on the project's per-device worker threads (``cpu(0)`` ... ``cpu(n-1)``).

    The threads share the process, so workers exchange tensors directly (the ``allreduce`` algorithms,
    a KVStore) instead of through a process group; ``rank_info()`` answers per thread.

    >>> from dlperf.parallel.launchers import rank_info
    >>> ThreadLauncher(2).launch(lambda x: x * rank_info().rank, 10)
    [0, 10]
    """

    def __init__(self, num_workers: int, threads_per_worker: int | None = None) -> None:
        if not isinstance(num_workers, int) or num_workers < 1:
            raise UsageError(f"num_workers={num_workers!r}: expected an integer >= 1")
        self.num_workers = num_workers
        self.threads_per_worker = threads_per_worker

    @property
    def world_size(self) -> int:
        return self.num_workers

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        n = self.num_workers

        def work(rank: int) -> Any:
            thread_rank.info = RankInfo(rank, n, rank)
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                raise LaunchError(f"rank {rank} failed: {type(exc).__name__}: {exc}") from exc
            finally:
                del thread_rank.info

        # The engine's per-device workers are the project's threads: rank r runs on cpu(r)'s worker.
        with create_engine("threaded", cpu_threads=self.threads_per_worker) as eng:
            ops = [eng.push(work, (r,), device=cpu(r), name=f"rank {r}") for r in range(n)]
            results = []
            for op in ops:
                results.append(op.wait())
            return results

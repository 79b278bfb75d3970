"""The launcher: the third axis of data-parallel training, beside devices and communication.

A launcher starts one worker per rank, runs the same function in each and hands back what each
returned, in rank order. :class:`~dlperf.parallel.launchers.ThreadLauncher` runs the workers as
threads of this process; :class:`~dlperf.parallel.launchers.ProcessLauncher` as processes started by
PyTorch's elastic agent, with a process group around the function.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NamedTuple

from ...errors import DlperfError
from ...machine import HOST_ENV, rank_host

__all__ = ["DEFAULT_ROLE", "HOST_ENV", "Launcher", "LaunchError", "RankInfo", "checkpoint_path", "rank_host",
           "rank_info", "rank_role", "restart_count"]


DEFAULT_ROLE = "worker"
"""The role of a rank nobody gave another one (a KVStore's server processes are ``"server"``)."""


class LaunchError(DlperfError, RuntimeError):
    """A worker failed, hung past the join timeout, or could not be started.

    When one rank is known to be the cause, ``rank``, ``role``, ``host`` and ``cause`` (its error line,
    or ``"killed by SIGKILL"`` and the like) say which; they are ``None`` for failures of the whole
    group (a join timeout). ``log_path``: the file that holds torch's own output of the launch (the
    agent's traceback blocks, C++ log lines), kept when the launch failed and torch wrote anything.
    """

    def __init__(self, message: str, *, rank: int | None = None, role: str | None = None,
                 host: str | None = None, cause: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.role = role
        self.host = host
        self.cause = cause
        self.log_path: str | None = None


class RankInfo(NamedTuple):
    rank: int
    world_size: int
    local_rank: int


thread_rank = threading.local()


def rank_info() -> RankInfo:
    """(rank, world_size, local_rank) of the calling worker.

    Inside a thread worker these come from the launcher; inside a process worker from the environment
    the agent sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``); outside any worker the caller is rank 0 of 1.

    >>> rank_info()
    RankInfo(rank=0, world_size=1, local_rank=0)
    """
    info = getattr(thread_rank, "info", None)
    if info is not None:
        return info
    try:
        return RankInfo(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
                        int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError:
        raise LaunchError(f"RANK={os.environ.get('RANK')!r}, WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}, "
                          f"LOCAL_RANK={os.environ.get('LOCAL_RANK')!r}: expected integers; unset them or "
                          "start the workers with a launcher") from None


def in_launched_worker() -> bool:
    """Whether the caller is a worker a launcher started: a thread of :class:`ThreadLauncher`, or a process of
    ``dlperf launch``, :class:`ProcessLauncher` or ``torchrun`` (torch's agent names the run in every worker's
    environment). Such a worker is one of the processes: it never starts processes of its own again.
    """
    return getattr(thread_rank, "info", None) is not None or "TORCHELASTIC_RUN_ID" in os.environ


def rank_role() -> str:
    """The role the launcher gave the calling worker (``"worker"`` unless the launch's ``roles`` say else)."""
    return os.environ.get("DLPERF_ROLE") or DEFAULT_ROLE




def restart_count() -> int:
    """How often the launcher has restarted the worker group before this attempt (0 on the first)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        raise LaunchError(f"TORCHELASTIC_RESTART_COUNT={os.environ.get('TORCHELASTIC_RESTART_COUNT')!r}: "
                          "expected an integer; unset it or start the workers with a launcher") from None


def checkpoint_path() -> str | None:
    """The checkpoint file the launch was given (``ProcessLauncher(checkpoint=...)``), or None.

    A restarted worker group resumes from it: rank 0 writes it with :func:`dlperf._io.atomic_open`
    after each step, every rank reads it with :func:`dlperf._io.safe_torch_load` on start when it exists.
    """
    return os.environ.get("DLPERF_CHECKPOINT") or None


class Launcher(ABC):
    """Starts ``world_size`` workers that each run one function."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """How many workers a launch starts (on every node together)."""

    @abstractmethod
    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` in every worker; return each local worker's result, in rank order.

        A failure in any worker raises one :class:`LaunchError` naming the rank and its error, after
        every worker has stopped.
        """

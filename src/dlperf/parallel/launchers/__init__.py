"""Launchers: how the workers of a data-parallel job start (threads here, processes via torch's agent).

>>> from dlperf.parallel.launchers import ThreadLauncher, rank_info
>>> ThreadLauncher(2).launch(lambda: rank_info().rank)
[0, 1]
"""

from __future__ import annotations

from .launch_config import LaunchConfig
from .launcher import (
    DEFAULT_ROLE,
    HOST_ENV,
    Launcher,
    LaunchError,
    RankInfo,
    checkpoint_path,
    in_launched_worker,
    rank_host,
    rank_info,
    rank_role,
    restart_count,
)
from .processes import ProcessLauncher, attempt_store, free_port
from .threads import ThreadLauncher

__all__ = ["DEFAULT_ROLE", "HOST_ENV", "LaunchConfig", "Launcher", "LaunchError", "ProcessLauncher", "RankInfo",
           "ThreadLauncher", "attempt_store", "checkpoint_path", "free_port", "in_launched_worker", "rank_host",
           "rank_info", "rank_role", "restart_count"]

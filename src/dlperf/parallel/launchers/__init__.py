"""Launchers: how the workers of a data-parallel job start (threads here, processes via torch's agent).

>>> from dlperf.parallel.launchers import ThreadLauncher, rank_info
>>> ThreadLauncher(2).launch(lambda: rank_info().rank)
[0, 1]
"""

from __future__ import annotations

from .launcher import Launcher, LaunchError, RankInfo, rank_info
from .processes import ProcessLauncher, free_port
from .threads import ThreadLauncher

__all__ = ["Launcher", "LaunchError", "ProcessLauncher", "RankInfo", "ThreadLauncher", "free_port", "rank_info"]

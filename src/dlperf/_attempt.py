"""The launch attempt a process belongs to, and the rendezvous store seen through that attempt's keys.

Below both its users: the launcher's workers (:mod:`dlperf.parallel.launchers`) meet through it, and a
distributed KVStore's RPC agents (:mod:`dlperf.kvstore`) find each other there.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

__all__ = ["attempt_number", "attempt_store"]

_STORE_TIMEOUT_S = 300


def attempt_number() -> int:
    """How often the launcher's agent has restarted this process's group (0 for the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def attempt_store(prefix: str = "") -> Any:
    """The launch's rendezvous store, seen through a prefix of the current attempt; None outside an agent.

    The agent's store outlives a restart, but whatever numbers its keys per process from 0 (``env://``
    process groups, ``torch.distributed.rpc``'s agents) would read the previous attempt's keys there and
    connect to processes that are gone. Keys under this prefix belong to this attempt only; ``prefix``
    keeps one user's keys (the process group, an RPC agent) apart from another's.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=_STORE_TIMEOUT_S))
    return dist.PrefixStore(f"dlperf/attempt_{attempt_number()}/{prefix}", store)

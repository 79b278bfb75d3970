"""The RPC agent of the distributed stores: one per process, shared by the stores open in it.

torch.distributed.rpc (TensorPipe) carries the requests that do not go through shared memory; its agents
meet through the launch's store, under the current attempt's keys (see :mod:`dlperf._attempt`).
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

from ..errors import UsageError

__all__ = ["agent_name", "start_agent", "stop_agent"]

_AGENT_LOCK = threading.Lock()
_AGENT_USERS = 0


def agent_name(rank: int) -> str:
    return f"dlperf-kvstore-{rank}"


_ATTEMPT_SCHEME = "dlperf-attempt"


def _attempt_rendezvous(url: str, timeout: Any = None, **kwargs: Any):
    """``dlperf-attempt://``: the launch's store under this attempt's prefix, for the RPC agent's keys."""
    from urllib.parse import parse_qs, urlparse

    from .._attempt import attempt_store

    query = parse_qs(urlparse(url).query)
    store = attempt_store("kvstore-rpc")
    if store is None:
        raise UsageError("the dlperf-attempt:// rendezvous needs a launcher's agent store "
                         "(TORCHELASTIC_USE_AGENT_STORE=True); start the processes with dlperf launch")
    yield store, int(query["rank"][0]), int(query["world_size"][0])


def _rendezvous_url() -> str:
    """Where the RPC agent meets its peers: the launch's store, this attempt's keys only, under an agent.

    torch.distributed.rpc numbers its store keys per process from 0; after the agent restarts the workers,
    their agents would read the previous attempt's addresses from the agent's store, which outlives it.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return "env://"
    import torch.distributed as dist

    try:
        dist.register_rendezvous_handler(_ATTEMPT_SCHEME, _attempt_rendezvous)
    except RuntimeError:  # registered by an earlier store of this process
        pass
    return f"{_ATTEMPT_SCHEME}://"


def start_agent(rank: int, world: int, timeout_s: float) -> None:
    import torch.distributed.rpc as rpc

    global _AGENT_USERS
    with _AGENT_LOCK:
        if _AGENT_USERS == 0:
            if not rpc.is_available():
                raise UsageError("this PyTorch build has no torch.distributed.rpc, which the dist_* kvstores "
                                 "use; install a build with it, or use 'local'")
            # The "basic" channel copies CPU tensors through TensorPipe's shared-memory transport; on one host
            # it moved 8 MB round trips 3x faster than cross-memory attach ("cma") did.
            options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=timeout_s,
                                                      _channels=["basic"], init_method=_rendezvous_url())
            with warnings.catch_warnings():
                # init_rpc's own gather passes a backend where a group is expected, and says so each time
                warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
                rpc.init_rpc(agent_name(rank), rank=rank, world_size=world, rpc_backend_options=options)
        _AGENT_USERS += 1


def stop_agent(graceful: bool = True) -> None:
    """Leave the agent; the last store of the process shuts it down, ``graceful``: once every rank's agent
    has no work left, else at once (a failed worker must not wait for the peers that wait for it)."""
    import torch.distributed.rpc as rpc

    global _AGENT_USERS
    with _AGENT_LOCK:
        _AGENT_USERS -= 1
        if _AGENT_USERS == 0:
            rpc.shutdown(graceful=graceful)

"""Parameter servers for a Trainer that spans processes (d2l 12.7): which ranks serve, and how they do.

With a ``dist_*`` store the last ``num_servers`` ranks of the job (``dlperf launch --num-servers S``, or
``DLPERF_NUM_SERVERS``) are servers: they hold the weights, run the optimizer on the gradients the
workers push, and answer the workers' pulls with the new weights. The other ranks are the Trainer's
processes. With ``num_servers=0`` every worker also hosts a server for its share of the keys.

Worker and server ranks take part in the same collectives in the same order: the store's creation,
then :func:`worker_group` (the process group of the workers alone, which the Trainer spans).
"""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from ..kvstore import DistKVStore, KVStore, create_kvstore
from .launchers import rank_info

__all__ = ["is_dist_kvstore", "is_server_rank", "open_dist_kvstore", "serve_kvstore", "server_ranks", "worker_group"]


def is_dist_kvstore(kvstore: Any) -> bool:
    """Whether ``kvstore`` (a type name or a store) keeps its keys on server processes.

    The store's class says so; an unknown type name raises the registry's one line listing the types.

    >>> is_dist_kvstore("dist_sync"), is_dist_kvstore("local"), is_dist_kvstore(None)
    (True, False, False)
    """
    from ..kvstore.base import kvstore_class

    if isinstance(kvstore, str):
        return issubclass(kvstore_class(kvstore), DistKVStore)
    return isinstance(kvstore, DistKVStore)


def server_ranks(kvstore: Any) -> int:
    """How many of the job's ranks are parameter servers of a store of type ``kvstore``, not workers.

    The rule is the store's own: the last ``DLPERF_NUM_SERVERS`` ranks serve (none by default, nor for
    a store that is not distributed).
    """
    if not is_dist_kvstore(kvstore):
        return 0
    from ..kvstore.dist import server_count

    return server_count(None, max(rank_info().world_size, 2))


def is_server_rank(kvstore: Any) -> bool:
    """Whether the calling process is one of the job's parameter servers for a store of type ``kvstore``."""
    info = rank_info()
    return info.rank >= info.world_size - server_ranks(kvstore)


def worker_group(kv: KVStore) -> Any:
    """The process group of the store's workers (None: every rank is a worker). Collective on every rank."""
    import torch.distributed as dist

    workers = kv.num_workers
    if workers == dist.get_world_size():
        return None
    return dist.new_group(list(range(workers)))


def _dist_store(kvstore: str | KVStore) -> DistKVStore:
    kv = create_kvstore(kvstore) if isinstance(kvstore, str) else kvstore
    if not isinstance(kv, DistKVStore):
        if isinstance(kvstore, str):
            kv.close()
        raise UsageError(f"kvstore {kv.type!r} keeps its keys in this process; parameter servers need a distributed "
                         "store: use 'dist_sync' or 'dist_device_sync'")
    return kv


def open_dist_kvstore(kvstore: str | KVStore) -> tuple[DistKVStore, Any]:
    """A worker's store (created here from a type name) and its workers' group, for the Trainer."""
    kv = _dist_store(kvstore)
    try:
        group = worker_group(kv)
        if kv.role != "worker":
            raise UsageError(f"rank {rank_info().rank} is a server of the {kv.type!r} store, not a worker: "
                             "call dlperf.parallel.servers.serve_kvstore there instead of training")
    except BaseException:
        if isinstance(kvstore, str):
            kv.close()
        raise
    return kv, group


def serve_kvstore(kvstore: str, optimizer: Any = "sgd", optimizer_params: dict[str, Any] | None = None) -> None:
    """On a server rank: serve the Trainer's weights until every worker has closed its store.

    ``optimizer`` and ``optimizer_params`` must be the workers' Trainer's: the servers run the update.
    """
    import torch.distributed as dist

    from .optimizers import make_optimizer
    from .procs import join_processes

    # a script under dlperf launch or torchrun has no process group yet: the workers' Trainers start one
    axis = None if dist.is_initialized() else join_processes()
    try:
        kv = _dist_store(kvstore)
        try:
            worker_group(kv)
            kv.set_optimizer(lambda params: make_optimizer(optimizer, params, dict(optimizer_params or {})))
            kv.serve()
        finally:
            kv.close()
    finally:
        if axis is not None:
            axis.close()

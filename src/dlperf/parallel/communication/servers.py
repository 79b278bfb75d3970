"""Parameter servers for a Trainer that spans processes (d2l 12.7): which ranks serve, and how they do.

With a ``dist_*`` store the last ``num_servers`` ranks of the job (``dlperf launch --num-servers S``, or
``DLPERF_NUM_SERVERS``) are servers: they hold the weights, run the optimizer on the gradients the
workers push, and answer the workers' pulls with the new weights. The other ranks are the Trainer's
processes. With ``num_servers=0`` every worker also hosts a server for its share of the keys.

Worker and server ranks take part in the same collectives in the same order: the store's creation,
then :func:`worker_group` (the process group of the workers alone, which the Trainer spans).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ...errors import UsageError
from ...kvstore import DistKVStore, KVStore, create_kvstore
from ..launchers import rank_info
from .process_group import ExchangeReport, ExchangeRow

__all__ = ["ServerExchangeReport", "ServerRow", "close_and_report", "gather_server_exchanges", "is_dist_kvstore",
           "is_server_rank", "open_dist_kvstore", "serve_kvstore", "server_ranks", "worker_group"]


def is_dist_kvstore(kvstore: Any) -> bool:
    """Whether ``kvstore`` (a type name or a store) keeps its keys on server processes.

    The store's class says so; an unknown type name raises the registry's one line listing the types.

    >>> is_dist_kvstore("dist_sync"), is_dist_kvstore("local"), is_dist_kvstore(None)
    (True, False, False)
    """
    from ...kvstore.base import kvstore_class

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
    from ...kvstore.dist import server_count

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
                             "call dlperf.parallel.communication.servers.serve_kvstore there instead of training")
    except BaseException:
        if isinstance(kvstore, str):
            kv.close()
        raise
    return kv, group


# The straggler among parameter servers. A synchronous server answers a pull once every worker has pushed, so
# a worker's time in pushes and pulls is its transfer plus its wait for the last worker: the worker that spends
# least there held the others up (ExchangeReport's rule, as for sums across processes). A slow server slows
# every worker alike; it is named by its own time handling requests (not waiting between them), next to the
# other servers'.
_SLOW_SERVER_FACTOR = 2.0
_SLOW_SERVER_MIN_S = 1e-3
"""... and more than this per request above the others (below it the difference is noise)."""


@dataclass(frozen=True)
class ServerRow:
    """One server's share: its rank and host, seconds handling pushes and pulls, how many."""

    rank: int
    host: str
    busy_s: float
    requests: int


@dataclass(frozen=True)
class ServerExchangeReport(ExchangeReport):
    """The workers' time in pushes and pulls (:class:`ExchangeReport`'s rows) and the servers' own time.

    >>> workers = (ExchangeRow(0, "a", 1.0, 20), ExchangeRow(1, "b", 1.1, 20))
    >>> ServerExchangeReport(workers, (ServerRow(2, "c", 0.1, 40), ServerRow(3, "d", 2.1, 40))).slow_server().rank
    3
    >>> ServerExchangeReport(workers, (ServerRow(2, "c", 0.1, 40), ServerRow(3, "d", 0.12, 40))).slow_server() is None
    True
    """

    servers: tuple[ServerRow, ...] = field(default_factory=tuple)

    def slow_server(self) -> ServerRow | None:
        """The server that took more than twice every other's time (and 1 ms a request more), or ``None``.

        Only servers that answered requests are compared (one that holds no key answers none).
        """
        answering = [r for r in self.servers if r.requests]
        if len(answering) < 2:
            return None
        slow = max(answering, key=lambda r: r.busy_s)
        others = max(r.busy_s for r in answering if r is not slow)
        if slow.busy_s > _SLOW_SERVER_FACTOR * others and \
                (slow.busy_s - others) / max(1, slow.requests) > _SLOW_SERVER_MIN_S:
            return slow
        return None

    def describe(self) -> str:
        slow = self.slow_server()
        if slow is None:
            return super().describe().replace("sums across processes", "pushes and pulls to the parameter servers")
        others = [r.busy_s for r in self.servers if r is not slow and r.requests]
        return (f"straggler: server rank {slow.rank} on {slow.host} (it spent {slow.busy_s:.2f} s answering "
                f"{slow.requests} pushes and pulls, the other servers {min(others):.2f}-{max(others):.2f} s)")

    def as_dict(self) -> dict[str, Any]:
        doc = super().as_dict()
        slow = self.slow_server()
        if slow is not None:
            doc["straggler"] = {"rank": slow.rank, "host": slow.host, "cause": "slow server"}
        doc["servers"] = [{"rank": r.rank, "host": r.host, "busy_s": r.busy_s, "requests": r.requests}
                          for r in self.servers]
        return doc


def gather_server_exchanges(kv: DistKVStore) -> ServerExchangeReport | None:
    """Hand this rank's times over (worker or server); on the job's first rank, collect every rank's into the
    report that names the straggler
    (:func:`~dlperf.parallel.communication.process_group.last_exchange_report` returns it after).

    Through the launch's rendezvous store: a worker hands its times over once its store has closed, a
    server (:func:`serve_kvstore`) once it has served, before it closes; a worker's close waits for every
    rank's (RPC's graceful shutdown), so the servers' are there by then. The first rank waits at most
    ``procs._GATHER_TIMEOUT_S`` for a missing worker, then reports nothing; a server that served otherwise (its
    own ``serve()``) is left out of the report. ``None`` on the other ranks and outside a launcher's agent.
    """
    from ..launchers import rank_host
    from .process_group import gather_store, hand_over, keep_exchange_report

    store = gather_store("server-exchanges")
    mine = kv.exchange_times()
    if store is None:
        return None
    workers_only = [str(r) for r in range(kv.num_workers)]
    if not hand_over(store, mine["rank"], [rank_host(), mine], workers_only):
        return None
    keys = workers_only + [str(r) for r in range(kv.num_workers, mine["world"]) if store.check([str(r)])]
    workers, servers = [], []
    for key in keys:
        r = int(key)
        host, times = json.loads(store.get(key))
        if times.get("worker") is not None:
            seconds, count = times["worker"]
            workers.append(ExchangeRow(r, str(host), float(seconds), int(count)))
        if times.get("server") is not None:
            busy, requests = times["server"]
            servers.append(ServerRow(r, str(host), float(busy), int(requests)))
    report = ServerExchangeReport(tuple(workers), tuple(servers))
    keep_exchange_report(report)
    return report


def close_and_report(store: Any, *, gather: bool = True) -> ServerExchangeReport | None:
    """Close a worker's bound store (:class:`~dlperf.parallel.strategies.store.BoundStore`); when it was opened
    here and ``gather``, hand the times over (:func:`gather_server_exchanges`) and return the report.

    A store the caller passed in stays open, so its servers are still serving: nothing is gathered then.
    """
    kv = None
    if store.owned:
        try:
            kv = store.kv
        except RuntimeError:  # never opened
            kv = None
    store.close()
    if isinstance(kv, DistKVStore) and gather and not kv.exchange_times()["broken"]:
        return gather_server_exchanges(kv)
    return None


def serve_kvstore(kvstore: str, optimizer: Any = "sgd", optimizer_params: dict[str, Any] | None = None) -> None:
    """On a server rank: serve the Trainer's weights until every worker has closed its store.

    ``optimizer`` and ``optimizer_params`` must be the workers' Trainer's: the servers run the update.
    """
    import torch.distributed as dist

    from ..optimizers import make_optimizer
    from .process_group import join_processes

    # a script under dlperf launch or torchrun has no process group yet: the workers' Trainers start one
    axis = None if dist.is_initialized() else join_processes()
    try:
        kv = _dist_store(kvstore)
        try:
            worker_group(kv)
            kv.set_optimizer(lambda params: make_optimizer(optimizer, params, dict(optimizer_params or {})))
            kv.serve()
            gather_server_exchanges(kv)  # before closing: the workers' close waits for this rank's
        finally:
            kv.close()
    finally:
        if axis is not None:
            axis.close()

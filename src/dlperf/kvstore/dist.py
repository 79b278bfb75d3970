"""Distributed stores: one key space shared by the processes of a job (d2l 12.7.3-12.7.4).

``dist_sync``, ``dist_async`` and ``dist_device_sync`` keep :class:`~dlperf.kvstore.KVStore`'s interface across
processes started by a launcher (:class:`~dlperf.parallel.launchers.ProcessLauncher`, ``torchrun``). Every rank
creates the store; the last ``num_servers`` ranks serve (:meth:`DistKVStore.serve`), the others work, and with
``num_servers=0`` every worker also hosts a server. A small key lives on one server, a big one is split across
all of them. Between hosts the requests go over torch RPC; inside a host the payloads go through shared memory
(:mod:`dlperf.kvstore.shm`) and the requests through a control channel (:mod:`dlperf.kvstore.control`).

This module is the client, :class:`DistKVStore`; key placement, the wire format, the server and the RPC agent
have a module each (:mod:`~dlperf.kvstore.placement`, :mod:`~dlperf.kvstore.wire`,
:mod:`~dlperf.kvstore.server`, :mod:`~dlperf.kvstore.rpc_agent`). Roles, placement, each store's semantics and
the transports: docs/design/kvstore.md.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._shm import ShmUnavailableError
from .._threads import cleanup_step
from ..errors import UsageError
from .base import Key, KVStore, as_tensor_list, key_value_pairs, register_kvstore
from .control import ControlClient, KVStoreLinkError
from .placement import BIG_ARRAY_BOUND, Placement, Slice
from .rpc_agent import agent_name, start_agent, stop_agent
from .server import SERVERS, Server, serve_call
from .shm import SHM_ENV, Arena, WorkerSlots, shm_wanted
from .wire import BYE, DTYPES, INIT, LOAD, OK, PULL, PUSH, PUSHPULL, STATE, from_wire, key_of, to_wire

__all__ = ["NUM_SERVERS_ENV", "SHM_ENV", "server_count", "join_launched_processes",
           "DistKVStore", "DistSyncKVStore", "DistAsyncKVStore", "DistDeviceSyncKVStore", "Placement",
           "BIG_ARRAY_BOUND"]

_PIPELINE_STAGES = 4  # a same-host pushpull is cut into at most about this many requests
_PIPELINE_MIN_BYTES = 1 << 20  # and none smaller than this, where a request's cost would dominate
_GENERATIONS = itertools.count()

NUM_SERVERS_ENV = "DLPERF_NUM_SERVERS"


def server_count(given: int | None, world: int) -> int:
    """How many of ``world`` ranks are servers: ``given``, else ``DLPERF_NUM_SERVERS``, else 0 (co-located).

    The last that many ranks serve; the rule every module that asks who serves goes through.
    """
    if given is None:
        text = os.environ.get(NUM_SERVERS_ENV, "0")
        try:
            given = int(text)
        except ValueError:
            raise UsageError(f"{NUM_SERVERS_ENV}={text!r}: expected an integer >= 0; unset it for "
                             "servers co-located with the workers") from None
    if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given < world:
        raise UsageError(f"num_servers={given!r}: expected an integer from 0 (co-located) to {world - 1}, "
                         f"leaving at least one worker among the {world} ranks")
    return given


def _env_int(name: str, kind: str) -> int:
    text = os.environ.get(name, "")
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"kvstore type {kind!r}: {name}={text[:40]!r} is not an integer; start the processes "
                         "with dlperf launch or torchrun, or unset it") from None


def join_launched_processes(kind: str = "dist_sync") -> bool:
    """Join the gloo process group a launcher's environment describes; False when there is none to join.

    A script started by ``dlperf launch`` or ``torchrun`` has ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` but no group yet: as MXNet's ``kv.create('dist_sync')`` and dlperf's Trainer do, the
    store joins by itself. Under a launcher's agent the group meets on that attempt's keys of the agent's
    store, so a restarted group never reads its predecessor's. The group lasts as long as the process.
    """
    import atexit

    import torch.distributed as dist

    from .._attempt import attempt_store

    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(os.environ.get(name) for name in needed):
        return False
    rank, world = _env_int("RANK", kind), _env_int("WORLD_SIZE", kind)
    if not 0 <= rank < world:
        raise UsageError(f"kvstore type {kind!r}: RANK={rank} with WORLD_SIZE={world}; expected 0 <= RANK < "
                         "WORLD_SIZE (start the processes with dlperf launch or torchrun)")
    store = attempt_store("kvstore-group/")
    if store is None:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    atexit.register(_leave_group)
    return True


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class DistKVStore(KVStore):
    """A KVStore whose keys live on server processes; see the module docstring for roles and semantics.

    Args:
        num_servers: how many of the last ranks are servers; 0 co-locates one server with each worker.
            Default: ``DLPERF_NUM_SERVERS`` or 0.
        staleness: ``dist_async`` only: the bound tau on how many pushes workers may drift apart.
        big_array_bound: keys with at least this many elements are split across all servers.
        timeout_s: the longest one call waits for its servers (a sync pull waits for the slowest worker).
        shared_memory: move the slices of same-host servers through shared memory (see
            :mod:`dlperf.kvstore.shm`); default: ``DLPERF_KVSTORE_SHM`` (on unless ``off``). Every rank
            decides for itself: a server that does not offer it, or a worker that does not want it,
            keeps those payloads on RPC.
    """

    type = "dist_sync"
    _sync = True
    _local_sum_on_device = False

    def __init__(self, kind: str | None = None, *, num_servers: int | None = None, staleness: int | None = None,
                 big_array_bound: int = BIG_ARRAY_BOUND, timeout_s: float = 300.0,
                 shared_memory: bool | None = None) -> None:
        super().__init__(kind)
        import torch.distributed as dist

        if dist.is_available() and not dist.is_initialized():
            join_launched_processes(self.type)
        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError(f"kvstore type {self.type!r} needs torch.distributed's process group; start the "
                             "workers with dlperf launch, torchrun or ProcessLauncher(n, backend='gloo'), or "
                             "use 'local'")
        world, rank = dist.get_world_size(), dist.get_rank()
        num_servers = server_count(num_servers, world)
        if staleness is not None and (self._sync or isinstance(staleness, bool) or not isinstance(staleness, int)
                                      or staleness < 0):
            raise UsageError(f"staleness={staleness!r}: expected None or an integer >= 0, and only with "
                             "'dist_async' (the sync stores never let workers drift apart)")
        if isinstance(big_array_bound, bool) or not isinstance(big_array_bound, int) or big_array_bound < 1:
            raise UsageError(f"big_array_bound={big_array_bound!r}: expected an integer >= 1 (elements)")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise UsageError(f"timeout_s={timeout_s!r}: expected a positive number of seconds")
        self.staleness = staleness
        self._shm = shm_wanted(shared_memory)
        self._slots: dict[tuple[Key, int], WorkerSlots] = {}  # same-host remote slices, by (key, part)
        self._arenas: dict[tuple[int, int], Arena | None] = {}  # (server, arena): mapped, or None if it failed
        self._shm_refused: dict[int, str] = {}  # server -> why its arenas could not be mapped here
        self._control: dict[int, ControlClient] = {}  # same-host servers: requests without RPC
        self._timeout_s = float(timeout_s)
        self._broken = False  # a request failed for want of its server: close without waiting for the others
        self._traffic = {"shm": 0, "rpc": 0, "in-process": 0}
        self._requests = {"control": 0, "rpc": 0, "in-process": 0}
        # this worker's seconds in pushes and pulls and how many (the first left out: it sets up the slots)
        self._exchange_clock = [0.0, 0, 0]
        self._global_rank = rank
        workers = world - num_servers
        self._worker_ranks = list(range(workers))
        servers = list(range(workers, world)) if num_servers else list(self._worker_ranks)
        self.role = "server" if rank >= workers else "worker"
        self._placement = Placement(servers, big_array_bound)
        self._meta: dict[Key, tuple[torch.Size, torch.dtype]] = {}
        self._pushed: dict[Key, int] = {}
        # every rank creates its stores in the same order, so the n-th store has the same id everywhere
        self._id = f"{type(self).type}/{next(_GENERATIONS)}"
        self._server = Server(self) if rank in servers else None
        if self._server is not None:
            SERVERS[self._id] = self._server
        try:
            start_agent(rank, world, float(timeout_s))
        except BaseException:
            SERVERS.pop(self._id, None)
            raise
        dist.barrier()  # every rank's server is registered before any request can reach it

    # -- who we are --------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._global_rank if self.role == "worker" else -1

    @property
    def num_workers(self) -> int:
        return len(self._worker_ranks)

    @property
    def num_servers(self) -> int:
        return len(self._placement.servers)

    def placement(self) -> Placement:
        """Where each initialized key lives; ``print(store.placement())`` shows a table."""
        return self._placement

    def exchange_times(self) -> dict[str, Any]:
        """This rank's place in the job (``rank`` of ``world``, workers then servers), whether a request failed
        for want of its server (``broken``), and what it spent: as a worker, seconds in pushes and pulls and how
        many (the first, which sets up the slots, left out); as a server, seconds handling requests and how many."""
        server = self._server
        return {"rank": self._global_rank, "world": max(self.num_workers, max(self._placement.servers) + 1),
                "broken": self._broken, "worker": self._exchange_clock[:2] if self.role == "worker" else None,
                "server": [server.busy_s, server.requests] if server is not None else None}

    def traffic(self) -> dict[str, Any]:
        """Payload bytes this worker pushed and pulled, by path: ``shm`` (shared memory), ``rpc``, ``in-process``
        (its co-located server); ``requests`` it sent, by channel (``control``, ``rpc``, ``in-process``); and
        ``refused``: servers whose shared memory could not be mapped here, and why.
        """
        return {**self._traffic, "requests": dict(self._requests), "refused": dict(self._shm_refused)}

    def _home(self, key: Key, like: torch.Tensor, devices: Sequence[torch.device]) -> torch.device:
        return torch.device("cpu")

    def _merge_mode(self) -> str:
        return "updater" if self._updater is not None else "optimizer" if self._factory is not None else "assign"

    def _check_worker(self) -> None:
        self._check_open()
        if self.role != "worker":
            raise UsageError(f"rank {self._global_rank} is a server of this {self.type!r} store: it serves, it "
                             "does not push or pull; call serve() there")

    # -- requests ----------------------------------------------------------------------------------
    def _send(self, server: int, op: int, meta: dict, tensors: Sequence[torch.Tensor] = (),
              control: bool = False) -> Callable[[], tuple[dict, list[torch.Tensor]]]:
        """Send one request; the returned function waits for its reply (so requests to servers overlap).

        ``control``: through the server's control channel (every slice of it is in shared memory).
        """
        import torch.distributed.rpc as rpc

        self._requests["control" if control else "in-process" if server == self._global_rank else "rpc"] += 1
        if control:
            try:
                answer = self._control[server].request(op, meta, f"a {'push pull pushpull'.split()[op - PUSH]}")
            except KVStoreLinkError:
                self._broken = True
                raise

            def wait_control() -> tuple[dict, list[torch.Tensor]]:
                try:
                    code, reply = answer()
                except KVStoreLinkError:
                    self._broken = True
                    raise
                if code != OK:
                    raise UsageError(f"kvstore server rank {server}: {reply.get('error', 'failed')}")
                return reply, []

            return wait_control
        wire = to_wire(tensors) if tensors else []
        args = (self._id, self._global_rank, op, meta, wire)
        if server == self._global_rank:
            future = serve_call(*args)  # the co-located server: no message at all
        else:
            try:
                future = rpc.rpc_async(agent_name(server), serve_call, args=args)
            except RuntimeError:  # the agent lost its peer
                self._broken = True
                raise

        def wait() -> tuple[dict, list[torch.Tensor]]:
            try:
                code, reply, body = future.wait()
            except RuntimeError:  # a server that timed out or went away: no goodbye will reach it either
                self._broken = True
                raise
            if code != OK:
                raise UsageError(f"kvstore server rank {server}: {reply.get('error', 'failed')}")
            return reply, body

        return wait

    def _slices(self, key: Key) -> list[Slice]:
        return self._placement.keys[key]

    def _slice(self, key: Key, part: int) -> Slice:
        return self._slices(key)[part]

    def _by_server(self, keys: Sequence[Key]) -> dict[int, list[tuple[Key, Slice]]]:
        groups: dict[int, list[tuple[Key, Slice]]] = {}
        for key in keys:
            for s in self._slices(key):
                groups.setdefault(s.server, []).append((key, s))
        return groups

    # -- init ----------------------------------------------------------------------------------------
    def init(self, key: Key | Sequence[Key], value: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Create keys on their servers from rank 0's values; returns once every worker has called it."""
        self._check_worker()
        pairs = key_value_pairs(key, value, "init")
        keys = [k for k, _ in pairs]
        values = [as_tensor_list(v, "init")[0] for _, v in pairs]
        for k, v in zip(keys, values, strict=True):
            self._check_key_type(k)
            if k in self._meta or keys.count(k) > 1:
                raise UsageError(f"key {k!r} is already initialized; each key is initialized once")
            if str(v.dtype) not in DTYPES:
                raise UsageError(f"key {k!r} holds {v.dtype}; a dist store holds one of {', '.join(DTYPES)}")
        for k, v in zip(keys, values, strict=True):
            self._meta[k] = (v.shape, v.dtype)
            self._pushed[k] = 0
            self._placement.place(k, v.numel())
        flat = {k: v.detach().to("cpu").reshape(-1) for k, v in zip(keys, values, strict=True)}
        mode = self._merge_mode()
        waits = {}
        for server, items in self._by_server(keys).items():
            meta: dict[str, Any] = {"mode": mode, "items": [[k, s.part, str(self._meta[k][1]), s.stop - s.start,
                                             list(self._meta[k][0]) if len(self._slices(k)) == 1 else None]
                                            for k, s in items]}
            if self._shm:  # (a co-located worker's init may be the one that creates its server's slots)
                meta.update(shm=True, host=socket.gethostname())
            tensors = [flat[k][s.start:s.stop] for k, s in items] if self.rank == 0 else []
            waits[server] = self._send(server, INIT, meta, tensors)
        for server, wait in waits.items():
            self._adopt_slots(server, wait()[0].get("shm"))

    def _map_arena(self, server: int, row: Any) -> None:
        if not (isinstance(row, list) and len(row) == 5 and isinstance(row[0], int)):
            raise UsageError(f"kvstore server rank {server} named arena {row!r}; expected [id, pid, fd, token, "
                             "bytes]: every rank must run the same dlperf")
        ident, pid, fd, token, nbytes = row
        if (server, ident) in self._arenas:
            return
        try:
            self._arenas[(server, ident)] = Arena.attach({"pid": pid, "fd": fd, "token": token}, nbytes)
        except ShmUnavailableError as exc:  # another host or pid namespace: RPC carries these slices
            self._arenas[(server, ident)] = None
            self._shm_refused[server] = str(exc)

    def _adopt_slots(self, server: int, offer: Any) -> None:
        """Map the arenas a same-host server offered and find this worker's slots in them."""
        if offer is None:
            return
        if not isinstance(offer, dict) or not isinstance(offer.get("arenas"), list) \
                or not isinstance(offer.get("slots"), list):
            raise UsageError(f"kvstore server rank {server} offered shared memory as {type(offer).__name__}; "
                             "expected its arenas and slots: every rank must run the same dlperf")
        for row in offer["arenas"]:
            self._map_arena(server, row)
        for row in offer["slots"]:
            if not (isinstance(row, list) and len(row) == 6):
                raise UsageError(f"kvstore server rank {server} named slots {row!r}; expected [key, part, arena, "
                                 "value offset, value offset, exchange offset]: every rank must run the same dlperf")
            name, part, ident, *offsets = row
            key = key_of(name)
            slices = self._placement.keys.get(key, [])
            if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part < len(slices) \
                    or slices[part].server != server:
                raise UsageError(f"kvstore server rank {server} offered a slot for key {key!r} part {part!r}, "
                                 "which it does not hold")
            arena = self._arenas.get((server, ident)) if isinstance(ident, int) else None
            if arena is None:
                continue
            numel, dtype = slices[part].stop - slices[part].start, self._meta[key][1]
            views = [arena.view(o, numel, dtype) for o in offsets]
            self._slots[(key, part)] = WorkerSlots(views[:2], views[2])
        control = offer.get("control")
        if server not in self._control and any(a is not None for (s, _), a in self._arenas.items() if s == server):
            if not (isinstance(control, list) and len(control) == 2 and all(isinstance(c, str) for c in control)
                    and control[0].startswith("dlperf-kvstore-") and len(control[0]) < 100):
                raise UsageError(f"kvstore server rank {server} named control channel {control!r}; expected "
                                 "[name, token]: every rank must run the same dlperf")
            pid = next(a.owner_pid for (s, _), a in self._arenas.items() if s == server and a is not None)
            self._control[server] = ControlClient(control[0], control[1], self._global_rank, server, self._timeout_s,
                                                  pid)

    # -- push and pull -----------------------------------------------------------------------------
    def _get(self, key: Key) -> torch.Tensor:
        try:
            shape, dtype = self._meta[key]
        except KeyError:
            raise UsageError(f"key {key!r} is not initialized; call init({key!r}, value) first") from None
        return torch.empty(shape, dtype=dtype, device="meta")

    def keys(self) -> list[Key]:
        return list(self._meta)

    def _local_sum(self, key: Key, values: list[torch.Tensor]) -> torch.Tensor:
        home = values[0].device if self._local_sum_on_device else torch.device("cpu")
        total = self._reduce(home, values) if len(values) > 1 else values[0]
        return total.to("cpu", self._meta[key][1]).reshape(-1)

    def _path(self, server: int, key: Key, part: int) -> tuple[str, WorkerSlots | None]:
        if server == self._global_rank:
            return "in-process", None
        slots = self._slots.get((key, part))
        return ("rpc", None) if slots is None else ("shm", slots)

    def _push_items(self, pairs: Sequence[tuple[Key, list[torch.Tensor]]]) -> dict[int, tuple[list, list]]:
        """Per server: the (key, part, dtype, numel[, 1 if in its exchange slot]) items and the slices on the wire."""
        sums = {k: self._local_sum(k, vs) for k, vs in pairs}
        out: dict[int, tuple[list, list]] = {}
        for server, items in self._by_server([k for k, _ in pairs]).items():
            meta, tensors = out.setdefault(server, ([], []))
            for k, s in items:
                item = [k, s.part, str(self._meta[k][1]), s.stop - s.start]
                part = sums[k][s.start:s.stop]
                path, slots = self._path(server, k, s.part)
                if slots is not None:
                    slots.exchange.copy_(part)
                    item.append(1)
                else:
                    tensors.append(part)
                meta.append(item)
                self._traffic[path] += part.numel() * part.element_size()
        for k, _ in pairs:
            self._pushed[k] += 1
        return out

    def _pull_items(self, keys: Sequence[Key]) -> dict[int, list]:
        """Per server: the (key, part, pushes so far[, 1 to answer through shared memory]) items of one pull."""
        return {server: [[k, s.part, self._pushed[k]] + ([1] if self._path(server, k, s.part)[1] else [])
                         for k, s in items]
                for server, items in self._by_server(keys).items()}

    def _pulled(self, server: int, items: list, reply: dict, body: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each pulled slice: off the wire, or the slot the server's reply names."""
        where = reply.get("where")
        if not (isinstance(where, list) and len(where) == len(items)
                and all(type(w) is int and w in (-1, 0, 1, 2) for w in where)):  # not True, not 1.0
            raise UsageError(f"kvstore server rank {server} answered a pull of {len(items)} slices with "
                             f"where={where!r}; expected one of -1, 0, 1, 2 per slice: every rank must run the "
                             "same dlperf")
        specs = [(str(self._meta[item[0]][1]), self._slice(item[0], item[1]).stop - self._slice(item[0], item[1]).start)
                 for item, w in zip(items, where, strict=True) if w == -1]
        on_wire = iter(from_wire(body, specs))
        out = []
        for item, w in zip(items, where, strict=True):
            path, slots = self._path(server, item[0], item[1])
            if w == -1:
                got = next(on_wire)
                path = "in-process" if path == "in-process" else "rpc"
            elif slots is None:
                raise UsageError(f"kvstore server rank {server} answered key {item[0]!r} through a shared-memory "
                                 "slot this worker does not have")
            else:
                got = slots.reply(w)
            self._traffic[path] += got.numel() * got.element_size()
            out.append(got)
        return out

    def _deliver(self, pulls: Sequence[tuple[Key, list[torch.Tensor]]], server_items: dict[int, list],
                 replies: dict[int, tuple[dict, list[torch.Tensor]]]) -> None:
        full: dict[Key, torch.Tensor] = {}
        for server, items in server_items.items():
            for (k, part, *_), got in zip(items, self._pulled(server, items, *replies[server]), strict=True):
                if len(self._slices(k)) == 1:
                    full[k] = got.view(self._meta[k][0])  # whole on one server: no assembly
                    continue
                if k not in full:
                    full[k] = torch.empty(self._meta[k][0], dtype=self._meta[k][1])
                s = self._slice(k, part)
                full[k].view(-1)[s.start:s.stop].copy_(got)
        with torch.no_grad():
            for k, outs in pulls:
                for o in outs:
                    o.copy_(full[k], non_blocking=True)

    def _exchange(self, pushes: Sequence[tuple[Key, list[torch.Tensor]]],
                  pulls: Sequence[tuple[Key, list[torch.Tensor]]]) -> None:
        """One request per server carrying every push and pull of the call; requests overlap."""
        # Held from before the push counts are taken (a pull's wait then never needs a push stuck behind it)
        # to the last copy out of a slot; in a fixed order, so two calls cannot each hold what the other needs.
        locks = self._exchange_locks(pushes, pulls)
        start = time.perf_counter()
        for lock in locks:
            lock.acquire()
        try:
            self._exchange_locked(pushes, pulls)
        finally:
            for lock in reversed(locks):
                lock.release()
            clock = self._exchange_clock
            if clock[2]:
                clock[0] += time.perf_counter() - start
                clock[1] += 1
            clock[2] = 1

    def _exchange_locks(self, pushes: Sequence[tuple[Key, list[torch.Tensor]]],
                        pulls: Sequence[tuple[Key, list[torch.Tensor]]]) -> list[threading.Lock]:
        """The locks of the exchange slots this call writes, or (async: answers land there) reads."""
        keys = [k for k, _ in pushes] + ([] if self._sync else [k for k, _ in pulls])
        found: dict[int, threading.Lock] = {}
        for k in keys:
            for s in self._slices(k):
                slots = self._slots.get((k, s.part))
                if slots is not None:
                    found[id(slots.lock)] = slots.lock
        return [found[i] for i in sorted(found)]

    def _exchange_locked(self, pushes: Sequence[tuple[Key, list[torch.Tensor]]],
                         pulls: Sequence[tuple[Key, list[torch.Tensor]]]) -> None:
        if self._pipelines(pushes, pulls):
            self._pipelined_pushpull(pushes, pulls)
            return
        push_items = self._push_items(pushes) if pushes else {}
        pull_items = self._pull_items([k for k, _ in pulls]) if pulls else {}
        waits = {}
        for server in sorted(set(push_items) | set(pull_items)):
            meta_items, tensors = push_items.get(server, ([], []))
            wanted = pull_items.get(server)
            # every slice in shared memory: the control channel carries the request
            control = server in self._control and all(len(i) > 4 for i in meta_items) \
                and all(len(i) > 3 for i in wanted or ())
            if wanted is None:
                waits[server] = self._send(server, PUSH, {"items": meta_items}, tensors, control)
            elif not meta_items:
                waits[server] = self._send(server, PULL, {"items": wanted}, control=control)
            else:
                waits[server] = self._send(server, PUSHPULL, {"push": meta_items, "pull": wanted}, tensors, control)
        replies = {server: wait() for server, wait in waits.items()}
        if pulls:
            self._deliver(pulls, pull_items, replies)

    def _pipelines(self, pushes: Sequence[tuple[Key, list[torch.Tensor]]],
                   pulls: Sequence[tuple[Key, list[torch.Tensor]]]) -> bool:
        """Whether a pushpull can run as a pipeline: whole keys, each in slots of a same-host server."""
        if len(pushes) < 2 or [k for k, _ in pushes] != [k for k, _ in pulls]:
            return False
        for k, _ in pushes:
            slices = self._slices(k)
            if len(slices) != 1 or slices[0].server not in self._control or (k, 0) not in self._slots:
                return False
        return True

    def _pipelined_pushpull(self, pushes: Sequence[tuple[Key, list[torch.Tensor]]],
                            pulls: Sequence[tuple[Key, list[torch.Tensor]]]) -> None:
        """Requests of about a quarter of the bytes each: the server sums one while this worker copies the next.

        One request for everything would leave the server idle while the workers copy in, and the workers
        idle while it sums; and each key's slots are still in cache when the next stage reads them.
        """
        total = sum(self._slots[(k, 0)].exchange.nbytes for k, _ in pushes)
        cut = max(_PIPELINE_MIN_BYTES, total // _PIPELINE_STAGES)
        groups: list[list[int]] = []
        size = 0
        for i, (k, _) in enumerate(pushes):
            server = self._slices(k)[0].server
            if not groups or size >= cut or self._slices(pushes[groups[-1][0]][0])[0].server != server:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += self._slots[(k, 0)].exchange.nbytes
        for k, _ in pushes:
            self._pushed[k] += 1
        waits = []
        for group in groups:
            push_meta, pull_meta = [], []
            for i in group:
                k, values = pushes[i]
                slots = self._slots[(k, 0)]
                slots.exchange.copy_(self._local_sum(k, values))
                push_meta.append([k, 0, str(self._meta[k][1]), slots.exchange.numel(), 1])
                pull_meta.append([k, 0, self._pushed[k], 1])
                self._traffic["shm"] += slots.exchange.nbytes
            server = self._slices(pushes[group[0]][0])[0].server
            waits.append((group, server, pull_meta,
                          self._send(server, PUSHPULL, {"push": push_meta, "pull": pull_meta}, control=True)))
        with torch.no_grad():
            for group, server, pull_meta, wait in waits:
                for i, got in zip(group, self._pulled(server, pull_meta, *wait()), strict=True):
                    k, outs = pulls[i]
                    for o in outs:
                        o.copy_(got.view(self._meta[k][0]), non_blocking=True)

    def _push_now(self, key: Key, values: list[torch.Tensor]) -> None:
        self._exchange([(key, values)], [])

    def _pull_now(self, key: Key, outs: list[torch.Tensor]) -> None:
        self._exchange([], [(key, outs)])

    @staticmethod
    def _pairs(key: Key | Sequence[Key], value: Any, check: Callable[[Key, Any], list[torch.Tensor]],
               call: str) -> list[tuple[Key, list[torch.Tensor]]]:
        return [(k, check(k, v)) for k, v in key_value_pairs(key, value, call)]

    def push(self, key, value, priority: int = 0) -> None:
        self._check_worker()
        pairs = self._pairs(key, value, self._check_push, "push")
        for k, _ in pairs:
            self._settle(k)
        self._exchange(pairs, [])

    def pull(self, key, out, priority: int = 0) -> None:
        self._check_worker()
        pairs = self._pairs(key, out, self._check_pull, "pull")
        for k, _ in pairs:
            self._settle(k)
        self._exchange([], pairs)

    def pushpull(self, key, value, out=None, priority: int = 0) -> None:
        """``push`` then ``pull`` in one request per server."""
        self._check_worker()
        pushes = self._pairs(key, value, self._check_push, "push")
        pulls = self._pairs(key, value if out is None else out, self._check_pull, "pull")
        for k, _ in pushes:
            self._settle(k)
        self._exchange(pushes, pulls)

    def pushpull_async(self, key, value, out=None, priority: int = 0):
        self._check_worker()
        self._single(key, "pushpull_async")
        values = self._check_push(key, value)
        outs = self._check_pull(key, value if out is None else out)
        return self._get_engine().push(self._exchange, args=([(key, values)], [(key, outs)]),
                                       writes=(self._var(key),), device=self._lane, priority=priority,
                                       name=f"kvstore pushpull {key}", kind=self._lane_kind)

    def push_async(self, key, value, priority: int = 0):
        self._check_worker()
        return super().push_async(key, value, priority)

    def pull_async(self, key, out, priority: int = 0):
        self._check_worker()
        return super().pull_async(key, out, priority)

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every key's value and the servers' optimizer states, gathered from the servers."""
        self._check_worker()
        self.wait_all()
        keys = list(self._meta)
        values = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in self._meta.items()}
        # a pull waits for the rounds this worker pushed, so the values include them; no round ends
        # while this worker is here (it would need this worker's next push), so optimizer states match
        if keys:
            self.pull(keys, out=[values[k] for k in keys])
        optimizers: dict[Key, dict[int, Any]] = {}
        waits = [self._send(server, STATE, {}) for server in self._placement.servers]
        for wait in waits:
            for name, part, state in wait()[0]["optimizers"]:
                if key_of(name) in values:
                    optimizers.setdefault(name, {})[part] = state
        return {"values": values, "optimizers": optimizers, "parts": {k: len(self._slices(k)) for k in values}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put a :meth:`state_dict` back on the servers; every worker calls it (rank 0's state counts)."""
        self._check_worker()
        self.wait_all()
        values = state["values"]
        new = [k for k in values if k not in self._meta]
        if new:
            self.init(new, [values[k] for k in new])
        for key, parts in state.get("optimizers", {}).items():
            if key in self._meta and len(parts) != len(self._slices(key)):
                raise UsageError(f"the checkpoint holds key {key!r}'s optimizer state in {len(parts)} parts but "
                                 f"this store splits it in {len(self._slices(key))}; load it with the same "
                                 "number of servers and big_array_bound")
        waits = []
        for server in self._placement.servers:
            items, tensors = [], []
            if self.rank == 0:
                for key, value in values.items():
                    for s in self._slices(key):
                        if s.server == server:
                            part_state = state.get("optimizers", {}).get(key, {}).get(s.part)
                            items.append([key, s.part, str(self._meta[key][1]), s.stop - s.start, part_state])
                            tensors.append(value.to("cpu", self._meta[key][1]).reshape(-1)[s.start:s.stop])
            waits.append(self._send(server, LOAD, {"items": items}, tensors))
        for wait in waits:
            wait()

    # -- lifetime ---------------------------------------------------------------------------------------
    def serve(self) -> None:
        """On a server rank: answer the workers until every one of them has closed its store."""
        self._check_open()
        if self.role != "server":
            raise UsageError(f"serve() runs on server ranks; rank {self._global_rank} is a worker (servers are "
                             f"ranks {self._placement.servers})")
        assert self._server is not None  # every server rank holds one
        self._server.start_serving()
        self._server.all_closed.wait()

    def close(self) -> None:
        """Finish pending calls and tell every server this worker is done; then leave the RPC agent.

        Collective: it returns once every rank has closed (RPC's graceful shutdown). A store whose server
        was lost (a failed request), or closed as an exception leaves its ``with`` block, leaves without the
        goodbyes and the shutdown's wait for the other ranks, so the failure ends the job within its bounds.
        """
        if self._closed:
            return
        try:
            if self.role == "worker":
                try:
                    self.wait_all()
                finally:
                    if not self._broken:  # after a lost server, goodbyes would wait for timeout_s in vain
                        for wait in [self._send(server, BYE, {}) for server in self._placement.servers]:
                            wait()
                    # a co-located server stays until every worker has said goodbye: with another store still
                    # open, leaving the RPC agent is no barrier, and a slower peer's goodbye would find no store
                    if not self._broken and self._server is not None \
                            and not self._server.all_closed.wait(self._timeout_s):
                        raise UsageError(f"kvstore {self._id}: not every worker closed the store within "
                                         f"timeout_s={self._timeout_s:g} s; every rank must close it")
        finally:
            try:
                super().close()
            finally:
                # a worker that failed leaves at once: RPC's graceful shutdown would wait for every rank,
                # and the others wait for this one; its exit is what ends the job (through the launcher)
                stop_agent(graceful=not self._broken)
                SERVERS.pop(self._id, None)
                self._release_shared_memory()

    def __exit__(self, *exc: object) -> None:
        error = exc[1] if len(exc) > 1 else None
        if isinstance(error, BaseException) and not isinstance(error, UsageError):  # a misuse: servers intact
            self._broken = True
        self.close()

    def _release_shared_memory(self) -> None:
        for client in self._control.values():
            client.close()
        self._control, server = {}, self._server
        try:  # the control threads' error is raised once the memory is released, never instead of another
            with cleanup_step("the kvstore's control server"):
                if server is not None and server.control is not None:
                    control, server.control = server.control, None
                    control.close()
        finally:
            arenas = [a for a in self._arenas.values() if a is not None] + (server.arenas if server else [])
            self._slots, self._arenas = {}, {}
            if server is not None:
                server.entries, server.arenas = {}, []
            for arena in arenas:
                arena.close()


class DistSyncKVStore(DistKVStore):
    """``dist_sync``: every round merges one push from each worker before a pull sees it."""

    type = "dist_sync"


class DistAsyncKVStore(DistKVStore):
    """``dist_async``: pushes merge on arrival; ``staleness`` bounds the drift between workers."""

    type = "dist_async"
    _sync = False


class DistDeviceSyncKVStore(DistKVStore):
    """``dist_device_sync``: ``dist_sync`` with each worker's device values summed on a device first."""

    type = "dist_device_sync"
    _local_sum_on_device = True


register_kvstore("dist_sync", DistSyncKVStore)
register_kvstore("dist_async", DistAsyncKVStore)
register_kvstore("dist_device_sync", DistDeviceSyncKVStore)

"""Distributed stores: one key space shared by the processes of a job (d2l 12.7.3-12.7.4).

``dist_sync``, ``dist_async`` and ``dist_device_sync`` keep :class:`~dlperf.kvstore.KVStore`'s interface
across processes started by a launcher (:class:`~dlperf.parallel.launchers.ProcessLauncher`, ``torchrun``)
with a process group around them. Every rank creates the store (a collective call); the last
``num_servers`` ranks are *servers*, the others *workers*. With ``num_servers=0`` (the default, or the
``DLPERF_NUM_SERVERS`` environment variable) every worker also hosts a server in a thread, the
co-located design of d2l Fig. 12.7.8 (bottom).

Placement: a key below ``big_array_bound`` elements lives whole on one server, picked by a stable hash
of the key, so many small keys spread over the servers; a bigger key is split into ``num_servers``
even slices of its flattened value, one per server, so no server carries every big array
(apache/mxnet#8290). ``store.placement()`` prints where each key went.

Semantics, per key:

* ``dist_sync``: a round ends when every worker has pushed once; the sum of their pushes is merged
  into the stored value (the updater, the optimizer, or assignment), and a pull waits for the round
  its own last push belongs to. A pull after a push therefore sees every worker's contribution.
* ``dist_async``: each push is merged on arrival. ``staleness=tau`` bounds how far workers drift
  apart (Li et al. 2014): a pull after a worker's ``t``-th push waits until every worker has pushed
  at least ``t - tau`` times. ``None`` (default) never waits.
* ``dist_device_sync``: ``dist_sync`` whose per-worker sum of the device values runs on the
  devices, as the ``device`` store does; one sum per worker crosses to the servers.

Transport: tensors travel with torch.distributed's point-to-point ``send``/``recv`` over gloo (the
job's own process group when it is gloo, else a gloo group made beside it: servers hold values in host
memory). One request per server carries every key of a batched call, packed into one buffer, so a
model with many small parameters pays the per-message cost once per server, not once per key
(bytedance/byteps#237). A request's replies carry its own tag, so asynchronous calls from the
engine's threads can wait for their replies side by side.

Configuration is per process: every rank runs the same program, so ``set_optimizer`` and
``set_updater`` run on the servers too and take effect there; a worker and a server that disagree on
how pushes are merged fail at ``init`` naming the server. Server ranks call :meth:`DistKVStore.serve`,
which returns once every worker has closed its store.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from .base import Key, KVStore, _as_list, register_kvstore

__all__ = ["DistKVStore", "DistSyncKVStore", "DistAsyncKVStore", "DistDeviceSyncKVStore", "Placement",
           "BIG_ARRAY_BOUND"]

BIG_ARRAY_BOUND = 1_000_000
"""Keys with at least this many elements are split across all servers (MXNet's default bound)."""

_INIT, _PUSH, _PULL, _PUSHPULL, _STATE, _LOAD, _BYE = range(1, 8)
_OK, _ERROR = 0, 1
_HEADER = 4  # op or status, tag, meta bytes, data bytes
_ALIGN = 8  # every packed tensor starts at a multiple of this, so a dtype view of the buffer is legal
_DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                               torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)}


def _stable_hash(key: Key) -> int:
    # Python's hash of a str differs per process; placement must agree across them
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


# --- placement -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Slice:
    server: int  # global rank of the server
    part: int
    start: int  # in the flattened value
    stop: int


@dataclass
class Placement:
    """Where each key lives: a list of slices (one for a small key) per key; ``str()`` is a table."""

    servers: list[int]
    big_array_bound: int
    keys: dict[Key, list[Slice]] = field(default_factory=dict)

    def place(self, key: Key, numel: int) -> list[Slice]:
        n = len(self.servers)
        if numel < max(self.big_array_bound, n) or n == 1 and numel < self.big_array_bound:
            where = [Slice(self.servers[_stable_hash(key) % n], 0, 0, numel)]
        else:
            bounds = [numel * i // n for i in range(n + 1)]
            where = [Slice(s, i, bounds[i], bounds[i + 1]) for i, s in enumerate(self.servers)]
        self.keys[key] = where
        return where

    def by_server(self) -> dict[int, int]:
        """Elements held by each server."""
        load = dict.fromkeys(self.servers, 0)
        for slices in self.keys.values():
            for s in slices:
                load[s.server] += s.stop - s.start
        return load

    def __str__(self) -> str:
        lines = [f"{'key':<24} {'server':>6} {'part':>4} {'elements':>20}"]
        for key, slices in self.keys.items():
            for s in slices:
                lines.append(f"{key!r:<24} {s.server:>6} {s.part:>4} {f'[{s.start}, {s.stop})':>20}")
        lines.append("per server: " + ", ".join(f"rank {r}: {n} elements" for r, n in self.by_server().items()))
        return "\n".join(lines)


# --- messages --------------------------------------------------------------------------------------

def _pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 buffer holding every tensor's bytes, each aligned; no copy for a single tensor."""
    views = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    if len(views) == 1:
        return views[0]
    sizes = [-(-v.numel() // _ALIGN) * _ALIGN for v in views]
    buf = torch.empty(sum(sizes), dtype=torch.uint8)
    offset = 0
    for v, size in zip(views, sizes, strict=True):
        buf[offset:offset + v.numel()].copy_(v)
        offset += size
    return buf


def _unpack(buf: torch.Tensor, specs: Sequence[tuple[str, int]]) -> list[torch.Tensor]:
    """Views of ``buf`` as the packed tensors, given each one's (dtype name, element count)."""
    out, offset = [], 0
    single = len(specs) == 1
    for dtype_name, numel in specs:
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise UsageError(f"kvstore message holds dtype {dtype_name!r}; expected one of {', '.join(_DTYPES)}")
        nbytes = numel * dtype.itemsize
        if offset + nbytes > buf.numel():
            raise UsageError(f"kvstore message is {buf.numel()} bytes, too short for its tensors")
        out.append(buf[offset:offset + nbytes].view(dtype))
        offset += nbytes if single else -(-nbytes // _ALIGN) * _ALIGN
    return out


class _Channel:
    """Messages over point-to-point send/recv: a header, then JSON metadata and packed tensors, one tag."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        # requests take odd tags and their replies the next even one: a process sends both requests (its
        # worker's tags) and replies (its peers' tags) to a peer, and the two must never share a slot
        self._tags = iter(range(1, 2**31 - 2, 2))
        self._tag_lock = threading.Lock()

    def new_tag(self) -> int:
        with self._tag_lock:
            return next(self._tags)

    def send(self, dst: int, code: int, tag: int, meta: dict, data: torch.Tensor | None,
             header_tag: int | None = None, wait: bool = True) -> list[tuple[Any, torch.Tensor]]:
        """Send one message; with ``wait=False`` return its (work, tensor) pairs, to be kept until done."""
        body = json.dumps(meta).encode()
        nbytes = 0 if data is None else data.numel()
        header = torch.tensor([code, tag, len(body), nbytes], dtype=torch.int64)
        parts = [(header, tag if header_tag is None else header_tag),
                 (torch.frombuffer(bytearray(body), dtype=torch.uint8), tag)]
        if nbytes:
            parts.append((data, tag))
        works = [(self.dist.isend(t, dst, group=self.group, tag=t_tag), t) for t, t_tag in parts]
        if wait:
            for work, _ in works:
                work.wait()
        return works

    def recv_header(self, src: int | None, tag: int) -> tuple[int, int, int, int, int]:
        header = torch.empty(_HEADER, dtype=torch.int64)
        sender = self.dist.recv(header, src, group=self.group, tag=tag)
        code, msg_tag, meta_len, data_len = (int(x) for x in header)
        return sender, code, msg_tag, meta_len, data_len

    def recv_body(self, src: int, tag: int, meta_len: int, data_len: int) -> tuple[dict, torch.Tensor]:
        body = torch.empty(meta_len, dtype=torch.uint8)
        self.dist.recv(body, src, group=self.group, tag=tag)
        data = torch.empty(data_len, dtype=torch.uint8)
        if data_len:
            self.dist.recv(data, src, group=self.group, tag=tag)
        return json.loads(bytes(body.numpy()).decode()), data


def _no_reply() -> tuple[dict, torch.Tensor]:
    return {}, torch.empty(0, dtype=torch.uint8)


def _key_of(name: Any) -> Key:
    # JSON keeps ints and strs apart, which is all a key can be
    if isinstance(name, bool) or not isinstance(name, (int, str)):
        raise UsageError(f"kvstore message names key {name!r}; expected an int or a str")
    return name


def _state_bytes(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _state_from_bytes(data: torch.Tensor) -> Any:
    # tensors and plain containers only, as the project's checkpoint loader reads files
    return torch.load(io.BytesIO(bytes(data.numpy())), map_location="cpu", weights_only=True)


# --- the server ------------------------------------------------------------------------------------

@dataclass
class _Entry:
    """One stored slice of a key on one server."""

    value: torch.Tensor
    dtype: str
    mode: str
    merge: torch.Tensor | None = None
    arrived: set[int] = field(default_factory=set)
    backlog: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    rounds: int = 0
    pushes: dict[int, int] = field(default_factory=dict)
    inits: set[int] = field(default_factory=set)
    loads: set[int] = field(default_factory=set)
    param: nn.Parameter | None = None
    optimizer: torch.optim.Optimizer | None = None
    error: str | None = None


class _Server:
    """The server half: stored slices, merging per the store's mode, replies when a request is ready."""

    def __init__(self, store: DistKVStore) -> None:
        self.store = store
        self.entries: dict[tuple[Key, int], _Entry] = {}
        self.pending: list[Callable[[], bool]] = []
        self.lock = threading.Lock()
        self.byes: set[int] = set()
        self.mailbox: dict[int, tuple[int, dict, torch.Tensor]] = {}
        self.mail = threading.Condition(self.lock)
        # replies in flight: a server never blocks on a reply (the worker may be busy serving us)
        self.outgoing: list[list[tuple[Any, torch.Tensor]]] = []

    # -- transport -------------------------------------------------------------------------------
    def reply(self, dst: int, tag: int, code: int, meta: dict, data: torch.Tensor | None = None) -> None:
        if dst == self.store._global_rank:  # the co-located worker of this process
            self.mailbox[tag] = (code, meta, torch.empty(0, dtype=torch.uint8) if data is None else data)
            self.mail.notify_all()
        else:
            self.outgoing.append(self.store._channel.send(dst, code, tag + 1, meta, data, wait=False))
            self.outgoing = [w for w in self.outgoing if not all(work.is_completed() for work, _ in w)]

    def drain(self) -> None:
        """Wait for every reply in flight to reach its worker."""
        for works in self.outgoing:
            for work, _ in works:
                work.wait()
        self.outgoing = []

    def serve_remote(self, expected_byes: int) -> None:
        channel = self.store._channel
        while len(self.byes) < expected_byes:
            src, op, tag, meta_len, data_len = channel.recv_header(None, 0)
            meta, data = channel.recv_body(src, tag, meta_len, data_len)
            with self.lock:
                self.handle(src, op, tag, meta, data)
        with self.lock:
            self.drain()

    def handle(self, src: int, op: int, tag: int, meta: dict, data: torch.Tensor) -> None:
        try:
            handler = {_INIT: self.on_init, _PUSH: self.on_push, _PULL: self.on_pull, _PUSHPULL: self.on_pushpull,
                       _STATE: self.on_state, _LOAD: self.on_load}.get(op)
            if op == _BYE:
                self.byes.add(src)
                return
            if handler is None:
                raise UsageError(f"kvstore server got operation {op}; expected one of 1..7")
            handler(src, tag, meta, data)
        except Exception as exc:  # noqa: BLE001 - the requesting worker raises it; the server keeps serving
            if op not in (_PUSH,):
                self.reply(src, tag, _ERROR, {"error": f"{type(exc).__name__}: {exc}"})
        self.flush()

    def flush(self) -> None:
        self.pending = [p for p in self.pending if not p()]

    def entry(self, name: Any, part: int) -> _Entry:
        key = _key_of(name)
        found = self.entries.get((key, part))
        if found is None:
            raise UsageError(f"key {key!r} is not initialized on server rank {self.store._global_rank}; "
                             f"call init({key!r}, value) on every worker first")
        return found

    # -- operations ------------------------------------------------------------------------------
    def on_init(self, src: int, tag: int, meta: dict, data: torch.Tensor) -> None:
        # A server process is configured before it serves, so its own mode counts. A co-located server's
        # worker may still be configuring while a faster peer's init arrives: the first init's mode counts,
        # and every worker's config is complete once init, a barrier, returns.
        own = self.store._merge_mode() if self.store.role == "server" else None
        values = _unpack(data, [(d, n) for _, _, d, n, _ in meta["items"]]) if data.numel() else []
        parts = []
        for i, (name, part, dtype, numel, shape) in enumerate(meta["items"]):
            key = _key_of(name)
            entry = self.entries.get((key, part))
            if entry is None:
                entry = self.entries[(key, part)] = _Entry(torch.zeros(numel, dtype=_DTYPES[dtype]), dtype,
                                                           mode=own or meta["mode"])
                if shape is not None:
                    entry.value = entry.value.reshape(shape)
            if meta["mode"] != entry.mode:
                raise UsageError(f"worker rank {src} merges pushes by {meta['mode']!r} but server rank "
                                 f"{self.store._global_rank} by {entry.mode!r}; call set_optimizer/set_updater "
                                 "on every rank, servers included, before init")
            if values:
                entry.value.view(-1).copy_(values[i])
            entry.inits.add(src)
            parts.append(entry)
        workers = self.store.num_workers
        self.pending.append(lambda: all(len(e.inits) >= workers for e in parts)
                            and (self.reply(src, tag, _OK, {}) or True))

    def on_push(self, src: int, tag: int, meta: dict, data: torch.Tensor) -> None:
        received = _unpack(data, [(d, n) for _, _, d, n in meta["items"]])
        for (name, part, _, _), value in zip(meta["items"], received, strict=True):
            key = _key_of(name)
            entry = self.entry(key, part)
            try:
                self.push_one(src, key, entry, value)
            except Exception as exc:  # noqa: BLE001 - a failed merge is reported to the next pull of the key
                entry.error = f"{type(exc).__name__}: {exc}"

    def push_one(self, src: int, key: Key, entry: _Entry, value: torch.Tensor) -> None:
        entry.pushes[src] = entry.pushes.get(src, 0) + 1
        if not self.store._sync:
            self.apply(key, entry, value.reshape(entry.value.shape))
            return
        if src in entry.arrived:  # this worker is a round ahead: its push waits for the next round
            entry.backlog.append((src, value.clone()))
            return
        self.merge(key, entry, src, value)

    def merge(self, key: Key, entry: _Entry, src: int, value: torch.Tensor) -> None:
        value = value.reshape(entry.value.shape)
        entry.merge = value.clone() if entry.merge is None else entry.merge.add_(value)
        entry.arrived.add(src)
        if len(entry.arrived) < self.store.num_workers:
            return
        total, entry.merge, entry.arrived = entry.merge, None, set()
        self.apply(key, entry, total)
        entry.rounds += 1
        backlog, entry.backlog = entry.backlog, []
        for who, early in backlog:
            if who in entry.arrived:
                entry.backlog.append((who, early))
            else:
                self.merge(key, entry, who, early)

    def apply(self, key: Key, entry: _Entry, received: torch.Tensor) -> None:
        store = self.store
        with torch.no_grad():
            if store._updater is not None:
                store._updater(key, received, entry.value)
            elif store._factory is None:
                entry.value.copy_(received)
            else:
                if entry.optimizer is None:
                    entry.param = nn.Parameter(entry.value, requires_grad=True)
                    entry.optimizer = store._factory([entry.param])
                entry.param.grad = received
                with torch.enable_grad():
                    entry.optimizer.step()
                entry.param.grad = None

    def ready(self, entry: _Entry, needed: int) -> bool:
        if self.store._sync:
            return entry.rounds >= needed
        if self.store.staleness is None:
            return True
        slowest = min(entry.pushes.get(w, 0) for w in self.store._worker_ranks)
        return slowest >= needed - self.store.staleness

    def on_pull(self, src: int, tag: int, meta: dict, data: torch.Tensor) -> None:
        wanted = [(self.entry(name, part), needed) for name, part, needed in meta["items"]]

        def answer() -> bool:
            if not all(self.ready(e, n) for e, n in wanted):
                return False
            errors = [e.error for e, _ in wanted if e.error]
            if errors:
                self.reply(src, tag, _ERROR, {"error": errors[0]})
            else:
                self.reply(src, tag, _OK, {}, _pack([e.value for e, _ in wanted]).clone())
            return True

        if not answer():
            self.pending.append(answer)

    def on_pushpull(self, src: int, tag: int, meta: dict, data: torch.Tensor) -> None:
        self.on_push(src, tag, {"items": meta["push"]}, data)
        self.flush()  # the push may end a round that earlier pulls wait for
        self.on_pull(src, tag, {"items": meta["pull"]}, data)

    def on_state(self, src: int, tag: int, meta: dict, data: torch.Tensor) -> None:
        optimizers = {f"{p}:{k!r}": e.optimizer.state_dict() for (k, p), e in self.entries.items() if e.optimizer}
        self.reply(src, tag, _OK, {}, _state_bytes(optimizers))

    def on_load(self, src: int, tag: int, meta: dict, data: torch.Tensor) -> None:
        parts = []
        opt_len = meta.get("optimizer_bytes", 0)
        values_data = data[:data.numel() - opt_len]
        optimizers = _state_from_bytes(data[data.numel() - opt_len:]) if opt_len else {}
        values = _unpack(values_data, [(d, n) for _, _, d, n in meta["items"]]) if meta["items"] else []
        for (name, part, _, _), value in zip(meta["items"], values, strict=True):
            entry = self.entry(name, part)
            entry.value.view(-1).copy_(value)
            state = optimizers.get(f"{part}:{_key_of(name)!r}")
            if state is not None:
                if self.store._factory is None:
                    raise UsageError("the checkpoint has server-side optimizer state; call set_optimizer on "
                                     "every rank first")
                if entry.optimizer is None:
                    entry.param = nn.Parameter(entry.value, requires_grad=True)
                    entry.optimizer = self.store._factory([entry.param])
                entry.optimizer.load_state_dict(state)
        for entry in self.entries.values():
            entry.loads.add(src)
            parts.append(entry)
        workers = self.store.num_workers
        self.pending.append(lambda: all(len(e.loads) >= workers for e in parts)
                            and (self.reply(src, tag, _OK, {}) or True))


# --- the store -------------------------------------------------------------------------------------

class DistKVStore(KVStore):
    """A KVStore whose keys live on server processes; see the module docstring for roles and semantics.

    Args:
        num_servers: how many of the last ranks are servers; 0 co-locates one server with each worker.
            Default: ``DLPERF_NUM_SERVERS`` or 0.
        staleness: ``dist_async`` only: the bound tau on how many pushes workers may drift apart.
        big_array_bound: keys with at least this many elements are split across all servers.
    """

    type = "dist_sync"
    _sync = True
    _local_sum_on_device = False

    def __init__(self, kind: str | None = None, *, num_servers: int | None = None, staleness: int | None = None,
                 big_array_bound: int = BIG_ARRAY_BOUND) -> None:
        super().__init__(kind)
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError(f"kvstore type {self.type!r} needs torch.distributed's process group; start the "
                             "workers with ProcessLauncher(n, backend='gloo') or torchrun, or use 'local'")
        world, rank = dist.get_world_size(), dist.get_rank()
        num_servers = self._num_servers(num_servers, world)
        if staleness is not None and (self._sync or not isinstance(staleness, int) or staleness < 0):
            raise UsageError(f"staleness={staleness!r}: expected None or an integer >= 0, and only with "
                             "'dist_async' (the sync stores never let workers drift apart)")
        if not isinstance(big_array_bound, int) or big_array_bound < 1:
            raise UsageError(f"big_array_bound={big_array_bound!r}: expected an integer >= 1 (elements)")
        self.staleness = staleness
        self._global_rank = rank
        workers = world - num_servers
        self._worker_ranks = list(range(workers))
        servers = list(range(workers, world)) if num_servers else list(self._worker_ranks)
        self.role = "server" if rank >= workers else "worker"
        self._placement = Placement(servers, big_array_bound)
        self._meta: dict[Key, tuple[torch.Size, torch.dtype]] = {}
        self._pushed: dict[Key, int] = {}
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self._channel = _Channel(group)
        self._server = _Server(self) if rank in servers else None
        self._thread: threading.Thread | None = None
        self._served = False
        if self._server is not None and self.role == "worker":
            # the co-located server serves the other workers from a thread of its own
            self._thread = threading.Thread(target=self._server.serve_remote, args=(workers - 1,),
                                            name=f"dlperf-kvstore-server-{rank}", daemon=True)
            self._thread.start()

    @staticmethod
    def _num_servers(given: int | None, world: int) -> int:
        if given is None:
            text = os.environ.get("DLPERF_NUM_SERVERS", "0")
            try:
                given = int(text)
            except ValueError:
                raise UsageError(f"DLPERF_NUM_SERVERS={text!r}: expected an integer >= 0; unset it for "
                                 "servers co-located with the workers") from None
        if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given < world:
            raise UsageError(f"num_servers={given!r}: expected an integer from 0 (co-located) to {world - 1}, "
                             f"leaving at least one worker among the {world} ranks")
        return given

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
    def _send(self, server: int, op: int, meta: dict,
              data: torch.Tensor | None) -> Callable[[], tuple[dict, torch.Tensor]]:
        """Send one request; the returned function waits for its reply (so requests to servers overlap)."""
        tag = self._channel.new_tag()
        no_reply = op in (_PUSH, _BYE)
        if server == self._global_rank and self._server is not None:
            srv = self._server
            with srv.lock:
                srv.handle(server, op, tag, meta, torch.empty(0, dtype=torch.uint8) if data is None else data)

            def wait_local() -> tuple[dict, torch.Tensor]:
                with srv.lock:
                    while tag not in srv.mailbox:
                        srv.mail.wait()
                    code, reply, body = srv.mailbox.pop(tag)
                return self._checked(server, code, reply, body)

            return _no_reply if no_reply else wait_local
        self._channel.send(server, op, tag, meta, data, header_tag=0)

        def wait_remote() -> tuple[dict, torch.Tensor]:
            _, code, _, meta_len, data_len = self._channel.recv_header(server, tag + 1)
            reply, body = self._channel.recv_body(server, tag + 1, meta_len, data_len)
            return self._checked(server, code, reply, body)

        return _no_reply if no_reply else wait_remote

    @staticmethod
    def _checked(server: int, code: int, reply: dict, body: torch.Tensor) -> tuple[dict, torch.Tensor]:
        if code != _OK:
            raise UsageError(f"kvstore server rank {server}: {reply.get('error', 'failed')}")
        return reply, body

    def _request(self, server: int, op: int, meta: dict, data: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
        return self._send(server, op, meta, data)()

    def _slices(self, key: Key) -> list[Slice]:
        return self._placement.keys[key]

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
        keys = list(key) if isinstance(key, (list, tuple)) else [key]
        values = _as_list(value, "init") if isinstance(key, (list, tuple)) else _as_list(value, "init")[:1]
        if len(keys) != len(values):
            raise UsageError(f"init got {len(keys)} keys and {len(values)} values; give one value per key")
        for k, v in zip(keys, values, strict=True):
            self._check_key_type(k)
            if k in self._meta:
                raise UsageError(f"key {k!r} is already initialized; each key is initialized once")
            self._meta[k] = (v.shape, v.dtype)
            self._pushed[k] = 0
            self._placement.place(k, v.numel())
        flat = {k: v.detach().to("cpu").reshape(-1) for k, v in zip(keys, values, strict=True)}
        mode = self._merge_mode()
        for server, items in self._by_server(keys).items():
            meta = {"mode": mode, "items": [[k, s.part, str(self._meta[k][1]), s.stop - s.start,
                                             list(self._meta[k][0]) if len(self._slices(k)) == 1 else None]
                                            for k, s in items]}
            data = _pack([flat[k][s.start:s.stop] for k, s in items]) if self.rank == 0 else None
            self._request(server, _INIT, meta, data)

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

    def _push_items(self, pairs: Sequence[tuple[Key, list[torch.Tensor]]]) -> dict[int, tuple[list, list]]:
        """Per server: the (key, part, dtype, numel) items and slices of one packed push."""
        sums = {k: self._local_sum(k, vs) for k, vs in pairs}
        out: dict[int, tuple[list, list]] = {}
        for server, items in self._by_server([k for k, _ in pairs]).items():
            meta, tensors = out.setdefault(server, ([], []))
            for k, s in items:
                meta.append([k, s.part, str(self._meta[k][1]), s.stop - s.start])
                tensors.append(sums[k][s.start:s.stop])
        for k, _ in pairs:
            self._pushed[k] += 1
        return out

    def _pull_items(self, keys: Sequence[Key]) -> dict[int, list]:
        return {server: [[k, s.part, self._pushed[k]] for k, s in items]
                for server, items in self._by_server(keys).items()}

    def _deliver(self, keys: Sequence[Key], server_items: dict[int, list], bodies: dict[int, torch.Tensor],
                 outs: Sequence[list[torch.Tensor]]) -> None:
        full = {k: torch.empty(self._meta[k][0], dtype=self._meta[k][1]) for k in keys}
        for server, items in server_items.items():
            specs = [(str(self._meta[k][1]), self._slice(k, part).stop - self._slice(k, part).start)
                     for k, part, _ in items]
            for (k, part, _), got in zip(items, _unpack(bodies[server], specs), strict=True):
                s = self._slice(k, part)
                full[k].view(-1)[s.start:s.stop].copy_(got)
        with torch.no_grad():
            for k, os_ in zip(keys, outs, strict=True):
                for o in os_:
                    o.copy_(full[k], non_blocking=True)

    def _slice(self, key: Key, part: int) -> Slice:
        return self._slices(key)[part]

    def _exchange(self, pushes: Sequence[tuple[Key, list[torch.Tensor]]],
                  pulls: Sequence[tuple[Key, list[torch.Tensor]]]) -> None:
        """One request per server carrying every push and pull of the call."""
        push_items = self._push_items(pushes) if pushes else {}
        pull_items = self._pull_items([k for k, _ in pulls]) if pulls else {}
        waits = {}
        for server in sorted(set(push_items) | set(pull_items)):
            meta_items, tensors = push_items.get(server, ([], []))
            data = _pack(tensors) if tensors else None
            wanted = pull_items.get(server)
            if wanted is None:
                self._send(server, _PUSH, {"items": meta_items}, data)
            elif not meta_items:
                waits[server] = self._send(server, _PULL, {"items": wanted}, None)
            else:
                waits[server] = self._send(server, _PUSHPULL, {"push": meta_items, "pull": wanted}, data)
        bodies = {server: wait()[1] for server, wait in waits.items()}
        if pulls:
            self._deliver([k for k, _ in pulls], pull_items, bodies, [o for _, o in pulls])

    def _push_now(self, key: Key, values: list[torch.Tensor]) -> None:
        self._exchange([(key, values)], [])

    def _pull_now(self, key: Key, outs: list[torch.Tensor]) -> None:
        self._exchange([], [(key, outs)])

    def _pairs(self, key, value, check) -> list[tuple[Key, list[torch.Tensor]]]:
        if isinstance(key, (list, tuple)):
            values = list(value)
            if len(values) != len(key):
                raise UsageError(f"got {len(key)} keys and {len(values)} values; give one value (or one list "
                                 "of per-device values) per key")
            return [(k, check(k, v)) for k, v in zip(key, values, strict=True)]
        return [(key, check(key, value))]

    def push(self, key, value, priority: int = 0) -> None:
        self._check_worker()
        pairs = self._pairs(key, value, self._check_push)
        for k, _ in pairs:
            self._settle(k)
        self._exchange(pairs, [])

    def pull(self, key, out, priority: int = 0) -> None:
        self._check_worker()
        pairs = self._pairs(key, out, self._check_pull)
        for k, _ in pairs:
            self._settle(k)
        self._exchange([], pairs)

    def pushpull(self, key, value, out=None, priority: int = 0) -> None:
        """``push`` then ``pull`` in one request per server."""
        self._check_worker()
        pushes = self._pairs(key, value, self._check_push)
        pulls = self._pairs(key, value if out is None else out, self._check_pull)
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
        for server in self._placement.servers:
            _, body = self._request(server, _STATE, {}, None)
            for name, state in _state_from_bytes(body).items():
                part, key_repr = name.split(":", 1)
                key = next((k for k in keys if repr(k) == key_repr), None)
                if key is not None:
                    optimizers.setdefault(key, {})[int(part)] = state
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
            if key in self._meta and len(parts) != len(self._slices(key)) and self.rank == 0:
                raise UsageError(f"the checkpoint holds key {key!r}'s optimizer state in {len(parts)} parts but "
                                 f"this store splits it in {len(self._slices(key))}; load it with the same "
                                 "number of servers and big_array_bound")
        for server in self._placement.servers:
            items, tensors, optimizers = [], [], {}
            if self.rank == 0:
                for key, value in values.items():
                    for s in self._slices(key):
                        if s.server == server:
                            items.append([key, s.part, str(self._meta[key][1]), s.stop - s.start])
                            tensors.append(value.to("cpu", self._meta[key][1]).reshape(-1)[s.start:s.stop])
                            part_state = state.get("optimizers", {}).get(key, {}).get(s.part)
                            if part_state is not None:
                                optimizers[f"{s.part}:{key!r}"] = part_state
            opt = _state_bytes(optimizers) if optimizers else None
            data = [t for t in (_pack(tensors).clone() if tensors else None, opt) if t is not None]
            self._request(server, _LOAD, {"items": items, "optimizer_bytes": 0 if opt is None else opt.numel()},
                          torch.cat(data) if data else None)

    # -- lifetime ---------------------------------------------------------------------------------------
    def serve(self) -> None:
        """On a server rank: answer the workers until every one of them has closed its store."""
        self._check_open()
        if self.role != "server":
            raise UsageError(f"serve() runs on server ranks; rank {self._global_rank} is a worker (servers are "
                             f"ranks {self._placement.servers})")
        self._served = True
        self._server.serve_remote(self.num_workers)

    def close(self) -> None:
        """Finish pending calls and tell every server this worker is done; co-located: wait for the others."""
        if self._closed:
            return
        try:
            if self.role == "worker":
                try:
                    self.wait_all()
                finally:
                    for server in self._placement.servers:
                        if server != self._global_rank:
                            self._request(server, _BYE, {}, None)
                    if self._thread is not None:
                        self._thread.join()
                    if self._server is not None:
                        with self._server.lock:
                            self._server.drain()
        finally:
            super().close()


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

"""The server half of the distributed stores: stored slices, merging per the store's mode, replies.

A server's handler never blocks: a pull that must wait for a round gets a future the server completes when
the round ends, so servers need no threads of their own beyond RPC's (and the control channel's), and a
co-located worker calls its own server directly.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

try:
    from torch.distributed.rpc.functions import async_execution
except ImportError:  # a build without RPC: the stores say so when created
    def async_execution(fn):  # type: ignore[no-redef]
        return fn

from .._shm import ShmUnavailableError
from ..errors import UsageError
from .base import Key
from .control import ControlServer
from .shm import ARENA_MIN_BYTES, Arena, ArenaPlan, ServerSlots, cut_slots
from .wire import (
    BYE,
    ERROR,
    INIT,
    LOAD,
    OK,
    PULL,
    PUSH,
    PUSHPULL,
    STATE,
    from_wire,
    key_of,
    to_wire,
    wire_dtype,
)

if TYPE_CHECKING:
    from .dist import DistKVStore

__all__ = ["SERVERS", "Server", "serve_call"]

SERVERS: dict[str, Server] = {}  # this process's servers, by store id (the same on every rank)


@async_execution  # the returned future is the reply: RPC sends it when the server completes it
def serve_call(store_id: str, src: int, op: int, meta: dict, wire: list[torch.Tensor]) -> torch.futures.Future:
    """What a worker's RPC runs on a server: hand the request over; the future holds the reply."""
    future: torch.futures.Future = torch.futures.Future()
    server = SERVERS.get(store_id)
    if server is None:
        future.set_result((ERROR, {"error": f"no kvstore {store_id!r} here; every rank must create the same "
                                             "stores in the same order"}, []))
        return future
    with server.lock:
        server.handle(src, op, meta, wire, future)
    return future


@dataclass
class _Entry:
    """One stored slice of a key on one server."""

    value: torch.Tensor
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
    slots: ServerSlots | None = None  # same-host workers' payloads travel through these
    held: torch.Tensor | None = None  # a round's first push, still in its sender's exchange slot


class Server:
    """The server half: stored slices, merging per the store's mode, replies when a request is ready.

    Runs under ``lock`` on RPC's threads (and the co-located worker's); it never blocks, it completes
    futures.
    """

    def __init__(self, store: DistKVStore) -> None:
        self.store = store
        self.entries: dict[tuple[Key, int], _Entry] = {}
        self.pending: list[Callable[[], bool]] = []
        self.lock = threading.Lock()
        self.byes: set[int] = set()
        self.all_closed = threading.Event()
        # a server process is configured (set_optimizer, set_updater) between its store's creation and
        # serve(): inits that arrive before serve() wait for it, so they meet the configured mode
        self.serving = store.role != "server"
        self.early_inits: list[tuple[int, dict, list[torch.Tensor], torch.futures.Future]] = []
        self.host = socket.gethostname()
        self.arenas: list[Arena] = []
        self.arena_used = 0  # bytes of the last arena given out
        self.control: ControlServer | None = None  # started with the first shared-memory offer
        self.busy_s = 0.0  # spent handling pushes and pulls (not waiting for the workers between them)
        self.requests = 0
        self.timed: set[int] = set()  # workers whose first exchange is over: it sets up slots, seconds at times

    def handle(self, src: int, op: int, meta: dict, wire: list[torch.Tensor], future: torch.futures.Future) -> None:
        handlers = {INIT: self.on_init, PUSH: self.on_push, PULL: self.on_pull, PUSHPULL: self.on_pushpull,
                    STATE: self.on_state, LOAD: self.on_load, BYE: self.on_bye}
        start = time.perf_counter()
        try:
            handler = handlers.get(op)
            if handler is None:
                raise UsageError(f"kvstore server got operation {op!r}; expected one of 1..7")
            handler(src, meta, wire, future)
        except Exception as exc:  # noqa: BLE001 - the requesting worker raises it; the server keeps serving
            if not future.done():
                future.set_result((ERROR, {"error": f"{type(exc).__name__}: {exc}"}, []))
        self.pending = [p for p in self.pending if not p()]
        if op in (PUSH, PULL, PUSHPULL):
            if src in self.timed:
                self.busy_s += time.perf_counter() - start
                self.requests += 1
            self.timed.add(src)

    @staticmethod
    def ok(future: torch.futures.Future, meta: dict | None = None, tensors: Sequence[torch.Tensor] = ()) -> bool:
        future.set_result((OK, meta or {}, to_wire(tensors) if tensors else []))
        return True

    def entry(self, name: Any, part: int) -> _Entry:
        key = key_of(name)
        found = self.entries.get((key, part))
        if found is None:
            raise UsageError(f"key {key!r} is not initialized on server rank {self.store._global_rank}; "
                             f"call init({key!r}, value) on every worker first")
        return found

    # -- operations ------------------------------------------------------------------------------
    def on_bye(self, src: int, meta: dict, wire: list[torch.Tensor], future: torch.futures.Future) -> None:
        self.byes.add(src)
        if len(self.byes) >= self.store.num_workers:
            self.all_closed.set()
        self.ok(future)

    def start_serving(self) -> None:
        with self.lock:
            self.serving = True
            early, self.early_inits = self.early_inits, []
            for src, meta, wire, future in early:
                self.handle(src, INIT, meta, wire, future)

    def on_init(self, src: int, meta: dict, wire: list[torch.Tensor], future: torch.futures.Future) -> None:
        if not self.serving:
            self.early_inits.append((src, meta, wire, future))
            return
        # A server process is configured before it serves, so its own mode counts. A co-located server's
        # worker may still be configuring while a faster peer's init arrives: the first init's mode counts,
        # and every worker's config is complete once init, a barrier, returns.
        own = self.store._merge_mode() if self.store.role == "server" else None
        items = meta["items"]
        values = from_wire(wire, [(d, n) for _, _, d, n, _ in items]) if wire else []
        created = []
        for name, part, dtype, numel, shape in items:
            key = key_of(name)
            if (key, part) not in self.entries:
                value = torch.zeros(numel, dtype=wire_dtype(dtype))
                created.append(self.entries.setdefault((key, part), _Entry(
                    value if shape is None else value.reshape(shape), mode=own or meta["mode"])))
        if created and self.store._shm and meta.get("shm") is True and meta.get("host") == self.host:
            self.give_slots(created)
        parts = []
        for i, (name, part, _, _, _) in enumerate(items):
            entry = self.entries[(key_of(name), part)]
            if meta["mode"] != entry.mode:
                raise UsageError(f"worker rank {src} merges pushes by {meta['mode']!r} but server rank "
                                 f"{self.store._global_rank} by {entry.mode!r}; call set_optimizer/set_updater "
                                 "on every rank, servers included, before init")
            if values:
                entry.value.view(-1).copy_(values[i])
            entry.inits.add(src)
            parts.append(entry)
        reply = self.slots_reply(src, items) if meta.get("shm") is True and src != self.store._global_rank else {}
        workers = self.store.num_workers
        self.pending.append(lambda: all(len(e.inits) >= workers for e in parts) and self.ok(future, reply))

    def give_slots(self, created: list[_Entry]) -> None:
        """Move the new slices into an arena: a value slot pair and an exchange slot per remote worker each.

        Small slices too: a request whose slices are all in slots goes through the control channel.
        """
        remote = [w for w in self.store._worker_ranks if w != self.store._global_rank]
        if not remote:
            return
        plan = ArenaPlan()
        for e in created:
            plan.add(e.value.numel(), e.value.dtype, remote)
        if self.arenas and self.arena_used + plan.nbytes <= self.arenas[-1].nbytes:
            arena, base = self.arenas[-1], self.arena_used
        else:
            try:
                arena, base = Arena.create(max(plan.nbytes, ARENA_MIN_BYTES)), 0
            except ShmUnavailableError:  # no shared memory here: these slices stay on RPC
                return
            arena.ident = len(self.arenas)
            self.arenas.append(arena)
        plan = ArenaPlan(nbytes=base)
        for e in created:
            plan.add(e.value.numel(), e.value.dtype, remote)
        slots = cut_slots(arena, plan, [(e.value.numel(), e.value.dtype) for e in created])
        self.arena_used = plan.nbytes
        for e, slot in zip(created, slots, strict=True):
            slot.values[0].copy_(e.value.view(-1))
            e.value, e.slots = slot.values[0].view(e.value.shape), slot

    def slots_reply(self, src: int, items: list) -> dict:
        """What worker ``src`` needs to map the arenas of these items' slices and find its slots there."""
        arenas, slots = {}, []
        for name, part, *_ in items:
            found = self.entries[(key_of(name), part)].slots
            if found is None or src not in found.exchange:
                continue
            arena = found.arena
            handle = arena.handle or {}
            arenas[arena.ident] = [arena.ident, handle.get("pid"), handle.get("fd"), handle.get("token"), arena.nbytes]
            slots.append([name, part, arena.ident, *found.offsets, found.exchange_offsets[src]])
        if not slots:
            return {}
        if self.control is None:
            self.control = ControlServer(self.on_control, set(self.store._worker_ranks),
                                         f"kvstore server {self.store._global_rank}")
        return {"shm": {"arenas": list(arenas.values()), "slots": slots,
                        "control": [self.control.name, self.control.token]}}

    def on_control(self, src: int, op: Any, meta: dict, reply: Any) -> None:
        """A request off the control channel: a push or pull whose slices are all in shared memory."""
        if op not in (PUSH, PULL, PUSHPULL):
            reply.set_result((ERROR, {"error": f"operation {op!r} does not go through the control channel"}, []))
            return
        with self.lock:
            self.handle(src, op, meta, [], reply)

    def payloads(self, src: int, items: list, wire: list[torch.Tensor]) -> list[tuple[torch.Tensor, bool]]:
        """Each pushed slice and whether it is borrowed (the sender may overwrite it once answered)."""
        in_slot = [len(item) > 4 and item[4] == 1 for item in items]
        on_wire = iter(from_wire(wire, [(item[2], item[3]) for item, s in zip(items, in_slot, strict=True)
                                         if not s]))
        out = []
        for item, shm in zip(items, in_slot, strict=True):
            if not shm:
                out.append((next(on_wire), src == self.store._global_rank))
                continue
            entry = self.entry(item[0], item[1])
            if entry.slots is None or src not in entry.slots.exchange:
                raise UsageError(f"worker rank {src} pushed key {item[0]!r} part {item[1]!r} through shared memory "
                                 f"but server rank {self.store._global_rank} gave it no slot there")
            out.append((entry.slots.exchange[src], True))
        return out

    def on_push(self, src: int, meta: dict, wire: list[torch.Tensor], future: torch.futures.Future | None,
                pulled: frozenset = frozenset()) -> None:
        """``pulled``: the (key, part)s the same request pulls, whose sender waits for the round to end."""
        items = meta["items"]
        for item, (value, borrowed) in zip(items, self.payloads(src, items, wire), strict=True):
            key = key_of(item[0])
            entry = self.entry(key, item[1])
            try:
                self.push_one(src, key, entry, value, borrowed, hold=(key, item[1]) in pulled)
            except Exception as exc:  # noqa: BLE001 - a failed merge is reported to the pulls of the key
                entry.error = f"{type(exc).__name__}: {exc}"
        if future is not None:
            self.ok(future)

    def push_one(self, src: int, key: Key, entry: _Entry, value: torch.Tensor, borrowed: bool,
                 hold: bool = False) -> None:
        """``borrowed``: ``value`` is the sender's memory (a co-located worker's tensor, an exchange slot).

        ``hold``: the sender touches ``value`` again only after this round ends, so it may be read then.
        """
        entry.pushes[src] = entry.pushes.get(src, 0) + 1
        if not self.store._sync:
            self.apply(key, entry, value.reshape(entry.value.shape))
            return
        if src in entry.arrived:  # this worker is a round ahead: its push waits for the next round
            entry.backlog.append((src, value.clone() if borrowed else value))
            return
        self.merge(key, entry, src, value, owned=not borrowed, hold=hold and entry.slots is not None)

    def merge(self, key: Key, entry: _Entry, src: int, value: torch.Tensor, owned: bool = False,
              hold: bool = False) -> None:
        value = value.reshape(entry.value.shape)
        if entry.merge is None:
            if entry.slots is not None:  # the sum builds up in the spare value slot: no allocation
                if hold and entry.held is None:
                    # the sender waits for this round: its slot is read when the next push comes, one pass
                    # over both instead of a copy now and an add then
                    entry.held = value
                else:
                    entry.merge = entry.slots.spare().view(entry.value.shape)
                    if entry.held is not None:
                        torch.add(entry.held, value, out=entry.merge)
                        entry.held = None
                    else:
                        entry.merge.copy_(value)
            else:
                # a remote push arrives in a buffer of its own; a co-located worker's is the worker's tensor
                entry.merge = value if owned else value.clone()
        else:
            entry.merge.add_(value)
        entry.arrived.add(src)
        if len(entry.arrived) < self.store.num_workers:
            return
        if entry.held is not None:  # the round's only push (held only in slots)
            assert entry.slots is not None
            entry.merge, entry.held = entry.slots.spare().view(entry.value.shape).copy_(entry.held), None
        total, entry.merge, entry.arrived = entry.merge, None, set()
        assert total is not None  # every worker's push was merged in
        store = self.store
        if store._updater is None and store._factory is None:
            # assignment: the sum becomes the stored value, no copy (in shared memory: the slots swap)
            entry.value = total if entry.slots is None else entry.slots.swap().view(entry.value.shape)
        else:
            self.apply(key, entry, total)
        entry.rounds += 1
        backlog, entry.backlog = entry.backlog, []
        for who, early in backlog:
            if who in entry.arrived:
                entry.backlog.append((who, early))
            else:
                self.merge(key, entry, who, early, owned=True)

    def apply(self, key: Key, entry: _Entry, received: torch.Tensor) -> None:
        store = self.store
        with torch.no_grad():
            if store._updater is not None:
                store._updater(key, received, entry.value)
            elif store._factory is None:
                entry.value.copy_(received)
            else:
                if entry.optimizer is None or entry.param is None:
                    entry.param = nn.Parameter(entry.value, requires_grad=True)
                    entry.optimizer = store._factory([entry.param])
                param = entry.param
                param.grad = received
                with torch.enable_grad():
                    entry.optimizer.step()
                param.grad = None

    def ready(self, entry: _Entry, needed: int) -> bool:
        if self.store._sync:
            return entry.rounds >= needed
        if self.store.staleness is None:
            return True
        slowest = min(entry.pushes.get(w, 0) for w in self.store._worker_ranks)
        return slowest >= needed - self.store.staleness

    def on_pull(self, src: int, meta: dict, wire: list[torch.Tensor], future: torch.futures.Future) -> None:
        wanted = [(self.entry(item[0], item[1]), item[2]) for item in meta["items"]]
        in_slot = [len(item) > 3 and item[3] == 1 and e.slots is not None and src in e.slots.exchange
                   for item, (e, _) in zip(meta["items"], wanted, strict=True)]

        def answer() -> bool:
            if not all(self.ready(e, n) for e, n in wanted):
                return False
            errors = [e.error for e, _ in wanted if e.error]
            if errors:
                future.set_result((ERROR, {"error": errors[0]}, []))
                return True
            # A sync round cannot end again before this worker pushes anew, after it has its reply: the
            # stored values go out as they are (through shared memory: the worker reads the value slot
            # itself). An async push may land any time: send a copy (into the worker's exchange slot).
            where, values = [], []
            for (e, _), shm in zip(wanted, in_slot, strict=True):
                if not shm or e.slots is None:  # (in_slot holds only entries with slots)
                    where.append(-1)
                    values.append(e.value if self.store._sync else e.value.clone())
                elif self.store._sync:
                    where.append(e.slots.current)
                else:
                    e.slots.exchange[src].copy_(e.value.view(-1))
                    where.append(2)
            return self.ok(future, {"where": where}, values)

        if not answer():
            self.pending.append(answer)

    def on_pushpull(self, src: int, meta: dict, wire: list[torch.Tensor], future: torch.futures.Future) -> None:
        pulled = frozenset((key_of(item[0]), item[1]) for item in meta["pull"] if isinstance(item, list) and item)
        self.on_push(src, {"items": meta["push"]}, wire, None, pulled if self.store._sync else frozenset())
        self.pending = [p for p in self.pending if not p()]  # the push may end a round others wait for
        self.on_pull(src, {"items": meta["pull"]}, [], future)

    def on_state(self, src: int, meta: dict, wire: list[torch.Tensor], future: torch.futures.Future) -> None:
        states = [[k, p, e.optimizer.state_dict()] for (k, p), e in self.entries.items() if e.optimizer]
        future.set_result((OK, {"optimizers": states}, []))

    def on_load(self, src: int, meta: dict, wire: list[torch.Tensor], future: torch.futures.Future) -> None:
        items = meta["items"]
        values = from_wire(wire, [(d, n) for _, _, d, n, _ in items]) if items else []
        for (name, part, _, _, state), value in zip(items, values, strict=True):
            entry = self.entry(name, part)
            entry.value.view(-1).copy_(value)
            if state is not None:
                if self.store._factory is None:
                    raise UsageError("the checkpoint has server-side optimizer state; call set_optimizer on "
                                     "every rank first")
                if entry.optimizer is None:
                    entry.param = nn.Parameter(entry.value, requires_grad=True)
                    entry.optimizer = self.store._factory([entry.param])
                entry.optimizer.load_state_dict(state)
        parts = list(self.entries.values())
        for entry in parts:
            entry.loads.add(src)
        workers = self.store.num_workers
        self.pending.append(lambda: all(len(e.loads) >= workers for e in parts) and self.ok(future))

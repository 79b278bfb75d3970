"""Allreduce between the processes of one host through a shared-memory segment, not through sockets.

gloo moves an allreduce's bytes between processes of one host over loopback TCP, far below the host's copy rate.
:class:`ShmAllreduce` maps one segment into every rank and runs the ``sharded`` schedule (reduce-scatter, then
all-gather) through it, chunk by chunk with three buffers in rotation, so the segment stays bounded and a tensor
of ``m`` chunks costs ``m + 1`` barriers. Every rank ends with bit-identical values; a peer that passes something
else, dies or is late makes every rank raise one :class:`ShmAllreduceError` naming it. :func:`host_allreduce_`,
for data-parallel training, uses the segment inside a host and ``torch.distributed`` between hosts, or both. The
schedule and why it is safe: docs/design/allreduce.md.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import platform
import threading
import weakref
from typing import Any

import torch

from ..._io import decode_json, process_alive
from ..._shm import (
    ABORTED,
    CLOSED,
    DTYPE,
    NUMEL,
    OP,
    Segment,
    SequenceBarrier,
    ShmAllreduceError,
    ShmUnavailableError,
    spin_barrier_supported,
)
from ...errors import UsageError
from .base import chunk_bounds

__all__ = ["ShmAllreduce", "ShmAllreduceError", "ShmUnavailableError", "host_allreduce_", "host_allreduce_kind",
           "close_host_allreduce",
           "DEFAULT_CHUNK_BYTES", "SUPPORTED_DTYPES"]

log = logging.getLogger("dlperf.parallel.allreduce")

DEFAULT_CHUNK_BYTES = 1 << 20
"""Bytes of one rank's share of a chunk: large enough that the per-chunk barrier and the few torch calls
are small beside the copying, small enough that a chunk stays in the L2/L3 cache between its steps."""
DEFAULT_TIMEOUT_S = 300.0
_BUFFERS = 3
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_DTYPE_CODES = {dt: i + 1 for i, dt in enumerate(SUPPORTED_DTYPES)}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
_OP_SUM, _OP_MEAN, _OP_BROADCAST = 1, 2, 16  # broadcast from rank s: _OP_BROADCAST + s

_live: weakref.WeakSet[ShmAllreduce] = weakref.WeakSet()


def _close_all() -> None:
    for group in list(_live):
        group.close()


atexit.register(_close_all)


class _GroupExchange:
    """Setup messages through a torch.distributed process group (its all_gather_object)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise UsageError("ShmAllreduce(group) needs an initialised torch.distributed process group; call "
                             "init_process_group first or pass rank, world_size and store")
        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.rank < 0:
            raise UsageError("this process is not a member of the group passed to ShmAllreduce; create it only "
                             "on the group's ranks")

    def all_gather(self, obj: dict) -> list[dict]:
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.group)
        return out


class _StoreExchange:
    """Setup messages through a torch.distributed Store: JSON under keys unique to this group.

    The n-th group made on one store (with one ``key``) in a process uses the n-th prefix: every rank makes
    its groups in the same order, so the prefixes agree without a round trip.
    """

    _instances: dict[tuple[int, str], tuple[Any, int]] = {}  # the store is held so that its id stays unique
    _lock = threading.Lock()

    def __init__(self, store: Any, rank: int, world: int, key: str, timeout_s: float) -> None:
        with self._lock:
            n = self._instances.get((id(store), key), (store, 0))[1]
            self._instances[(id(store), key)] = (store, n + 1)
        self.store, self.rank, self.world = store, rank, world
        self.prefix = f"dlperf/shm/{key}/{n}"
        self.round = 0
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def all_gather(self, obj: dict) -> list[dict]:
        self.round += 1
        base = f"{self.prefix}/{self.round}/"
        self.store.set(base + str(self.rank), json.dumps(obj))
        out = []
        for r in range(self.world):
            try:
                self.store.wait([base + str(r)], self.timeout)
            except RuntimeError:  # the store's timeout error
                raise ShmUnavailableError(f"rank {r} did not join the shm group {self.prefix!r} within "
                                          f"{self.timeout.total_seconds():g} s; every rank must create its groups "
                                          "in the same order with the same key") from None
            raw = self.store.get(base + str(r))
            try:
                item = decode_json(bytes(raw), base + str(r), lambda where, why: ValueError(why))
            except ValueError:
                item = None
            if not isinstance(item, dict):
                raise ShmUnavailableError(f"rank {r}'s setup message under {base + str(r)!r} is not a JSON object "
                                          f"({raw[:60]!r}); every rank must run the same dlperf with its own key")
            out.append(item)
        return out


def _op_code(op: object) -> int | None:
    if isinstance(op, str):
        return {"sum": _OP_SUM, "mean": _OP_MEAN, "avg": _OP_MEAN}.get(op.lower())
    try:
        import torch.distributed as dist

        codes: dict[object, int] = {dist.ReduceOp.SUM: _OP_SUM, dist.ReduceOp.AVG: _OP_MEAN}
        return codes.get(op)
    except (ImportError, TypeError, AttributeError):
        return None


def _check_tensor(tensor: object) -> str | None:
    if not isinstance(tensor, torch.Tensor):
        return f"got a {type(tensor).__name__}; expected a torch.Tensor"
    if tensor.device.type != "cpu":
        return f"the tensor is on {tensor.device}; expected a CPU tensor (copy it to the host first)"
    if tensor.dtype not in _DTYPE_CODES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        return f"dtype {tensor.dtype} is not supported; expected one of {names}: cast the tensor first"
    return None


def _describe(numel: int, dcode: int, opc: int) -> str:
    if dcode == 0:
        return "an unusable argument (its own error says which)"
    what = {_OP_SUM: "sum", _OP_MEAN: "mean"}.get(opc, f"broadcast from rank {opc - _OP_BROADCAST}")
    return f"{numel} elements of {_CODE_DTYPES[dcode]} ({what})"


class ShmAllreduce:
    """Allreduce among the processes of one host through one shared-memory segment.

    Build it on every rank of a group, in the same order: ``ShmAllreduce(group)`` for a
    ``torch.distributed`` process group (``None``: the default group), or ``ShmAllreduce(rank=...,
    world_size=..., store=...)`` with a ``torch.distributed`` Store (``key`` tells apart groups sharing a
    store). Setup is collective; it raises :class:`ShmUnavailableError` on every rank when the ranks cannot
    share a segment (different hosts, not Linux, not x86-64).

    ``chunk_bytes``: one rank's share of a chunk; the segment holds ``3 * (world + 1)`` of them.
    ``timeout_s``: how long a rank waits at a barrier for the others before raising.
    """

    def __init__(self, group: Any = None, *, rank: int | None = None, world_size: int | None = None,
                 store: Any = None, key: str = "default", timeout_s: float = DEFAULT_TIMEOUT_S,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if not (isinstance(chunk_bytes, int) and not isinstance(chunk_bytes, bool) and chunk_bytes >= 64):
            raise UsageError(f"chunk_bytes={chunk_bytes!r}: expected an integer >= 64 (bytes per rank per chunk)")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise UsageError(f"timeout_s={timeout_s!r}: expected a positive number of seconds")
        exchange = self._exchange(group, rank, world_size, store, key, float(timeout_s))
        self.rank, self.world_size = exchange.rank, exchange.world
        self._timeout_s = float(timeout_s)
        self.slot_bytes = -(-chunk_bytes // 64) * 64
        self._lock = threading.Lock()
        self._chunk = 0  # chunks run so far: picks the buffer of the next one
        self._calls = 0
        self._broken: str | None = None
        self._views: dict[torch.dtype, list[torch.Tensor]] = {}
        self._seg: Segment | None = None
        if self.world_size > 1:
            self._seg, pids = self._setup(exchange)
            self._bytes = torch.frombuffer(self._seg.buffer(), dtype=torch.uint8,
                                           count=_BUFFERS * (self.world_size + 1) * self.slot_bytes)
            self._barrier = SequenceBarrier(self._seg, self.rank, self._timeout_s, pids)
            _live.add(self)

    @property
    def timeout_s(self) -> float:
        """Seconds a rank waits at a barrier for the others; may be changed between calls."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        if not (isinstance(value, (int, float)) and value > 0):
            raise UsageError(f"timeout_s={value!r}: expected a positive number of seconds")
        self._timeout_s = float(value)
        if self._seg is not None:
            self._barrier.timeout_s = self._timeout_s

    @staticmethod
    def _exchange(group: Any, rank: int | None, world_size: int | None, store: Any, key: str,
                  timeout_s: float) -> _GroupExchange | _StoreExchange:
        if store is None:
            if rank is not None or world_size is not None:
                raise UsageError("ShmAllreduce got rank/world_size without a store; pass store= too, or a group")
            return _GroupExchange(group)
        if group is not None:
            raise UsageError("ShmAllreduce got both a group and a store; pass one of them")
        for name, value, low in (("rank", rank, 0), ("world_size", world_size, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise UsageError(f"{name}={value!r}: expected an integer >= {low}")
        assert rank is not None and world_size is not None
        if rank >= world_size:
            raise UsageError(f"rank={rank}: expected less than world_size={world_size}")
        return _StoreExchange(store, rank, world_size, key, timeout_s)

    def _setup(self, exchange: _GroupExchange | _StoreExchange) -> tuple[Segment, dict[int, int] | None]:
        """Rank 0 makes the segment, the others map it; rank 0 lets go of its descriptor once all hold it."""
        data_bytes = _BUFFERS * (self.world_size + 1) * self.slot_bytes
        info: dict[str, Any] = {"host": _host_label(), "pid": os.getpid(), "machine": platform.machine(),
                                "supported": spin_barrier_supported()}
        seg: Segment | None = None
        if self.rank == 0 and info["supported"]:
            try:
                seg, info["segment"] = Segment.create(self.world_size, self.slot_bytes, data_bytes)
            except ShmUnavailableError as exc:
                info["error"] = str(exc)
        try:
            infos = exchange.all_gather(info)
            problem = _setup_problem(infos)
            if problem:
                raise ShmUnavailableError(problem)
            error = ""
            if self.rank != 0:
                try:
                    seg = Segment.attach(infos[0].get("segment"), self.world_size, self.slot_bytes, data_bytes)
                except ShmUnavailableError as exc:
                    error = str(exc)
            errors = [m.get("error", "") for m in exchange.all_gather({"error": error})]
            failed = [(r, e) for r, e in enumerate(errors) if e]
            if failed:
                raise ShmUnavailableError(f"rank {failed[0][0]}: {failed[0][1]}")
        except BaseException:
            if seg is not None:
                seg.close()
            raise
        assert seg is not None
        seg.release_handle()  # every rank maps it now: the segment lives exactly as long as they do
        pids = {r: int(m["pid"]) for r, m in enumerate(infos) if r != self.rank}
        # a peer whose pid is not alive here lives in another pid namespace: then only the timeout guards
        return seg, pids if all(process_alive(p) for p in pids.values()) else None

    # --- the collective ---------------------------------------------------------------------------------

    def allreduce_(self, tensor: torch.Tensor, op: object = "sum") -> torch.Tensor:
        """Replace ``tensor`` (CPU, float32/float64/bfloat16/float16) by the sum or mean over the ranks."""
        code = _op_code(op)
        problem = None if code is not None else (
            f"op={op!r} is not supported; expected 'sum' or 'mean' (or ReduceOp.SUM / ReduceOp.AVG)")
        return self._collective(tensor, code or 0, problem)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Replace ``tensor`` on every rank by rank ``src``'s."""
        ok = isinstance(src, int) and not isinstance(src, bool) and 0 <= src < self.world_size
        problem = None if ok else f"src={src!r}: expected a rank 0..{self.world_size - 1}"
        return self._collective(tensor, _OP_BROADCAST + (src if ok else 0), problem)

    def _collective(self, tensor: torch.Tensor, opc: int, problem: str | None) -> torch.Tensor:
        problem = problem or _check_tensor(tensor)
        if self._broken is not None:
            raise ShmAllreduceError(self._broken)
        if self._seg is None:  # one rank: nothing to exchange
            if problem:
                raise UsageError(f"shm allreduce: {problem}")
            return tensor  # the sum and the mean of one tensor are itself
        with self._lock:
            return self._run(tensor, opc, problem)

    def _run(self, tensor: torch.Tensor, opc: int, problem: str | None) -> torch.Tensor:
        seg, barrier = self._seg, self._barrier
        assert seg is not None
        self._calls += 1
        numel = tensor.numel() if isinstance(tensor, torch.Tensor) else -1
        dcode = 0 if problem else _DTYPE_CODES[tensor.dtype]
        line = barrier.line(self.rank)
        seg.ctl[line + NUMEL], seg.ctl[line + DTYPE], seg.ctl[line + OP] = numel, dcode, opc
        try:
            with torch.no_grad():
                if problem:
                    barrier.arrive(f"call {self._calls}")
                    barrier.arrive(f"call {self._calls}")  # the peers have read what this rank passed
                    self._chunk += 1
                    raise UsageError(f"shm allreduce (rank {self.rank}): {problem}")
                flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().reshape(-1)
                _Chunks(self, flat, opc).run(f"call {self._calls}")
        except (UsageError, _MismatchError):
            raise
        except BaseException as exc:
            self._break(exc)
            raise
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            with torch.no_grad():
                tensor.copy_(flat.view(tensor.shape))
        return tensor

    def _break(self, exc: BaseException) -> None:
        # peers waiting for this rank learn at once that it will not come, instead of timing out
        self._broken = f"the shm group broke in an earlier call ({type(exc).__name__}: {exc})"
        if self._seg is not None:
            self._barrier.set_state(ABORTED)

    def _buffers(self, dtype: torch.dtype) -> list[torch.Tensor]:
        views = self._views.get(dtype)
        if views is None:
            rows = self.world_size + 1
            typed = self._bytes.view(dtype).view(_BUFFERS, rows, self.slot_bytes // dtype.itemsize)
            views = self._views[dtype] = list(typed.unbind(0))
        return views

    def _check_peers(self, dcode: int) -> None:
        """After a call's first barrier: every rank passed the same thing, or all raise the same error."""
        seg, barrier = self._seg, self._barrier
        assert seg is not None
        theirs = [(seg.ctl[barrier.line(r) + NUMEL], seg.ctl[barrier.line(r) + DTYPE], seg.ctl[barrier.line(r) + OP])
                  for r in range(self.world_size)]
        if all(t == theirs[0] for t in theirs) and dcode != 0:
            return
        # a second barrier before raising: no rank may write its next call's fields before all have read these
        barrier.arrive("comparing what the ranks passed")
        self._chunk += 1
        other = next(r for r, t in enumerate(theirs) if r > 0 and (t != theirs[0] or t[1] == 0 or theirs[0][1] == 0))
        raise _MismatchError(f"shm allreduce: rank 0 passed {_describe(*theirs[0])}, rank {other} passed "
                             f"{_describe(*theirs[other])}; every rank must pass a tensor of the same size, dtype "
                             "and op in the same order")

    # --- lifetime ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap the segment (nothing else holds it after setup); peers still waiting on this rank raise."""
        seg, self._seg = self._seg, None
        if seg is None:
            return
        _live.discard(self)
        if self._broken is None:
            self._barrier.set_state(CLOSED)
        self._broken = "this shm group was closed"
        self._views.clear()
        del self._bytes
        seg.close()

    def __enter__(self) -> ShmAllreduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _MismatchError(ShmAllreduceError):
    """The ranks passed different tensors: every rank raises it at the same barrier, so the group stays usable."""


class _Chunks:
    """One call's chunk loop: scatter(0); barrier; [reduce(i); scatter(i+1); barrier; gather(i)] for each i."""

    def __init__(self, group: ShmAllreduce, flat: torch.Tensor, opc: int) -> None:
        self.g = group
        self.flat = flat
        self.opc = opc
        self.k, self.r = group.world_size, group.rank
        self.buffers = group._buffers(flat.dtype)
        self.per_chunk = self.buffers[0].shape[1]
        n = flat.numel()
        self.n = n
        self.m = max(1, -(-n // self.per_chunk))
        self._full = chunk_bounds(self.per_chunk, self.k)
        self.src = opc - _OP_BROADCAST if opc >= _OP_BROADCAST else None
        self.half = flat.dtype in (torch.bfloat16, torch.float16)
        self._pieces: dict[int, tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]] = {}

    def _piece(self, i: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
        """Chunk ``i`` of the tensor, its buffer, and the rank slices; made once, used by three steps."""
        piece = self._pieces.get(i)
        if piece is None:
            lo = i * self.per_chunk
            c = min(self.per_chunk, self.n - lo)
            bounds = self._full if c == self.per_chunk else chunk_bounds(c, self.k)
            piece = self._pieces[i] = (self.flat[lo:lo + c], self.buffers[(self.g._chunk + i) % _BUFFERS], bounds)
            self._pieces.pop(i - 2, None)
        return piece

    def run(self, context: str) -> None:
        g, barrier = self.g, self.g._barrier
        self.scatter(0)
        barrier.arrive(context)
        g._check_peers(_DTYPE_CODES[self.flat.dtype])
        for i in range(self.m):
            self.reduce(i)
            if i + 1 < self.m:
                self.scatter(i + 1)
            barrier.arrive(f"{context}, chunk {i + 1} of {self.m}")
            self.gather(i)
        g._chunk += self.m

    def scatter(self, i: int) -> None:
        x, buf, bounds = self._piece(i)
        if self.src is not None:
            if self.r == self.src:
                buf[self.k, :x.numel()].copy_(x)
            return
        row = buf[self.r]
        for j, (a, b) in enumerate(bounds):
            if j != self.r and b > a:
                row[a:b].copy_(x[a:b])

    def reduce(self, i: int) -> None:
        if self.src is not None:
            return
        x, buf, bounds = self._piece(i)
        a, b = bounds[self.r]
        if b == a:
            return
        dst = buf[self.k, a:b]
        parts = [x[a:b] if j == self.r else buf[j, a:b] for j in range(self.k)]
        mean = self.opc == _OP_MEAN
        if self.half and (self.k > 2 or mean):
            # accumulate in float32 and round once, as a float32 sum cast down would
            acc = parts[0].float()
            for p in parts[1:]:
                acc.add_(p)
            if mean:
                acc.div_(self.k)
            dst.copy_(acc)
            return
        torch.add(parts[0], parts[1], out=dst)
        for p in parts[2:]:
            dst.add_(p)
        if mean:
            dst.div_(self.k)

    def gather(self, i: int) -> None:
        x, buf, _ = self._piece(i)
        if self.src is not None and self.r == self.src:
            return
        x.copy_(buf[self.k, :x.numel()])


def _setup_problem(infos: list[dict]) -> str | None:
    """Why these ranks cannot share a segment (the same answer on every rank), or None."""
    hosts = [m.get("host") for m in infos]
    if any(h != hosts[0] for h in hosts):
        where = ", ".join(f"rank {r} on {h!r}" for r, h in enumerate(hosts))
        return f"the ranks are on different hosts ({where}); use host_allreduce_ or torch.distributed.all_reduce"
    unsupported = [r for r, m in enumerate(infos) if not m.get("supported")]
    if unsupported:
        r = unsupported[0]
        return (f"rank {r} ({infos[r].get('machine')!r}) lacks Linux's memfd_create or x86-64 store ordering, which "
                "the shared-memory segment and barrier rely on; use torch.distributed.all_reduce")
    if infos[0].get("error"):
        return f"rank 0: {infos[0]['error']}"
    return None


# --- host_allreduce_: shared memory within a host, torch.distributed between hosts --------------------------------


class _HostPlan:
    """How one process group's allreduce runs: decided once from the hosts of its ranks."""

    def __init__(self, group: Any, host_name: str | None, timeout_s: float, chunk_bytes: int) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.world = dist.get_world_size(group)
        me: dict[str, Any] = {"host": host_name or _host_label(), "rank": dist.get_rank()}
        members: list[Any] = [None] * self.world
        dist.all_gather_object(members, me, group=group)
        hosts: dict[str, list[int]] = {}
        for m in members:
            hosts.setdefault(m["host"], []).append(m["rank"])
        self.local: ShmAllreduce | None = None
        self.leaders: Any = None  # the group of one rank per host, on the leaders only
        self.is_leader = False
        self.kind = "single"
        if self.world == 1:
            return
        mine = hosts[me["host"]]
        if len(hosts) == 1:
            self.local = self._local(group, timeout_s, chunk_bytes)
            self.kind = "shm" if self.local is not None else "dist"
            return
        if all(len(r) == 1 for r in hosts.values()):
            self.kind = "dist"
            return
        if group is not dist.group.WORLD:
            # subgroups per host must be made by every rank of the world in one order; a group that is not
            # the world cannot ask the ranks outside it to take part
            log.warning("host_allreduce_: the group spans several hosts and is not the default group; using "
                        "torch.distributed.all_reduce without the shared-memory stage")
            self.kind = "dist"
            return
        self.kind = "hierarchical"
        local_group = None
        for host in sorted(hosts, key=lambda h: hosts[h][0]):  # every rank, the same order
            made = dist.new_group(hosts[host])
            if host == me["host"]:
                local_group = made
        leaders = dist.new_group([r[0] for r in sorted(hosts.values())])
        self.is_leader = me["rank"] == mine[0]
        if self.is_leader:
            self.leaders = leaders
        if len(mine) > 1:
            self.local = self._local(local_group, timeout_s, chunk_bytes)
        # one host without a segment sends the whole group to torch.distributed: every rank must agree
        usable: list[Any] = [None] * self.world
        dist.all_gather_object(usable, len(mine) == 1 or self.local is not None, group=group)
        if not all(usable):
            if self.local is not None:
                self.local.close()
                self.local = None
            self.kind = "dist"

    @staticmethod
    def _local(group: Any, timeout_s: float, chunk_bytes: int) -> ShmAllreduce | None:
        try:
            return ShmAllreduce(group, timeout_s=timeout_s, chunk_bytes=chunk_bytes)
        except ShmUnavailableError as exc:  # raised on every rank alike, so all fall back together
            log.warning("host_allreduce_: shared memory unavailable (%s); using torch.distributed.all_reduce", exc)
            return None

    def allreduce_(self, tensor: torch.Tensor, op: object) -> torch.Tensor:
        if self.kind == "shm":
            assert self.local is not None
            return self.local.allreduce_(tensor, op)  # checks the arguments collectively itself
        # the same checks as the shared-memory path, so a call fails alike whichever way the hosts are laid out
        problem = _check_tensor(tensor)
        code = _op_code(op)
        if problem is None and code is None:
            problem = f"op={op!r} is not supported; expected 'sum' or 'mean' (or ReduceOp.SUM / ReduceOp.AVG)"
        if problem:
            raise UsageError(f"host_allreduce_: {problem}")
        if self.kind == "single":
            return tensor
        if self.kind == "dist":
            self.dist.all_reduce(tensor, group=self.group)
        else:
            if self.local is not None:
                self.local.allreduce_(tensor, "sum")
            if self.is_leader:
                self.dist.all_reduce(tensor, group=self.leaders)
            if self.local is not None:
                self.local.broadcast_(tensor, src=0)
        if code == _OP_MEAN:
            with torch.no_grad():
                tensor.div_(self.world)
        return tensor

    def close(self) -> None:
        if self.local is not None:
            self.local.close()


_plans: dict[int, tuple[Any, _HostPlan]] = {}
_plans_lock = threading.Lock()


def _host_label() -> str:
    # The launch's label for this host (name and address across nodes), not the bare host name:
    # network namespaces and cloned machines share names but not memory.
    from ...machine import rank_host

    return rank_host()


def host_allreduce_(tensor: torch.Tensor, group: Any = None, op: object = "sum", *, host_name: str | None = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """Allreduce ``tensor`` in place over ``group`` (default: the whole world) the fastest way the hosts allow.

    The first call on a group is collective setup (hostnames exchanged, segments mapped, subgroups made);
    later calls reuse it, so ``host_name``, ``timeout_s`` and ``chunk_bytes`` count on the first call only.
    ``host_name`` overrides this process's host name (ranks with equal names are taken to share
    memory). ``op``: ``"sum"`` or ``"mean"``. Float tensors on the CPU only, whatever the path.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise UsageError("host_allreduce_ needs an initialised torch.distributed process group; call "
                         "init_process_group first (a ProcessLauncher with a backend does)")
    resolved = group if group is not None else dist.group.WORLD
    with _plans_lock:
        entry = _plans.get(id(resolved))
        if entry is None:
            # the group object is kept alive with its plan, so its id cannot be reused by another group
            entry = _plans[id(resolved)] = (resolved, _HostPlan(resolved, host_name, timeout_s, chunk_bytes))
    return entry[1].allreduce_(tensor, op)


def host_allreduce_kind(group: Any = None) -> str | None:
    """How :func:`host_allreduce_` reduces over ``group``: "shm", "hierarchical", "dist" or "single"; None before
    its first call on the group."""
    import torch.distributed as dist

    resolved = group if group is not None else dist.group.WORLD
    with _plans_lock:
        entry = _plans.get(id(resolved))
    return None if entry is None else entry[1].kind


def close_host_allreduce(group: Any = None) -> None:
    """Forget the plan of ``group`` (all plans when None) and unmap its segments."""
    with _plans_lock:
        keys = list(_plans) if group is None else [id(group)]
        for key in keys:
            entry = _plans.pop(key, None)
            if entry is not None:
                entry[1].close()

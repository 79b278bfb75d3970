"""The process axis: a Trainer that spans several processes, each holding one or more devices.

Gradients are reduced hierarchically: first among the devices of one process (the allreduce
algorithms on the engine's lanes, host memory shared), then across processes. Every reduction that
crosses a process boundary goes through :func:`allreduce_across_processes`, the one place where the
transport is chosen. By default the choice is measured (:mod:`~dlperf.parallel.communication.process_links`): the first
sum of a group times :func:`~dlperf.parallel.allreduce.host_allreduce_` (shared memory between processes
of one host, hierarchical when hosts hold several ranks) against ``torch.distributed`` (gloo), fits
latency + size / bandwidth to each, and every later sum takes the faster one for its size.
``DLPERF_PROCESS_ALLREDUCE=gloo`` sends every sum through ``torch.distributed.all_reduce`` and ``=shm``
through ``host_allreduce_``, unmeasured, to compare them or to step around a host where one misbehaves.

Each process is given the *global* mini-batch (every process loads the same data in the same order,
from the same seed) and trains on its own slice: device ``d`` of ``k`` in process ``r`` of ``P`` takes
part ``r * k + d`` of ``P * k`` near-equal parts (:func:`~dlperf.parallel.split.split_sizes`). Each
part's loss is weighted by its share of the global batch, so the summed gradients are those of the
global mean loss: one process with two devices, two processes with one device each and PyTorch DDP
compute the same update.

>>> local_parts(10, world=2, rank=1, k=2)  # 10 examples on 4 devices: parts 3, 3, 2, 2
(6, [2, 2])
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...devices import cpu_count
from ...errors import UsageError
from ..launchers import rank_info
from ..split import split_sizes

PROCESS_ALLREDUCE_ENV = "DLPERF_PROCESS_ALLREDUCE"
_TRANSPORTS = ("auto", "gloo", "shm")
_SHM_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

__all__ = ["PROCESS_ALLREDUCE_ENV", "ExchangeClock", "ExchangeReport", "ExchangeRow", "ProcessAxis",
           "allreduce_across_processes", "broadcast_from_first", "check_process_settings",
           "describe_process_allreduce", "gather_exchanges", "join_processes", "keep_exchange_report",
           "last_exchange_report", "local_parts"]


def allreduce_across_processes(flat: torch.Tensor, group: Any = None) -> None:
    """Sum ``flat`` in place over every process of ``group`` (the default group when ``None``).

    Every cross-process reduction of dlperf comes here, so the transport is swapped at this one place.
    Processes must call it in the same order with tensors of the same size and dtype; the first call on a
    group (under the default ``auto``) measures the links, collectively.
    """
    import torch.distributed as dist

    transport = _transport()
    if transport != "gloo" and flat.device.type == "cpu" and flat.dtype in _SHM_DTYPES:
        from ..allreduce.shm import host_allreduce_
        from .process_links import choose_process_allreduce, run_transport

        if transport == "shm":
            host_allreduce_(flat, group)
            return
        run_transport(choose_process_allreduce(group).pick(flat.numel() * flat.element_size()), flat, group)
        return
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)


def describe_process_allreduce(group: Any = None, *, choose: bool = False) -> list[str]:
    """How sums across the processes of ``group`` travel, and why: one line per fact.

    ``choose=True`` makes the measured choice now if it is not made yet: collective then, so every process
    of the group must call it at the same point. Otherwise it is never collective.
    """
    transport = _transport()
    if transport != "auto":
        how = "torch.distributed.all_reduce" if transport == "gloo" else "host_allreduce_ (shared memory per host)"
        return [f"process allreduce: {transport} ({how}), set by {PROCESS_ALLREDUCE_ENV}={transport}"]
    from .process_links import choose_process_allreduce, chosen_process_allreduce

    choice = choose_process_allreduce(group) if choose else chosen_process_allreduce(group)
    if choice is None:
        return ["process allreduce: not chosen yet (the first sum across processes measures the links)"]
    return choice.describe()


def check_process_settings() -> None:
    """Raise UsageError now for a bad ``DLPERF_PROCESS_ALLREDUCE`` or ``DLPERF_LINK_PROBE``, not at the first sum."""
    from .process_links import probe_again_requested

    _transport()
    probe_again_requested()


def _transport() -> str:
    text = os.environ.get(PROCESS_ALLREDUCE_ENV, "auto").strip().lower()
    if text not in _TRANSPORTS:
        raise UsageError(f"{PROCESS_ALLREDUCE_ENV}={text!r}: expected one of {', '.join(_TRANSPORTS)}; "
                         "unset it for auto (measured)")
    return text


def broadcast_from_first(tensors: Sequence[torch.Tensor], group: Any = None) -> None:
    """Overwrite ``tensors`` in every process with the first process's (in place, in order)."""
    import torch.distributed as dist

    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t, src=src, group=group)


def local_parts(n: int, world: int, rank: int, k: int) -> tuple[int, list[int]]:
    """Where process ``rank``'s slice of a global batch of ``n`` starts, and its devices' part sizes."""
    sizes = split_sizes(n, world * k)
    return sum(sizes[:rank * k]), sizes[rank * k:(rank + 1) * k]


@dataclass
class ProcessAxis:
    """The processes one Trainer spans: this one's rank, how many, and the process group they share."""

    rank: int
    world: int
    local_world: int = 1
    group: Any = None
    """A ``torch.distributed`` group, or ``None`` for the default one."""
    owns_default_group: bool = False
    """Whether :func:`join_processes` started the default group (so closing the trainer ends it)."""

    def cores(self) -> int:
        """The cores of this host left to this process when every local process takes an equal share."""
        return max(1, cpu_count() // self.local_world)

    def close(self) -> None:
        if self.owns_default_group:
            import torch.distributed as dist

            from ..allreduce.shm import close_host_allreduce
            from .process_links import forget_process_choices

            close_host_allreduce()  # the segments set up on the group go with it
            forget_process_choices()

            if dist.is_initialized():
                dist.destroy_process_group()
            self.owns_default_group = False


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{name}={text!r}: expected an integer; unset it or start the processes with "
                         "dlperf launch or torchrun") from None


def join_processes(group: Any = None) -> ProcessAxis | None:
    """The processes this one trains with, or ``None`` when it trains alone.

    Under ``dlperf launch`` the process group already exists. Under plain ``torchrun`` (``WORLD_SIZE``
    and ``MASTER_ADDR`` set, no group yet) a gloo group is started here from the environment.
    """
    import torch.distributed as dist

    if not dist.is_available():
        return None
    local_world = _env_int("LOCAL_WORLD_SIZE", 1)
    if group is not None or dist.is_initialized():
        world = dist.get_world_size(group)
        if world == 1:
            return None
        return ProcessAxis(dist.get_rank(group), world, max(1, local_world), group)
    info = rank_info()
    if info.world_size <= 1:
        return None
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise UsageError(f"WORLD_SIZE={info.world_size} but MASTER_ADDR/MASTER_PORT are not set; start the "
                         "processes with dlperf launch or torchrun, or unset WORLD_SIZE")
    from ..._attempt import attempt_store

    store = attempt_store()  # under a launcher's agent: this attempt's keys, not a restarted one's predecessor's
    if store is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=store, rank=info.rank, world_size=info.world_size)
    return ProcessAxis(info.rank, info.world_size, max(1, local_world), None, owns_default_group=True)


# Straggler: who the others wait on. A sum across processes ends at about the same moment on every rank,
# so a rank's time inside it is the transfer plus its wait for the last rank to arrive. The rank that
# spends least there arrived last: its peers' extra time is what they waited on it. Each rank adds up its
# own sums (no clock is shared between hosts) and hands the totals over once, when training ends.
_STRAGGLER_FACTOR = 2.0
"""Named only when every peer spent more than this many times the straggler's own time in the sums..."""
_STRAGGLER_MIN_WAIT_S = 1e-3
"""... and waited on it more than this per sum, on average (below it the difference is noise)."""
_GATHER_TIMEOUT_S = 10.0
_LINK_PROBE_BYTES = 1 << 18
"""A slow link slows every rank's sums alike (a ring waits on its slowest hop), so the sums cannot name it:
each rank also times one write of this many bytes to the store, a few milliseconds on a fast link."""
_LAST_REPORT: ExchangeReport | None = None
_gathers = 0  # trainers one process ended: each gathers under its own keys


@dataclass
class ExchangeClock:
    """Seconds this process spent in sums across processes, and how many; the first one is left out
    (under ``auto`` it measures the links first)."""

    seconds: float = 0.0
    count: int = 0
    skipped: int = 0

    def timed(self, fn: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        """``fn`` with each call's wall time added up here."""
        def run(flat: torch.Tensor) -> None:
            start = time.perf_counter()
            try:
                fn(flat)
            finally:
                if self.skipped == 0:
                    self.skipped = 1
                else:
                    self.seconds += time.perf_counter() - start
                    self.count += 1
        return run


@dataclass(frozen=True)
class ExchangeRow:
    """One rank's share: its host as the launch names it, seconds in sums across processes, how many sums."""

    rank: int
    host: str
    seconds: float
    count: int
    link_s: float = 0.0
    """The best of two writes of ``_LINK_PROBE_BYTES`` to the launch's store (on the first rank's host)."""


@dataclass(frozen=True)
class ExchangeReport:
    """Every rank's time in sums across processes, and the straggler they name (if any).

    >>> r = ExchangeReport((ExchangeRow(0, "a", 2.0, 10), ExchangeRow(1, "b", 0.1, 10), ExchangeRow(2, "c", 2.1, 10)))
    >>> r.straggler().rank, [round(w, 1) for w in r.waits()]
    (1, [1.9, 0.0, 2.0])
    >>> ExchangeReport((ExchangeRow(0, "a", 1.0, 10), ExchangeRow(1, "b", 0.9, 10))).straggler() is None
    True
    """

    rows: tuple[ExchangeRow, ...] = field(default_factory=tuple)

    def waits(self) -> list[float]:
        """Per rank, the seconds it spent in the sums beyond the rank that spent least (its wait on others)."""
        least = min(r.seconds for r in self.rows)
        return [r.seconds - least for r in self.rows]

    def slow_link(self) -> str | None:
        """The host whose link to the store is slow next to the other hosts', or ``None``.

        Writes from the first rank's host do not cross a link, so only the other hosts are compared, and
        only when there are at least two of them (with one, no side of the link can be blamed).
        """
        first = self.rows[0].host
        best: dict[str, float] = {}
        for r in self.rows:
            if r.host != first:
                best[r.host] = min(r.link_s, best.get(r.host, float("inf")))
        if len(best) < 2:
            return None
        host = max(best, key=lambda h: best[h])
        others = max(s for h, s in best.items() if h != host)
        if best[host] > _STRAGGLER_FACTOR * others and best[host] - others > _STRAGGLER_MIN_WAIT_S:
            return host
        return None

    def straggler(self) -> ExchangeRow | None:
        """The rank every other rank waited on, or ``None`` when no rank held the others up."""
        if len(self.rows) < 2:
            return None
        last = min(self.rows, key=lambda r: r.seconds)
        peers = [r for r in self.rows if r is not last]
        count = max(1, last.count)
        if all(p.seconds > _STRAGGLER_FACTOR * last.seconds and
               (p.seconds - last.seconds) / count > _STRAGGLER_MIN_WAIT_S for p in peers):
            return last
        return None

    def describe(self) -> str:
        """One line for a run's summary."""
        count = max(r.count for r in self.rows)
        spent = [r.seconds for r in self.rows]
        slow = self.straggler()
        link = self.slow_link() if slow is None else None
        if link is not None:
            ms = {r.host: r.link_s * 1e3 for r in self.rows if r.host != self.rows[0].host}
            theirs = [v for h, v in ms.items() if h != link]
            return (f"straggler: {link}, on a slow link (every rank spent {min(spent):.2f}-{max(spent):.2f} s in "
                    f"{count} sums across processes; {_LINK_PROBE_BYTES >> 10} KiB to the first host took "
                    f"{ms[link]:.1f} ms from it, {min(theirs):.1f}-{max(theirs):.1f} ms from the others)")
        if slow is None:
            return (f"straggler: none (every rank spent {min(spent):.2f}-{max(spent):.2f} s in {count} sums "
                    "across processes)")
        waits = [w for r, w in zip(self.rows, self.waits(), strict=True) if r is not slow]
        return (f"straggler: rank {slow.rank} on {slow.host} (its peers waited {min(waits):.2f}-{max(waits):.2f} s "
                f"on it over {count} sums across processes; it spent {slow.seconds:.2f} s in them)")

    def as_dict(self) -> dict[str, Any]:
        slow, link = self.straggler(), self.slow_link()
        named = ({"rank": slow.rank, "host": slow.host, "cause": "waited on"} if slow is not None else
                 {"rank": None, "host": link, "cause": "slow link"} if link is not None else None)
        return {"straggler": named,
                "ranks": [{"rank": r.rank, "host": r.host, "exchange_s": r.seconds, "exchanges": r.count,
                           "wait_s": w, "link_s": r.link_s} for r, w in zip(self.rows, self.waits(), strict=True)]}


def gather_store(kind: str) -> Any | None:
    """The launch's rendezvous store under a prefix of its own for this gather (every rank numbers its gathers
    alike), or None outside a launcher's agent."""
    global _gathers
    from ..._attempt import attempt_store

    _gathers += 1
    return attempt_store(f"{kind}/{_gathers}/")


def hand_over(store: Any, rank: int, value: object, wait_for: Sequence[str]) -> bool:
    """Put this rank's ``value`` (JSON) under its rank; on rank 0, wait at most ``_GATHER_TIMEOUT_S`` for the
    keys ``wait_for``. True on rank 0 once they are all there; False elsewhere, or when a rank that stopped
    early never reported (no straggler can then be named)."""
    import datetime

    store.set(str(rank), json.dumps(value))
    if rank != 0:
        return False
    try:
        store.wait(list(wait_for), datetime.timedelta(seconds=_GATHER_TIMEOUT_S))
    except RuntimeError:
        return False
    return True


def gather_exchanges(clock: ExchangeClock, axis: ProcessAxis) -> ExchangeReport | None:
    """Hand this rank's totals over; on the first rank of ``axis``, collect every rank's and keep the report
    (:func:`last_exchange_report`).

    Through the launch's rendezvous store, not a collective: a rank that stops early (an error, Ctrl-C)
    leaves the others waiting on no sum, and the first rank waits at most ``_GATHER_TIMEOUT_S`` for a
    missing one, then reports nothing. ``None`` on the other ranks and outside a launcher's agent.
    """
    global _LAST_REPORT
    from ..launchers import rank_host

    store = gather_store("exchanges")
    if store is None:
        return None
    payload, link_s = b"\0" * _LINK_PROBE_BYTES, float("inf")
    for _ in range(2):
        start = time.perf_counter()
        store.set(f"link/{axis.rank}", payload)
        store.add(f"link/{axis.rank}/acks", 1)  # set does not wait for the store; this reply comes after it
        link_s = min(link_s, time.perf_counter() - start)
    keys = [str(r) for r in range(axis.world)]
    if not hand_over(store, axis.rank, [rank_host(), clock.seconds, clock.count, link_s], keys):
        return None
    rows = []
    for r, key in enumerate(keys):
        host, seconds, count, link_s = json.loads(store.get(key))
        rows.append(ExchangeRow(r, str(host), float(seconds), int(count), float(link_s)))
    _LAST_REPORT = ExchangeReport(tuple(rows))
    return _LAST_REPORT


def keep_exchange_report(report: ExchangeReport) -> None:
    """Make ``report`` the one :func:`last_exchange_report` returns (the parameter servers gather their own)."""
    global _LAST_REPORT
    _LAST_REPORT = report


def last_exchange_report() -> ExchangeReport | None:
    """The report of the last multi-process training this (first) process ended, or ``None``."""
    return _LAST_REPORT

"""Which transport sums a tensor across processes, chosen from measured links (d2l 12.7's adaptive strategy).

The candidates are those the layout allows: ``host_allreduce_`` (shared memory within one host, or
hierarchical where hosts hold several ranks) and plain ``torch.distributed.all_reduce`` (gloo). At the
first sum of a group every rank times each candidate at a latency-bound and a bandwidth-bound size
(:data:`PROBE_SIZES`); a repetition takes its slowest rank's time, and the best repetition counts. Rank 0
fits ``latency + size / bandwidth`` per transport and broadcasts the fits, so every rank makes the same
choice for every size. The fits are
saved per layout (:mod:`dlperf.probe.links`) and reused by later runs; ``DLPERF_LINK_PROBE=again``
measures again.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import UsageError
from ...probe.cost import Link
from ...probe.links import load_links, save_links

LINK_PROBE_ENV = "DLPERF_LINK_PROBE"
PROBE_SIZES = (4 << 10, 4 << 20)
"""Bytes of the two probe tensors: one where latency dominates, one where bandwidth does."""
PROBE_REPEATS = 5

__all__ = ["LINK_PROBE_ENV", "PROBE_SIZES", "ProcessChoice", "choose_process_allreduce", "chosen_process_allreduce",
           "forget_process_choices", "probe_again_requested"]


@dataclass
class ProcessChoice:
    """The fitted links of one group's candidate transports, and where the figures came from."""

    fits: dict[str, Link]
    source: str
    thresholds: list[tuple[float, str]] = field(init=False)
    """(from bytes, transport) in increasing order: the fastest transport from that size up."""

    def __post_init__(self) -> None:
        self.thresholds = _regions(self.fits)

    def pick(self, nbytes: int) -> str:
        name = self.thresholds[0][1]
        for start, winner in self.thresholds:
            if nbytes >= start:
                name = winner
        return name

    def describe(self) -> list[str]:
        figures = "; ".join(f"{name}: {fit.describe()}" for name, fit in self.fits.items())
        if len(self.thresholds) == 1:
            verdict = f"{self.thresholds[0][1]} for every size"
        else:
            parts = [f"{self.thresholds[0][1]} below {_bytes(self.thresholds[1][0])}"]
            parts += [f"{name} from {_bytes(start)}" for start, name in self.thresholds[1:]]
            verdict = ", ".join(parts)
        return [f"process allreduce: {figures} -> {verdict}", f"process allreduce: {self.source}"]


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _regions(fits: dict[str, Link]) -> list[tuple[float, str]]:
    """Where each transport is the fastest: the lines cross at most once per pair, so test between crossings."""
    names = list(fits)
    crossings = set()
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            fa, fb = fits[a], fits[b]
            slope = 1 / fa.bandwidth - 1 / fb.bandwidth
            if slope != 0:
                at = (fb.alpha_s - fa.alpha_s) / slope
                if 0 < at < 1 << 50:
                    crossings.add(math.ceil(at))
    starts = [0, *sorted(crossings)]
    regions: list[tuple[float, str]] = []
    for k, start in enumerate(starts):
        probe_at = (start + starts[k + 1]) / 2 if k + 1 < len(starts) else max(2 * start, 1)
        best = min(names, key=lambda n: (fits[n].time(int(probe_at)), names.index(n)))
        if not regions or regions[-1][1] != best:
            regions.append((start, best))
    return regions


def run_transport(name: str, flat: torch.Tensor, group: Any) -> None:
    import torch.distributed as dist

    if name == "gloo":
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    else:
        from ..allreduce.shm import host_allreduce_

        host_allreduce_(flat, group)


def _measure(candidates: list[str], group: Any) -> dict[str, Link]:
    """Every rank times every candidate at both sizes; each repetition counts as its slowest rank's time."""
    import torch.distributed as dist

    times = torch.zeros(len(candidates), len(PROBE_SIZES), PROBE_REPEATS, dtype=torch.float64)
    for s, nbytes in enumerate(PROBE_SIZES):
        flat = torch.ones(nbytes // 4, dtype=torch.float32)
        for name in candidates:
            run_transport(name, flat, group)  # warm: first touches, connections, caches
        # the candidates take turns within each repetition, as the one decider's rounds do: a burst of load on
        # a shared host then slows both alike instead of deciding for whichever ran outside it
        for r in range(PROBE_REPEATS):
            for c, name in enumerate(candidates):
                dist.barrier(group=group)
                start = time.perf_counter()
                run_transport(name, flat, group)
                times[c, s, r] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    fits = {}
    for c, name in enumerate(candidates):
        # the best repetition: on a shared host the others measure the neighbours, not the link
        best = [min(times[c, s].tolist()) for s in range(len(PROBE_SIZES))]
        fits[name] = Link.fit(list(PROBE_SIZES), best)
    return fits


def _candidates(group: Any) -> list[str]:
    from ..allreduce.shm import host_allreduce_, host_allreduce_kind
    from ..launchers import rank_host

    # collective: sets up the segments and learns the layout. The host as the launch knows it, not the bare
    # host name: hosts that share a name (network namespaces, cloned machines) must not be taken for one
    host_allreduce_(torch.zeros(1), group, host_name=rank_host())
    kind = host_allreduce_kind(group)
    return [kind, "gloo"] if kind in ("shm", "hierarchical") else ["gloo"]


def probe_again_requested() -> bool:
    """Whether DLPERF_LINK_PROBE asks to measure the links again; a bad value is a UsageError."""
    text = os.environ.get(LINK_PROBE_ENV, "").strip().lower()
    if text not in ("", "again", "cached"):
        raise UsageError(f"{LINK_PROBE_ENV}={text!r}: expected again (measure the links between processes again) "
                         "or cached; unset it to reuse saved figures")
    return text == "again"


def _decide(group: Any) -> ProcessChoice:
    import torch.distributed as dist

    from ..launchers import rank_host

    candidates = _candidates(group)
    if len(candidates) == 1:
        return ProcessChoice({"gloo": Link(0.0, math.inf)},
                             "only torch.distributed: every host holds one rank or shared memory is unavailable")
    me = dist.get_rank(group)
    hosts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, rank_host(), group=group)
    again = probe_again_requested()
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    found: list[Any] = [None]
    if me == 0 and not again:
        fits, path = load_links(hosts, candidates)
        found = [None if fits is None else ({n: (f.alpha_s, f.bandwidth) for n, f in fits.items()},
                                            f"figures saved in {path} (set {LINK_PROBE_ENV}=again to measure again)")]
    dist.broadcast_object_list(found, src=src, group=group)
    if found[0] is None:
        fits = _measure(candidates, group)
        source = (f"measured now at {_bytes(PROBE_SIZES[0])} and {_bytes(PROBE_SIZES[1])}, the best of "
                  f"{PROBE_REPEATS} repetitions, each timed on its slowest rank")
        found = [None]
        if me == 0:
            try:
                source += f", saved in {save_links(hosts, fits)}"
            except OSError as exc:  # a read-only cache costs a probe next time, not this run
                source += f", not saved ({exc})"
            found = [({n: (f.alpha_s, f.bandwidth) for n, f in fits.items()}, source)]
        dist.broadcast_object_list(found, src=src, group=group)  # rank 0's figures, so every rank agrees
    figures, source = found[0]
    return ProcessChoice({n: Link(*v) for n, v in figures.items()}, source)


_choices: dict[int, tuple[Any, ProcessChoice]] = {}
_lock = threading.Lock()


def choose_process_allreduce(group: Any = None) -> ProcessChoice:
    """The measured choice for ``group`` (the default group when None), made now if not yet: collective then."""
    import torch.distributed as dist

    resolved = group if group is not None else dist.group.WORLD
    with _lock:
        entry = _choices.get(id(resolved))
        if entry is None:
            # the group is kept with its choice, so its id cannot be reused by another group
            entry = _choices[id(resolved)] = (resolved, _decide(resolved))
    return entry[1]


def chosen_process_allreduce(group: Any = None) -> ProcessChoice | None:
    """The choice already made for ``group``, or None (never collective)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    resolved = group if group is not None else dist.group.WORLD
    with _lock:
        entry = _choices.get(id(resolved))
    return None if entry is None else entry[1]


def forget_process_choices() -> None:
    """Drop every group's choice (with the process group they belong to)."""
    with _lock:
        _choices.clear()

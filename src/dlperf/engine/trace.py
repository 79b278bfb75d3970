"""Timelines of engine operations: Chrome trace JSON (opens in Perfetto) and a text summary.

Each record is one operation: name, worker (``cpu(1)/compute``, ``gpu(0)/copy``, or
``cpu(0)/caller`` when a waiting thread ran it), host start and end, and the ids of the operations
it depended on. GPU operations are timed on the host, so their spans show launch time, not kernel
time.

Example:
    >>> from dlperf.engine import create_engine
    >>> with create_engine(trace=True) as eng:
    ...     _ = eng.push(sum, args=([1, 2],), name="add")
    ...     eng.waitall()
    ...     t = eng.stop_trace()
    >>> [e.name for e in t.events]
    ['add']
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._io import atomic_write_text, decode_json, read_bounded
from ..errors import UsageError

__all__ = ["TraceEvent", "Trace", "WorkerSummary", "TraceSummary", "summarize", "load_trace", "format_summary",
           "union_intervals", "PROFILER_OWN_CATEGORIES"]


@dataclass(frozen=True)
class TraceEvent:
    """One operation on the timeline; times in microseconds from the start of the trace."""

    id: int
    name: str
    worker: str
    start_us: float
    end_us: float
    deps: tuple[int, ...] = ()
    failed: bool = False

    @property
    def device(self) -> str:
        return self.worker.split("/", 1)[0]


@dataclass
class Trace:
    """A recorded timeline; :meth:`save` writes Chrome trace JSON."""

    events: list[TraceEvent] = field(default_factory=list)

    @classmethod
    def from_records(cls, records: list[tuple], t0_ns: int) -> Trace:
        events = [TraceEvent(id=r[0], name=r[1], worker=r[2], start_us=(r[3] - t0_ns) / 1e3,
                             end_us=(r[4] - t0_ns) / 1e3, deps=tuple(r[5]), failed=bool(r[6]))
                  for r in records]
        events.sort(key=lambda e: e.start_us)
        return cls(events)

    def to_chrome(self) -> dict[str, Any]:
        """The Chrome trace document: one process per device, one thread per worker lane."""
        pids: dict[str, int] = {}
        tids: dict[str, int] = {}
        out: list[dict[str, Any]] = []
        for e in self.events:
            dev, lane = (e.worker.split("/", 1) + [""])[:2]
            if dev not in pids:
                pids[dev] = len(pids) + 1
                out.append({"ph": "M", "name": "process_name", "pid": pids[dev], "tid": 0,
                            "args": {"name": dev}})
            if e.worker not in tids:
                tids[e.worker] = len(tids) + 1
                out.append({"ph": "M", "name": "thread_name", "pid": pids[dev], "tid": tids[e.worker],
                            "args": {"name": e.worker}})
            out.append({"ph": "X", "name": e.name, "cat": lane or "op", "pid": pids[dev],
                        "tid": tids[e.worker], "ts": round(e.start_us, 3),
                        "dur": round(max(e.end_us - e.start_us, 0.0), 3),
                        "args": {"id": e.id, "deps": list(e.deps), "failed": e.failed}})
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def save(self, path: str | Path) -> Path:
        """Write Chrome trace JSON to ``path`` (open it at ui.perfetto.dev); return the path."""
        # Atomic: a viewer (or `dlperf trace`) never reads half a file.
        return atomic_write_text(path, json.dumps(self.to_chrome()))

    def summary(self) -> TraceSummary:
        return summarize(self.events)


MAX_TRACE_BYTES = 1 << 30
"""Largest trace file read (a long engine run writes tens of MB); bigger files are refused, not loaded."""
MAX_TIME_US = 1e15
"""Largest timestamp or duration accepted, in microseconds (about 31 years)."""
MAX_ARGS_DEPTH = 32
"""Deepest nesting accepted inside an event (engine traces nest two levels)."""
_ID_MAX = 2**63 - 1


def load_trace(path: str | Path) -> Trace:
    """Read a Chrome trace JSON written by :meth:`Trace.save` (or any with complete ``X`` events).

    torch.profiler traces (``export_chrome_trace``) read too: their workers are the CPU threads that
    ran operators and the GPU streams; the profiler's own span, ``record_function`` annotations
    (``ProfilerStep#N``) and Python stack tracks are left out (:data:`PROFILER_OWN_CATEGORIES`).
    Nested operators (``aten::linear`` around ``aten::addmm``) count once: busy time is the union
    of a track's intervals.

    Anything else (not JSON, no event list, malformed events, NaN, infinite, negative or absurd times,
    nesting deeper than any trace has, no operations at all) raises one
    :class:`~dlperf.errors.UsageError` that names the file and the problem.
    """
    path = Path(path)
    where = f"trace file {str(path)!r}"
    doc = _read_json(path, where)
    raw = doc.get("traceEvents") if isinstance(doc, dict) else doc  # object or JSON Array Format
    if not isinstance(raw, list):
        raise UsageError(f"{where} has no 'traceEvents' list")
    try:
        events = _parse_events(raw)
    except _BadEvent as exc:
        raise UsageError(f"{where} is not a valid Chrome trace: {exc}") from None
    if not events:
        own = any(isinstance(e, dict) and e.get("ph") == "X" for e in raw)
        raise UsageError(f"{where} has no operations (no complete 'X' events"
                         + (" other than the profiler's own spans and annotations)" if own else ")"))
    events.sort(key=lambda e: e.start_us)
    return Trace(events)


def _read_json(path: Path, where: str) -> Any:
    def refuse(_path: str, problem: str) -> UsageError:
        return UsageError(f"{where} is {problem}; give the trace's JSON file (at most {MAX_TRACE_BYTES} bytes: "
                          "trace a shorter run if it is larger)")

    try:
        data = read_bounded(path, MAX_TRACE_BYTES, refuse)
    except FileNotFoundError:
        raise UsageError(f"{where} does not exist; check the path") from None
    except OSError as exc:
        raise UsageError(f"{where} cannot be read ({exc.strerror or exc}); check the path and its permissions") \
            from None
    return decode_json(data, where, lambda w, why: UsageError(f"{w} is not Chrome trace JSON: {why}"),
                       allow_nan=False)


class _BadEvent(ValueError):
    pass


def _depth_ok(obj: Any, limit: int) -> bool:
    """True when ``obj`` nests at most ``limit`` containers deep (checked without recursion)."""
    stack = [(obj, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth >= limit:
                return False
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return True


def _number(ev: dict, key: str, i: int, default: float | None = None) -> float:
    value = ev.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _BadEvent(f"X event {i} has {key!r} {_short(value)}, expected a number of microseconds")
    value = float(value)
    if not 0.0 <= value <= MAX_TIME_US:  # also NaN and infinities (1e999 parses as inf)
        raise _BadEvent(f"X event {i} has {key!r} {value!r}, expected a number from 0 to {MAX_TIME_US:g}")
    return value


def _integer(value: Any, what: str, i: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _ID_MAX:
        raise _BadEvent(f"X event {i} has {what} {_short(value)}, expected an integer from 0 to {_ID_MAX}")
    return value


def _check_shapes(raw: list) -> None:
    for i, ev in enumerate(raw):
        if not isinstance(ev, dict):
            raise _BadEvent(f"event {i} is {type(ev).__name__} {_short(ev)}, expected an object")
        if not _depth_ok(ev, MAX_ARGS_DEPTH):
            raise _BadEvent(f"event {i} nests more than {MAX_ARGS_DEPTH} levels deep")
        if not isinstance(ev.get("args", {}), dict):
            raise _BadEvent(f"event {i} has 'args' {_short(ev['args'])}, expected an object")
        for k in ("pid", "tid"):
            if isinstance(ev.get(k), (list, dict)):
                raise _BadEvent(f"event {i} has {k!r} {_short(ev[k])}, expected a number or string")


# torch.profiler (Kineto) tracks that are not work: the profiler's own span ("PyTorch Profiler", in
# process "Spans"), record_function annotations (ProfilerStep#N among them) and the Python call stacks
# of with_stack=True. Each encloses operators already on their thread's track, so counting them would
# make that annotation a worker of its own and every thread look busy for the whole step.
PROFILER_OWN_CATEGORIES = frozenset({"Trace", "python_function", "user_annotation", "gpu_user_annotation"})
_PROFILER_OWN_PIDS = frozenset({"Spans", "Traces"})


def _is_profiler_own(ev: dict) -> bool:
    return ev.get("cat") in PROFILER_OWN_CATEGORIES or ev.get("pid") in _PROFILER_OWN_PIDS


def _track_names(raw: list) -> dict[tuple[Any, Any], str]:
    """Worker name per (pid, tid): the thread's name, under its process's name when it does not say it.

    Engine lanes are named ``cpu(0)/compute`` in process ``cpu(0)``; torch.profiler names CPU threads
    ``thread 123 (python)`` in process ``python`` and GPU streams ``stream 7`` in a process per device.
    """
    procs: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for ev in raw:
        if ev.get("ph") != "M":
            continue
        name = str((ev.get("args") or {}).get("name", "")).strip()[:200]
        if ev.get("name") == "process_name":
            procs[ev.get("pid")] = name
        elif ev.get("name") == "thread_name":
            threads[(ev.get("pid"), ev.get("tid"))] = name
    names = {}
    for (pid, tid), name in threads.items():
        proc = procs.get(pid, "")
        names[(pid, tid)] = f"{proc}/{name}" if proc and proc not in name else name
    return names


def _parse_events(raw: list) -> list[TraceEvent]:
    _check_shapes(raw)
    names = _track_names(raw)
    events = []
    for i, ev in enumerate(raw):
        if ev.get("ph") != "X" or _is_profiler_own(ev):
            continue
        args = ev.get("args") or {}
        if "ts" not in ev:
            raise _BadEvent(f"X event {i} has no 'ts': {_short(ev)}")
        start, dur = _number(ev, "ts", i), _number(ev, "dur", i, 0.0)
        if start + dur > MAX_TIME_US:
            raise _BadEvent(f"X event {i} ends at {start + dur!r} us, after {MAX_TIME_US:g}")
        op_id = _integer(args.get("id", 0) or 0, "args.id", i)
        deps = args.get("deps", ()) or ()
        if not isinstance(deps, list | tuple):
            raise _BadEvent(f"X event {i} has args.deps {_short(deps)}, expected a list of integers")
        key = (ev.get("pid"), ev.get("tid"))
        events.append(TraceEvent(id=op_id, name=str(ev.get("name", "")),
                                 worker=names.get(key, f"{key[0]}/{key[1]}"), start_us=start,
                                 end_us=start + dur, deps=tuple(_integer(d, "args.deps", i) for d in deps),
                                 failed=bool(args.get("failed", False))))
    return events


def _short(x: Any) -> str:
    try:
        text = json.dumps(x)
    except (ValueError, RecursionError):
        text = type(x).__name__
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class WorkerSummary:
    worker: str
    ops: int
    busy_us: float
    busy_fraction: float


@dataclass(frozen=True)
class TraceSummary:
    """Busy time per worker, and how much of the span two or more workers were busy at once."""

    span_us: float
    workers: list[WorkerSummary]
    overlap_us: float
    overlap_fraction: float
    parallelism: float
    failed: int

    def to_dict(self) -> dict[str, Any]:
        return {"span_us": self.span_us, "overlap_us": self.overlap_us,
                "overlap_fraction": self.overlap_fraction, "parallelism": self.parallelism,
                "failed": self.failed,
                "workers": [w.__dict__ for w in self.workers]}


def union_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as disjoint intervals in time order (touching ones merge).

    >>> union_intervals([(5, 8), (0, 2), (1, 3), (8, 9)])
    [(0, 3), (5, 9)]
    """
    merged: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _outermost(intervals: list[tuple[float, float]]) -> int:
    """How many intervals no other interval of the same track encloses (a profiler's aten::addmm
    inside aten::linear is one operation, not two)."""
    count, end = 0, float("-inf")
    for s, e in sorted(intervals, key=lambda x: (x[0], -x[1])):
        if s < end and e <= end:
            continue
        count += 1
        end = max(end, e)
    return count


def summarize(events: list[TraceEvent]) -> TraceSummary:
    """Busy % per worker over the whole span, overlap (>= 2 workers busy) and mean parallelism.

    A worker's ``ops`` are its outermost operations, and its busy time is the union of its
    intervals, so nested events (a profiler's operator calls) count once.

    >>> ev = [TraceEvent(1, "a", "cpu(0)/compute", 0, 10), TraceEvent(2, "b", "cpu(1)/compute", 5, 10)]
    >>> s = summarize(ev)
    >>> s.overlap_fraction, s.parallelism
    (0.5, 1.5)
    """
    if not events:
        return TraceSummary(0.0, [], 0.0, 0.0, 0.0, 0)
    t0 = min(e.start_us for e in events)
    span = max(e.end_us for e in events) - t0
    by_worker: dict[str, list[TraceEvent]] = {}
    for e in events:
        by_worker.setdefault(e.worker, []).append(e)
    workers, edges = [], []
    for name in sorted(by_worker):
        intervals = [(e.start_us, e.end_us) for e in by_worker[name]]
        merged = union_intervals(intervals)
        busy = sum(end - start for start, end in merged)
        workers.append(WorkerSummary(name, _outermost(intervals), busy, busy / span if span > 0 else 0.0))
        for start, end in merged:
            edges += [(start, 1), (end, -1)]
    edges.sort(key=lambda x: (x[0], x[1]))  # ends before starts at equal times: touching is not overlap
    overlap, active, prev = 0.0, 0, t0
    for t, d in edges:
        if active >= 2:
            overlap += t - prev
        active += d
        prev = t
    total_busy = sum(w.busy_us for w in workers)
    return TraceSummary(span, workers, overlap, overlap / span if span > 0 else 0.0,
                        total_busy / span if span > 0 else 0.0, sum(e.failed for e in events))


def format_summary(s: TraceSummary) -> str:
    """Fixed-width text table of a :class:`TraceSummary`."""
    lines = [f"{'worker':<24} {'ops':>8} {'busy ms':>10} {'busy %':>7}"]
    for w in s.workers:
        lines.append(f"{w.worker:<24} {w.ops:>8d} {w.busy_us / 1e3:>10.3f} {100 * w.busy_fraction:>6.1f}%")
    lines.append(f"span {s.span_us / 1e3:.3f} ms; >=2 workers busy {s.overlap_us / 1e3:.3f} ms "
                 f"({100 * s.overlap_fraction:.1f}%); mean parallelism {s.parallelism:.2f}"
                 + (f"; {s.failed} failed ops" if s.failed else ""))
    return "\n".join(lines)

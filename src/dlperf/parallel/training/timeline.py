"""How much of a training run's communication hid behind backward, read from an engine timeline.

The Trainer names its operations ``fwd+bwd <device>``, ``allreduce bucket <b> phase <p>``,
``kvstore pushpull <key>`` and ``<optimizer> <device>``; this module groups them by those names.

>>> from dlperf.engine.trace import Trace, TraceEvent
>>> t = Trace([TraceEvent(1, "fwd+bwd cpu(0)", "cpu(0)/compute", 0, 10),
...            TraceEvent(2, "allreduce bucket 0 phase 1", "cpu(2)/compute", 6, 12)])
>>> s = comm_overlap(t)
>>> s["comm_us"], s["overlap_us"], round(s["overlap_fraction"], 3)
(6.0, 4.0, 0.667)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._io import atomic_write_text
from ...engine.trace import Trace, union_intervals

if TYPE_CHECKING:
    from ..communication.process_group import ExchangeReport

__all__ = ["comm_overlap", "COMM_PREFIXES", "COMPUTE_PREFIX", "EXCHANGES_PROCESS", "exchange_events", "save_trace"]

COMPUTE_PREFIX = "fwd+bwd "
COMM_PREFIXES = ("allreduce bucket ", "kvstore ")


def _length(spans: list[tuple[float, float]]) -> float:
    return float(sum(b - a for a, b in spans))


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if hi > lo:
            total += hi - lo
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def comm_overlap(trace: Trace) -> dict[str, Any]:
    """Time some communication ran, time some forward/backward ran, and how much of the first overlapped the second.

    ``overlap_fraction`` is the share of communication time hidden behind forward/backward (0 when there
    was no communication).
    """
    compute = union_intervals([(e.start_us, e.end_us) for e in trace.events if e.name.startswith(COMPUTE_PREFIX)])
    comm = union_intervals([(e.start_us, e.end_us) for e in trace.events if e.name.startswith(COMM_PREFIXES)])
    comm_us, overlap = _length(comm), _intersect(compute, comm)
    return {"compute_us": _length(compute), "comm_us": comm_us, "overlap_us": overlap,
            "overlap_fraction": overlap / comm_us if comm_us > 0 else 0.0}


EXCHANGES_PROCESS = "exchanges across processes"
"""The Chrome trace process that carries a run's exchange report: one track per rank, the straggler line."""


def exchange_events(report: ExchangeReport, at_us: float, pid: int) -> list[dict[str, Any]]:
    """Chrome trace events for a run's exchange report, as process ``pid`` at time ``at_us`` (the run's end).

    Instant events, not operations: ``dlperf trace`` summaries and overlap figures read ``X`` events
    only, so the report shows in a viewer (one track per rank, with its seconds in exchanges, its wait
    on the others and its write to the store) without counting as work.
    """
    figures = report.as_dict()
    out: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                                  "args": {"name": EXCHANGES_PROCESS}}]
    for tid, row in enumerate(figures["ranks"], 1):
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": {"name": f"rank {row['rank']} on {row['host']}"}})
        out.append({"ph": "i", "s": "t", "name": f"rank {row['rank']}: {row['exchange_s']:.3f} s in "
                                                 f"{row['exchanges']} exchanges, waited {row['wait_s']:.3f} s",
                    "cat": "exchanges", "pid": pid, "tid": tid, "ts": round(at_us, 3), "args": row})
    out.append({"ph": "i", "s": "g", "name": report.describe(), "cat": "exchanges", "pid": pid, "tid": 0,
                "ts": round(at_us, 3), "args": {"straggler": figures["straggler"]}})
    return out


def save_trace(trace: Trace, path: str | Path, report: ExchangeReport | None = None) -> Path:
    """Write ``trace`` as Chrome trace JSON to ``path``; with ``report``, the run's exchanges and straggler in it too.

    The report goes in twice: as events (:func:`exchange_events`, for a viewer) and as the document's
    ``metadata.exchanges`` (the ``--json`` form, for a script).
    """
    doc = trace.to_chrome()
    if report is not None and report.rows:
        pids = [e["pid"] for e in doc["traceEvents"] if isinstance(e.get("pid"), int)]
        end = max((e.end_us for e in trace.events), default=0.0)
        doc["traceEvents"] += exchange_events(report, end, max(pids, default=0) + 1)
        doc["metadata"] = {"exchanges": report.as_dict(), "straggler": report.describe()}
    return atomic_write_text(path, json.dumps(doc))

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

from typing import Any

from ..engine.trace import Trace, union_intervals

__all__ = ["comm_overlap", "COMM_PREFIXES", "COMPUTE_PREFIX"]

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

"""What one engine operation may run besides a single function: batches of operations and records.

* A **record** is one elementwise array operation as a tuple ``(runner, function, inputs...,
  output)``; :func:`run_rec` runs one pushed alone.
* An **automatic batch** (:class:`AutoBatch`) is one thread's records collected for one worker and
  run by :func:`run_auto` as one operation (``EngineConfig.auto_bulk``).
* A **bulk batch** is the operations an ``Engine.bulk()`` block collected, run by :func:`run_bulk`.

Workers and engines both need these (to run them, and to count their members); they depend on
nothing but :mod:`dlperf.engine.var`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..devices import Device
from .var import DONE, Op, Var

__all__ = ["AutoBatch", "RECORD_GROUPS", "run_auto", "run_auto_checked", "run_bulk", "run_rec", "members"]


def run_rec(rec: tuple) -> None:
    """Run one array operation record: ``rec[0]`` is the function, the whole record its argument."""
    rec[0](rec)


class AutoBatch:
    """One thread's records collected for one worker, not yet sent (see ThreadedEngine._push_rec).

    Only the owning thread appends, without a lock: a thread that sends the batch seals it and
    takes the records appended so far (under ``lock``); the owner looks at ``sealed`` after each
    append and pushes a record the sender did not take again (see ``ThreadedEngine._appended``).
    """

    __slots__ = ("op", "recs", "run", "reads", "outs", "sent_outs", "device", "worker", "lock", "sealed", "seen")

    def __init__(self, op: Op, device: Device, worker: Any) -> None:
        self.recs: list[tuple] = []  # (runner, function, inputs..., output array)
        self.run: list[tuple] = []   # the records taken when it was sealed: what runs
        self.op = op  # runs run_auto(self)
        op.args = (self,)
        self.reads: dict[Var, None] = {}  # a dict: ordered, O(1) membership
        self.outs: list[Var] = []  # each record's output variable, appended just before the record
        self.sent_outs: list[Var] = []  # those of the records taken when it was sealed
        self.device = device
        self.worker = worker
        self.lock = threading.Lock()
        self.sealed = False
        self.seen = -1  # its size when its worker last looked (see ThreadedEngine.send_auto_for)


RECORD_GROUPS: dict[Callable[[tuple], None], Callable[[list[tuple], int], int]] = {}
"""Record runner -> a function ``group(recs, i)`` that runs ``recs[i]`` together with the records
after it that it can take in one call (say, one multi-tensor ``torch._foreach_*``): it returns the
index after the last one it ran, or ``-j`` when it ran none and ``recs[i:j]`` must run one by one
(their joint call failed: each record's own call then tells which one fails, and how)."""


def run_auto(batch: AutoBatch) -> None:
    """Run an automatic batch's records in push order (dependencies inside it hold trivially).

    Consecutive records a group runner can take (see RECORD_GROUPS) run in one call. A failing
    record fails only its own result and the later records that use it, as if each had been
    pushed alone: independent work in the same batch is not lost.
    """
    recs = batch.run
    n = len(recs)
    i = alone_until = 0
    groups = RECORD_GROUPS
    try:
        while i < n:
            rec = recs[i]
            if i >= alone_until and (group := groups.get(rec[0])) is not None:
                j = group(recs, i)
                if j > 0:
                    i = j
                    continue
                alone_until = -j
            rec[0](rec)
            i += 1
    except BaseException as exc:
        _fail_record(batch, rec, exc)
        run_auto_checked(batch, recs[i + 1:])


def run_auto_checked(batch: AutoBatch, recs: list[tuple]) -> None:
    """Run records one by one, skipping those whose inputs failed (they inherit the error)."""
    for rec in recs:
        upstream = None
        for item in rec[2:-1]:  # (runner, function, inputs..., output)
            var = getattr(item, "_var", None)
            if var is not None and var.exc is not None:
                upstream = var.exc
                break
        if upstream is not None:
            rec[-1]._var.exc = upstream
            continue
        try:
            rec[0](rec)
        except BaseException as exc:
            _fail_record(batch, rec, exc)


def _fail_record(batch: AutoBatch, rec: tuple, exc: BaseException) -> None:
    rec[-1]._var.exc = exc
    batch.op.engine._note_error(exc)


def run_bulk(ops: list[Op]) -> None:
    """Run a bulk() batch's operations in one worker call (see Engine.bulk)."""
    # Runs in one worker call, in push order, so dependencies inside the batch hold trivially.
    # The first failure stops the batch: later members may depend on what it should have written.
    for i, op in enumerate(ops):
        try:
            op.result = op.fn(*op.args)
        except BaseException as exc:
            for rest in ops[i:]:
                rest.exc = exc
                rest.state = DONE
            raise
        op.state = DONE


def members(op: Op) -> int:
    """How many pushed operations ``op`` runs: a batch's members (so each is judged small or long)."""
    fn = op.fn
    if fn is run_auto:
        return len(op.args[0].run)
    if fn is run_bulk:
        return len(op.args[0])
    return 1

"""Wait-for graph: find the waits inside pushed functions that could never return.

A pushed function may itself wait (``wait_to_read``, ``Op.wait``, ``wait_to_write``). While it
waits, the thread running it is blocked, and so is everything that thread would run next: the
operations queued behind it on its worker, and every operation ordered after it on one of its
variables. If what it waits for is among those, directly or through other blocked threads, no
thread can make progress: a deadlock.

The engine records each thread that blocks while running an operation (a :class:`Waiter`) and,
under its lock, asks :func:`find_cycle` whether this wait closes a cycle. The search spreads
"cannot finish" from the new waiter's operations:

* the operations a blocked thread runs (the worker's current one, plus any it runs inline);
* if that thread is a worker: the rest of its batch and its queued operations, and any pending
  operation that must run on that worker;
* through variables: everything queued on a variable after an operation that cannot finish;
* through other blocked threads: a thread waiting for something that cannot finish is stuck too.

Every edge is a real ordering constraint, so a reported cycle is a deadlock. The search only sees
pending operations that are queued somewhere; one still waiting on a variable whose holder is
making progress joins later, which is why waiters also re-check periodically.
"""

from __future__ import annotations

from typing import Any

from .var import DONE, PENDING, Op, Var

__all__ = ["Waiter", "find_cycle", "describe_op", "var_label"]


class Waiter:
    """A thread blocked in an engine wait while it runs operations (recorded under the engine lock)."""

    __slots__ = ("ops", "worker", "target", "var")

    def __init__(self, ops: list[Op], worker: Any, target: Op, var: Var | None) -> None:
        self.ops = ops          # operations the thread is running, outermost first
        self.worker = worker    # the Worker whose thread this is, or None
        self.target = target    # what it waits for
        self.var = var          # the variable it waits to read or write, if any


def var_label(v: Var) -> str:
    return repr(v.name) if v.name else f"<unnamed {hex(id(v))}>"


def describe_op(op: Op) -> str:
    """``op 'name' (where it runs)`` for messages."""
    label = op.name or getattr(op.fn, "__name__", "op")
    w = op.worker
    if w is None:
        where = "held in another thread's open bulk() block"
    elif isinstance(w, Op):
        where = f"in batch {w.name!r}"
    else:
        where = getattr(w, "label", None) or str(w)
    return f"op {label!r} ({where})"


def _wait_how(waiter: Waiter) -> str:
    if waiter.var is not None:
        return f"waits for var {var_label(waiter.var)}, written by"
    return "waits for"


class _Graph:
    def __init__(self, blocked: list[Waiter]) -> None:
        self.blocked = blocked
        self.why: dict[Op, tuple[Op | None, str]] = {}  # op -> (what it cannot finish before, how)
        self.stuck: set[int] = set()
        self.stuck_workers: dict[Any, Waiter] = {}
        self.frontier: list[Op] = []
        self.var_start: dict[Var, int] = {}
        self.entries: dict[Var, list] = {}
        self.positions: dict[Var, dict[int, int]] = {}

    def doom(self, op: Op, cause: Op | None, how: str) -> None:
        if op.state != DONE and op not in self.why:
            self.why[op] = (cause, how)
            self.frontier.append(op)

    def stick(self, waiter: Waiter, cause: Op | None) -> None:
        """``waiter``'s thread cannot return from its wait: nothing it would run can finish."""
        self.stuck.add(id(waiter))
        ops = waiter.ops
        self.doom(ops[-1], cause, _wait_how(waiter))
        for outer, inner in zip(ops[:-1], ops[1:]):
            self.doom(outer, inner, "waits for, running it inline,")
        w = waiter.worker
        if w is not None:
            self.stuck_workers[w] = waiter
            how = f"is queued on {w.label} behind"
            for op in w.stuck_ops():
                self.doom(op, ops[0], how)

    def resolve(self, op: Op) -> Op | None:
        """What really has to finish for a wait on ``op`` to return (None: cannot tell)."""
        if op.state == DONE:
            return None
        w = op.worker
        if isinstance(w, Op):  # a member of a sent batch: the batch runs it
            return None if w.state == DONE else w
        if w is None:  # in another thread's open bulk(): that thread is not waiting (waits flush)
            return None
        return op

    def doomed(self, op: Op) -> bool:
        if op in self.why:
            return True
        waiter = self.stuck_workers.get(op.worker) if op.state == PENDING else None
        if waiter is not None:  # must run on a worker whose thread is stuck
            self.doom(op, waiter.ops[0], f"must run on {waiter.worker.label}, which is busy with")
            return True
        return False

    def spread(self) -> None:
        while self.frontier:
            op = self.frontier.pop()
            for v in op.reads:
                self.after(v, op, False)
            for v in op.writes:
                self.after(v, op, True)

    def after(self, v: Var, op: Op, is_write: bool) -> None:
        """Doom everything queued on ``v`` that has to wait for ``op``."""
        if not v._queue:
            return
        entries = self.entries.get(v)
        if entries is None:
            entries = self.entries[v] = list(v._queue)
            self.positions[v] = {id(o): i for i, (o, _) in enumerate(entries)}
        start = self.positions[v].get(id(op), -1) + 1  # -1: op holds v, everything queued follows it
        if not is_write:  # reads queued right behind a read do not wait for it
            while start < len(entries) and not entries[start][1]:
                start += 1
        # Everything after a position waits for whatever is at it, so a later start adds nothing.
        stop = self.var_start.get(v, len(entries))
        if start >= stop:
            return
        self.var_start[v] = start
        how = f"needs var {var_label(v)} after"
        for o, _ in entries[start:stop]:
            self.doom(o, op, how)

    def target_doomed(self, me: Waiter) -> bool:
        target = self.resolve(me.target)
        return target is not None and self.doomed(target)

    def run(self, me: Waiter) -> bool:
        self.stick(me, None)
        while True:
            self.spread()
            if self.target_doomed(me):
                return True
            progressed = False
            for waiter in self.blocked:
                if id(waiter) in self.stuck:
                    continue
                target = self.resolve(waiter.target)
                if target is not None and self.doomed(target):
                    self.stick(waiter, target)
                    progressed = True
            if not progressed:
                return False

    def describe(self, me: Waiter) -> str:
        steps = [f"{describe_op(me.ops[-1])} {_wait_how(me)} {describe_op(me.target)}"]
        op: Op | None = me.target
        seen = set()
        while op is not None and op not in seen:
            seen.add(op)
            cause, how = self.why.get(op) or ((op.worker, "is in") if isinstance(op.worker, Op) else (None, ""))
            if cause is None:
                break
            steps.append(f"{describe_op(op)} {how} {describe_op(cause)}")
            op = cause
        return "; ".join(steps)


def find_cycle(me: Waiter, blocked: list[Waiter]) -> str | None:
    """The cycle ``me``'s wait would close, as text (None: the wait can return).

    Call with the engine's scheduling state unchanging (its lock held); ``blocked`` lists the
    other threads that wait while running operations.
    """
    graph = _Graph([w for w in blocked if w is not me])
    if not graph.run(me):
        return None
    return graph.describe(me)

"""Bound the work in flight: at most ``k`` mini-batches pushed but not finished (d2l §12.2.4).

A frontend that only pushes can run far ahead of the workers; every queued mini-batch holds its
inputs and intermediates, so memory grows with the lead. Waiting on every batch (``k=1``) keeps
memory flat but leaves the frontend idle while the backend runs. ``k=2`` overlaps one mini-batch:
batch ``t`` has finished before batch ``t + 2`` is issued (the section's exercise 2).

Example:
    >>> from dlperf.engine import create_engine
    >>> with create_engine() as eng:
    ...     window = InFlight(2, engine=eng)
    ...     v = eng.new_var("params")
    ...     for step in range(5):
    ...         window.submit(eng.push(lambda: None, writes=[v]))
    ...     window.drain()
    ...     window.max_seen
    2
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from .arguments import EngineArgumentError, as_var, check_callable, check_count
from .engine import Engine, default_engine
from .var import Op, Var

__all__ = ["InFlight", "bounded"]

T = TypeVar("T")


class InFlight:
    """A window of at most ``k`` unfinished mini-batches; each is marked by what ends it.

    A marker is an :class:`Op` handle, a :class:`Var`, or an engine array (e.g. the loss).
    """

    def __init__(self, k: int, engine: Engine | None = None) -> None:
        self.k = check_count("InFlight", "k", k)
        if engine is not None and not isinstance(engine, Engine):
            raise EngineArgumentError(f"InFlight: engine is {type(engine).__name__}; expected an Engine "
                                      "(create_engine()) or None for the default one")
        self.engine = engine if engine is not None else default_engine()
        self._pending: deque[Any] = deque()
        self.max_seen = 0
        """Most mini-batches that were in flight at once."""

    def _done(self, marker: Any) -> bool:
        if isinstance(marker, Op):
            return marker.done
        var = marker if isinstance(marker, Var) else marker._var
        op = var._last_write
        return op is None or op.done

    def _wait(self, marker: Any) -> None:
        if isinstance(marker, Op):
            marker.wait()
        else:
            self.engine.wait_to_read(marker)

    def submit(self, marker: Any) -> None:
        """Record one more mini-batch; block until at most ``k - 1`` earlier ones are unfinished."""
        if not isinstance(marker, Op):
            as_var("InFlight.submit", "marker", marker)  # an Op, a Var or an engine array; else the error
        while self._pending and self._done(self._pending[0]):
            self._wait(self._pending.popleft())  # already done: raises its error if it failed
        self._pending.append(marker)
        self.max_seen = max(self.max_seen, len(self._pending))
        while len(self._pending) >= self.k:
            self._wait(self._pending.popleft())

    def drain(self) -> None:
        """Wait for every recorded mini-batch."""
        while self._pending:
            self._wait(self._pending.popleft())


def bounded(batches: Iterable[T], step: Callable[[T], Any], k: int, engine: Engine | None = None) -> Iterator[Any]:
    """Run ``step(batch)`` for each batch, keeping at most ``k`` of them in flight; yield each marker.

    ``step`` pushes the mini-batch's work and returns its marker (an Op, Var or engine array).

    >>> from dlperf.engine import create_engine
    >>> with create_engine() as eng:
    ...     v, out = eng.new_var(), []
    ...     markers = list(bounded(range(4), lambda b: eng.push(out.append, args=(b,), writes=[v]), 1, eng))
    ...     out
    [0, 1, 2, 3]
    """
    check_callable("bounded", "step", step, "bounded(batches, lambda b: eng.push(...), 2)")
    window = InFlight(k, engine)
    for batch in batches:
        marker = step(batch)
        window.submit(marker)
        yield marker
    window.drain()

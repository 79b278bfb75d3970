"""What the planner is asked and what it answers: its options, a candidate made ready to time, each candidate's
measurements round by round, and the decision with everything it measured."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...decide import MIN_GAIN
from ...errors import UsageError
from .plan import EXECUTIONS, Plan

__all__ = ["PlannerOptions", "CandidateRun", "Measurement", "PlanDecision"]


@dataclass
class PlannerOptions:
    """How hard the planner looks; every field is checked when made."""

    budget_s: float | None = None
    """Seconds planning may take (None: 10% of the run when ``run_steps`` is given, at most 30 s)."""
    run_steps: int | None = None
    """Steps the run will take, when known: sets the budget and lets compiled executions be weighed."""
    steps: int = 3
    """Timed steps per candidate per round."""
    warmup: int = 1
    """Untimed steps per candidate before its first round (first allocations, compilation)."""
    rounds: int = 3
    """Alternating rounds; each candidate's least disturbed round counts."""
    keep: int = 8
    """At most this many candidates are measured after pricing (the reference always is)."""
    allow_mixed_precision: bool = False
    """Consider bf16/fp16 plans, which change the numerics (GPUs only)."""
    executions: Sequence[str] | None = None
    """Executions to consider (None: every registered one available here)."""
    strategies: Sequence[str] | None = None
    """Gradient synchronization strategies to measure on plans of several replicas, by name, besides the one the
    options imply (None: every registered strategy marked ``planned`` that can run there)."""
    cores: int | None = None
    """CPU cores the replicas' threads may fill (None: those this process may run on)."""
    use_cache: bool = True
    """Return a cached decision without measuring, and record new ones."""
    replan: bool = False
    """Measure again even where a decision is cached (and record the new one)."""
    cache_path: str | None = None
    """Where decisions are cached (None: ``$XDG_CACHE_HOME/dlperf/plans.json``)."""

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("warmup", 0), ("rounds", 1), ("keep", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 1000:
                raise UsageError(f"planner {name}={value!r}: expected an integer from {low} to 1000")
        if self.budget_s is not None and (isinstance(self.budget_s, bool) or not isinstance(self.budget_s, (int, float))
                                          or not 0 < self.budget_s <= 3600):
            raise UsageError(f"planner budget_s={self.budget_s!r}: expected seconds in (0, 3600]")
        for name in ("run_steps", "cores"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UsageError(f"planner {name}={value!r}: expected an integer >= 1 (or None)")
        for name in self.executions or ():
            EXECUTIONS.get(name)  # a miss lists what exists
        from ..strategies import STRATEGIES

        for name in self.strategies or ():
            STRATEGIES.get(name)


@dataclass
class CandidateRun:
    """A plan made ready to time: ``step()`` runs one training step, ``close()`` frees it."""

    step: Callable[[], object]
    close: Callable[[], None]
    threads: int = 1
    """Threads a step keeps busy (the contention check compares the machine's load against it)."""
    synchronize: Callable[[], None] = lambda: None
    declined: Callable[[], str | None] = lambda: None
    """After its first step: why the run does not do what its plan says (a captured step that serves the eager
    one), or None. A declined candidate is dropped, so a plan is never chosen for another plan's speed."""


@dataclass
class Measurement:
    """One candidate: its floor, each round's median ms per step, and why it was not measured, if so."""

    plan: Plan
    floor_ms: float | None = None
    by_round: dict[int, float] = field(default_factory=dict)
    """Median ms per step in each round it was timed in (rounds count from 0)."""
    first_step_ms: float | None = None
    setup_s: float | None = None
    """For an execution with a one-off setup: seconds its build and first step took beyond a steady step."""
    contended: bool = False
    contended_rounds: set[int] = field(default_factory=set)
    """The rounds in which its timing was marked contended."""
    note: str = ""

    def record(self, index: int, ms: float, contended: bool) -> None:
        """Round ``index``'s median, and whether its timing was contended."""
        self.by_round[index] = ms
        self.contended |= contended
        if contended:
            self.contended_rounds.add(index)

    @property
    def rounds_ms(self) -> list[float]:
        return list(self.by_round.values())

    @property
    def ms(self) -> float | None:
        """The least disturbed round's median (another process only ever slows a round down)."""
        return min(self.by_round.values()) if self.by_round else None

    def ratios(self, other: Measurement) -> list[float]:
        """This candidate's time over ``other``'s in each round both were timed in: side by side, so a
        change in the machine's load between rounds moves both."""
        return [ms / other.by_round[i] for i, ms in self.by_round.items() if i in other.by_round]


@dataclass
class PlanDecision:
    """The chosen plan (with its figures), the reference it had to beat, and everything measured."""

    plan: Plan
    reference: Plan
    measurements: list[Measurement] = field(default_factory=list)
    planning_s: float = 0.0
    cached: bool = False
    skipped: list[str] = field(default_factory=list)
    noise: float = MIN_GAIN
    contended: bool = False
    faster_with_processes: str | None = None
    """Where plans whose replicas are processes could not be measured: a line naming the faster such plan
    decided for this model before (by a caller that could start processes) and how to get it, else None."""
    cached_from: float | None = None
    """When a cached decision was measured (``time.time()``)."""

    def table(self) -> str:
        """Every candidate, its floor and rounds, for people (``plan.describe()`` has the choice)."""
        rows = [f"{'plan':<40} {'floor ms':>9} {'ms/step':>9}  rounds / note"]
        for m in self.measurements:
            mark = "*" if m.plan == self.plan else " "
            floor = f"{m.floor_ms:9.2f}" if m.floor_ms is not None else f"{'-':>9}"
            ms = f"{m.ms:9.2f}" if m.ms is not None else f"{'-':>9}"
            rounds = " ".join(f"{r:.2f}" for r in m.rounds_ms)
            rows.append(f"{mark}{m.plan.name:<39} {floor} {ms}  {rounds}{' ' + m.note if m.note else ''}")
        state = "cached" if self.cached else f"{self.planning_s:.1f} s"
        rows.append(f"planning: {state}; noise {self.noise:.0%}{'; CONTENDED' if self.contended else ''}")
        rows += [f"skipped: {s}" for s in self.skipped]
        return "\n".join(rows)

    def provenance(self) -> str:
        """Where the plan comes from, for the line a run prints with it: ``planned now in 4.2 s`` (``, contended``
        when other work disturbed its rounds: used for this run only) or ``cached from 2026-12-07 21:40``."""
        if self.cached:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.cached_from)) if self.cached_from else "before"
            return f"cached from {when}"
        return f"planned now in {self.planning_s:.1f} s" + (", contended: this run only" if self.contended else "")

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.name, "reference": self.reference.name, "measured_ms": self.plan.measured_ms,
                "planning_s": self.planning_s, "cached": self.cached, "noise": self.noise,
                "contended": self.contended, "skipped": list(self.skipped),
                "candidates": {m.plan.name: {"ms": m.ms, "rounds_ms": m.rounds_ms, "floor_ms": m.floor_ms,
                                             "note": m.note} for m in self.measurements}}

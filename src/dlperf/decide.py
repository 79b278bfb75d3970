"""dlperf's one decider: time candidates side by side and keep a faster one only when it is faster beyond noise.

Every choice dlperf makes by measuring (the planner's plans, ``bench --mode auto``'s variants, hybridize's
backend, ``train_step``'s replay) goes through :func:`judge`, and those that time their candidates themselves
through :func:`decide`, so one rule decides them all:

1. **Alternating rounds.** Each round times every candidate once (:func:`dlperf.timing.time_steps`), in an
   order that rotates between rounds, so a change of the machine's load between rounds moves every candidate;
   a candidate is compared with the reference (the choice made without measuring) round by round, as ratios.
2. **Beyond noise, in every round.** A candidate counts only if it was faster than the reference by at least
   ``min_gain`` in every round both ran, and its median ratio is below 1 by more than its margin: half the range
   of its ratios, at least ``min_gain``, and :data:`FEW_ROUNDS_GAIN` when it shared fewer than :data:`FEW_ROUNDS`
   rounds with the reference (one lucky round proves nothing). Among those the lowest median ratio wins, a
   candidate of too few shared rounds counted :data:`FEW_ROUNDS_GAIN` slower.
3. **Contention.** A round the timer marked contended (another process took our cores) is left out of the
   ratios while uncontended rounds exist; a verdict whose rounds were all contended says so
   (:attr:`Verdict.contended`), and its caller neither presents it as a gain nor keeps it for later runs.

>>> v = judge({"eager": [10.0, 10.2, 10.1], "fast": [7.0, 7.1, 7.2], "noise": [9.9, 10.3, 9.8]}, "eager")
>>> v.chosen, round(v.ratio, 2), v.contended
('fast', 0.7, False)
>>> judge({"eager": [10.0, 10.0], "lucky": [5.0, 10.5]}, "eager").chosen
'eager'
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .timing import time_steps

__all__ = ["MIN_GAIN", "FEW_ROUNDS", "FEW_ROUNDS_GAIN", "Candidate", "Verdict", "judge", "decide", "margin", "rank"]

MIN_GAIN = 0.03
"""A candidate must beat the reference by at least this fraction in every shared round."""
FEW_ROUNDS = 2
"""Shared rounds with the reference below which a candidate's ratios have no spread to judge noise by."""
FEW_ROUNDS_GAIN = 0.10
"""The margin a candidate sharing fewer than :data:`FEW_ROUNDS` rounds with the reference must beat it by."""

Rounds = Sequence[float | None]
"""Seconds (or ms) per step of one candidate, one entry per round (None: not timed in that round)."""


def _ratios(rounds: Rounds, reference: Rounds, contended: Sequence[bool]) -> list[float]:
    shared = [(c, r, bad) for c, r, bad in zip(rounds, reference, contended) if c is not None and r]
    clean = [(c, r) for c, r, bad in shared if not bad]
    return [c / r for c, r in (clean or [(c, r) for c, r, _ in shared])]


def margin(ratios: Sequence[float], min_gain: float = MIN_GAIN) -> float:
    """The margin a candidate's median ratio must clear: half the range of its ratios (how far they moved from
    round to round), at least ``min_gain``; :data:`FEW_ROUNDS_GAIN` with fewer than :data:`FEW_ROUNDS` of them."""
    if len(ratios) < FEW_ROUNDS:
        return max(FEW_ROUNDS_GAIN, min_gain)
    return max(min_gain, (max(ratios) - min(ratios)) / 2)


def rank(ratios: Sequence[float]) -> float:
    """What candidates are ranked by: the median ratio, counted :data:`FEW_ROUNDS_GAIN` slower with fewer than
    :data:`FEW_ROUNDS` ratios (it displaces one timed in more rounds only when clearly faster)."""
    return statistics.median(ratios) + (FEW_ROUNDS_GAIN if len(ratios) < FEW_ROUNDS else 0.0)


@dataclass
class Verdict:
    """What :func:`judge` decided: the chosen candidate and the figures it was chosen on."""

    chosen: str
    reference: str
    ratio: float = 1.0
    """The chosen one's median ratio to the reference (1.0 when the reference stays)."""
    margin: float = MIN_GAIN
    shared_rounds: int = 0
    contended: bool = False
    """Every round that decided was contended: the verdict is this run's only and is not a measured gain."""
    best_s: dict[str, float] = field(default_factory=dict)
    """Each candidate's least disturbed round (what a report puts beside its name)."""
    ratios: dict[str, list[float]] = field(default_factory=dict)
    reason: str = ""

    def ranking(self) -> list[str]:
        """The candidates fastest first, by the figures in :attr:`best_s` (the order a report prints)."""
        return sorted(self.best_s, key=lambda n: self.best_s[n])


def judge(rounds: Mapping[str, Rounds], reference: str, *, contended: Sequence[bool] = (),
          min_gain: float = MIN_GAIN, eligible: Callable[[str], str | None] | None = None) -> Verdict:
    """Choose among timed candidates by the module's rule.

    Args:
        rounds: candidate name -> its time per step in each round (None where it was not timed).
        reference: the name of the choice made without measuring; it stays unless beaten.
        contended: per round, whether the timer marked it contended (missing: not contended).
        eligible: a last say on a candidate that passed the rule (its setup does not pay, say): the reason it
            may not be chosen, or None.
    """
    ref = list(rounds[reference])
    n = max((len(r) for r in rounds.values()), default=0)
    marks = [bool(contended[i]) if i < len(contended) else False for i in range(n)]
    decisive = [i for i, r in enumerate(ref) if r is not None]
    all_contended = bool(decisive) and all(marks[i] for i in decisive)
    best = {name: min(v for v in r if v is not None) for name, r in rounds.items() if any(v is not None for v in r)}
    ratios = {name: _ratios(r, ref, marks) for name, r in rounds.items() if name != reference}
    passed: list[tuple[float, str]] = []
    notes: list[str] = []
    for name, rs in ratios.items():
        if not rs:
            continue
        med, need = statistics.median(rs), margin(rs, min_gain)
        if max(rs) < 1 - min_gain and med + need < 1:
            why = eligible(name) if eligible is not None else None
            if why:
                notes.append(why)
                continue
            passed.append((rank(rs), name))
    verdict = Verdict(reference, reference, contended=all_contended, best_s=best, ratios=ratios)
    if passed:
        _, name = min(passed)
        rs = ratios[name]
        verdict.chosen, verdict.ratio, verdict.margin, verdict.shared_rounds = \
            name, statistics.median(rs), margin(rs, min_gain), len(rs)
        verdict.reason = (f"{name}: {verdict.ratio:.2f}x {reference}'s time over {len(rs)} shared round"
                          f"{'s' * (len(rs) > 1)}, faster by {min_gain:.0%} or more in each, beyond its margin "
                          f"({verdict.margin:.0%})")
    else:
        closest = min(ratios, key=lambda k: statistics.median(ratios[k]) if ratios[k] else 9e9, default=None)
        if closest is not None and ratios[closest]:
            verdict.margin = margin(ratios[closest], min_gain)
        verdict.reason = (f"{reference} kept: nothing beat it in every round by more than its margin ({min_gain:.0%} "
                          f"or the rounds' spread; {FEW_ROUNDS_GAIN:.0%} with fewer than {FEW_ROUNDS} shared rounds)")
    if notes:
        verdict.reason += "; " + "; ".join(notes)
    if all_contended:
        verdict.reason += "; every round was contended: decided for this run only"
    return verdict


@dataclass
class Candidate:
    """One way to run a step, ready to time: ``step()`` runs one; ``synchronize()`` waits for a device."""

    name: str
    step: Callable[[], object]
    synchronize: Callable[[], None] = lambda: None
    threads: int = 1
    """Threads a step keeps busy (the contention check compares the machine's load against it)."""


def decide(candidates: Sequence[Candidate], reference: str | None = None, *, rounds: int = 3, steps: int = 3,
           warmup: int = 1, max_seconds: float | None = None, min_gain: float = MIN_GAIN,
           eligible: Callable[[str], str | None] | None = None) -> Verdict:
    """Time ``candidates`` in alternating rounds and :func:`judge` them (``reference``: the first by default).

    Each candidate is warmed up once before its first round; a round's order rotates so no candidate always
    runs right after another. ``max_seconds`` bounds each timing (at least one step is taken).
    """
    if not candidates:
        raise ValueError("decide() needs at least one candidate")
    reference = reference or candidates[0].name
    times: dict[str, list[float | None]] = {c.name: [] for c in candidates}
    marks: list[bool] = []
    for c in candidates:
        if warmup:
            time_steps(c.step, warmup=0, steps=warmup, synchronize=c.synchronize, threads=c.threads)
    for r in range(rounds):
        shift = r % len(candidates)
        contended = False
        for c in [*candidates[shift:], *candidates[:shift]]:
            timing = time_steps(c.step, warmup=0, steps=steps, synchronize=c.synchronize, threads=c.threads,
                                min_steps=1, max_seconds=max_seconds)
            times[c.name].append(timing.median_s)
            contended |= timing.contended
        marks.append(contended)
    return judge(times, reference, contended=marks, min_gain=min_gain, eligible=eligible)

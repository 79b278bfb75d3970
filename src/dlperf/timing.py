"""dlperf's one timer: warm up, synchronize around each step, take the median, and say whether to trust it.

Every measurement in dlperf (``dlperf bench``, Table 8 scaling, the one decider :mod:`dlperf.decide`, the
probe) goes through :func:`time_steps`, or :class:`StepWindow` where the steps are a user's own loop's, which
dlperf does not drive. Besides the per-step samples it watches the machine over the timed window and marks the
timing ``contended`` when other work competed for the CPUs the steps needed (scheduler wait, other runnable
tasks, CPU use and steal against ``WAIT_LIMIT`` and the limits beside it), so that a number measured on a busy
machine is never mistaken for the cost of the step (d2l 12.4: "make sure nothing else runs when you
benchmark"). :class:`Progress` says what a long measurement is timing and the time it has left. The rule, and
how its limits were calibrated: docs/design/measuring.md.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

__all__ = ["Progress", "NOISY_REL_SPREAD", "Contention", "ContentionMonitor", "ContentionSignals", "StepWindow",
           "Timing", "best_of", "doubling_up_to", "judge_contention", "median_of", "per_call_samples", "time_steps"]

# A cell whose interquartile range exceeds this fraction of its median is flagged as noisy: the
# median is still reported, but the reader should rerun with more steps on a quieter machine.
NOISY_REL_SPREAD = 0.10

STEAL_LIMIT = 0.05
WAIT_LIMIT = 0.15
CPU_USE_LIMIT = 0.75
LOAD_MARGIN = 0.5
MIN_TICKS = 20
"""Fewer scheduler ticks than this (10 ms each on most kernels, per core) say nothing about steal."""
MIN_WANTED_S = 0.02
"""Less CPU demand than this in a window is too short for the wait fraction to mean anything."""
SAMPLE_EVERY_S = 0.02
"""Runnable-task samples are taken between steps, at most this often, outside the timed brackets."""


def doubling_up_to(k: int) -> list[int]:
    """1, 2, 4, ... below ``k``, then ``k`` itself: the sweep points for threads and devices.

    >>> doubling_up_to(6)
    [1, 2, 4, 6]
    """
    out, n = [], 1
    while n < k:
        out.append(n)
        n *= 2
    out.append(max(k, 1))
    return out


# --- contention: the signals and the rule -----------------------------------------------------


@dataclass(frozen=True)
class ContentionSignals:
    """What was measured over one timed window; ``None`` where the platform could not say."""

    wall_s: float
    cpu_s: float
    """CPU time of the whole process (every thread) over the window."""
    threads: int
    """Threads the steps were asked to keep busy."""
    cores: int
    """Cores this process may run on."""
    run_s: float | None = None
    """Our threads' on-CPU time from schedstat."""
    wait_s: float | None = None
    """Our threads' run-queue waiting time from schedstat."""
    others_mean: float | None = None
    others_max: int | None = None
    load1: float | None = None
    steal_ticks: int | None = None
    total_ticks: int | None = None

    @property
    def cores_used(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def wait_fraction(self) -> float | None:
        if self.run_s is None or self.wait_s is None or self.run_s + self.wait_s < MIN_WANTED_S:
            return None
        return self.wait_s / (self.run_s + self.wait_s)

    @property
    def steal_fraction(self) -> float | None:
        if self.steal_ticks is None or not self.total_ticks or self.total_ticks < MIN_TICKS:
            return None
        return self.steal_ticks / self.total_ticks


@dataclass(frozen=True)
class Contention:
    """The verdict on one timed window: ``contended`` and, if so, why, with the numbers behind it."""

    contended: bool
    reason: str | None
    signals: ContentionSignals

    def to_dict(self) -> dict:
        s = self.signals
        return {"contended": self.contended, "reason": self.reason, "wall_s": s.wall_s,
                "cores_used": round(s.cores_used, 3), "threads": s.threads, "cores": s.cores,
                "wait_fraction": _round(s.wait_fraction), "others_runnable": _round(s.others_mean),
                "others_runnable_max": s.others_max, "load1": s.load1, "steal_fraction": _round(s.steal_fraction)}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def judge_contention(s: ContentionSignals) -> Contention:
    """Apply the module docstring's rule to measured (or, in tests, made-up) signals."""
    busy = min(s.threads, s.cores)
    others_seen = s.others_max is not None and s.others_max >= 1
    triggers: list[str] = []
    steal = s.steal_fraction
    if steal is not None and steal > STEAL_LIMIT:
        triggers.append(f"steal {steal:.0%} of CPU time")
    schedstat = s.run_s is not None and s.wait_s is not None
    wait = s.wait_fraction
    if wait is not None:
        allowed = max(0, s.threads - s.cores) / s.threads
        if wait > allowed + WAIT_LIMIT and others_seen:
            triggers.append(f"threads waited for a CPU {wait:.0%} of the time")
    elif not schedstat and s.wall_s >= MIN_WANTED_S and s.others_mean is not None \
            and s.cores_used < CPU_USE_LIMIT * busy and s.others_mean + busy > s.cores + LOAD_MARGIN:
        triggers.append("other tasks were runnable while our threads were not all running")
    if not triggers:
        return Contention(False, None, s)
    context = [f"cpu {s.cores_used:.1f} of {busy}.0 cores"]
    if s.others_mean is not None:
        context.append(f"{s.others_mean:.1f} other runnable tasks on {s.cores} cores")
    if s.load1 is not None:
        context.append(f"load {s.load1:.1f} on {s.cores} cores")
    return Contention(True, "; ".join(triggers + context), s)


# --- contention: reading the machine ----------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _task_ids() -> list[str]:
    try:
        return os.listdir("/proc/self/task")
    except OSError:
        return []


def _schedstat() -> dict[str, tuple[int, int]] | None:
    """Per thread: (ns on a CPU, ns waiting in a run queue); None where the kernel does not say."""
    out: dict[str, tuple[int, int]] = {}
    for tid in _task_ids():
        text = _read(f"/proc/self/task/{tid}/schedstat")
        if text is None:
            continue  # the thread ended meanwhile
        fields = text.split()
        if len(fields) >= 2 and fields[0].isdigit() and fields[1].isdigit():
            out[tid] = (int(fields[0]), int(fields[1]))
    # a kernel without schedstats reports zeros for a thread that surely ran (this one)
    return out if out and any(run > 0 for run, _ in out.values()) else None


def _own_running() -> int:
    n = 0
    for tid in _task_ids():
        text = _read(f"/proc/self/task/{tid}/stat")
        # the state follows the parenthesised name, which may itself contain ") "
        if text and text[text.rfind(")") + 2:text.rfind(")") + 3] == "R":
            n += 1
    return n


def _system_running() -> int | None:
    text = _read("/proc/loadavg")
    try:
        return int(text.split()[3].split("/")[0]) if text else None
    except (IndexError, ValueError):
        return None


def _cpu_ticks() -> tuple[int, int] | None:
    """(steal, total) ticks of all CPUs so far."""
    text = _read("/proc/stat")
    if not text or not text.startswith("cpu "):
        return None
    try:
        values = [int(v) for v in text.split("\n", 1)[0].split()[1:]]
    except ValueError:
        return None
    # guest time is already counted in user time; leave it out of the total
    counted = values[:8]
    return (counted[7] if len(counted) > 7 else 0), sum(counted)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _load1() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


class ContentionMonitor:
    """Watches the machine over one timed window: ``start()``, ``sample()`` between steps, ``stop()``."""

    def __init__(self, threads: int, cores: int | None = None) -> None:
        self.threads = max(1, threads)
        self.cores = cores or _cores()
        self._others: list[int] = []
        self._last_sample = 0.0

    def start(self) -> None:
        self._others.clear()
        self._sched0 = _schedstat()
        self._ticks0 = _cpu_ticks()
        self._cpu0 = time.process_time()
        self._wall0 = time.perf_counter()
        self.sample(force=True)

    def sample(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last_sample < SAMPLE_EVERY_S:
            return
        self._last_sample = now
        system = _system_running()
        if system is not None:
            self._others.append(max(0, system - _own_running()))

    def stop(self) -> Contention:
        wall = time.perf_counter() - self._wall0
        cpu = time.process_time() - self._cpu0
        self.sample(force=True)
        sched1, ticks1 = _schedstat(), _cpu_ticks()
        run_s = wait_s = None
        if self._sched0 is not None and sched1 is not None:
            # a thread started inside the window counts from zero; one that ended is lost (rare, small)
            run_ns = sum(r - self._sched0.get(t, (0, 0))[0] for t, (r, _) in sched1.items())
            wait_ns = sum(w - self._sched0.get(t, (0, 0))[1] for t, (_, w) in sched1.items())
            run_s, wait_s = max(0, run_ns) / 1e9, max(0, wait_ns) / 1e9
        steal = total = None
        if self._ticks0 is not None and ticks1 is not None:
            steal, total = ticks1[0] - self._ticks0[0], ticks1[1] - self._ticks0[1]
        others = self._others
        signals = ContentionSignals(
            wall_s=wall, cpu_s=cpu, threads=self.threads, cores=self.cores, run_s=run_s, wait_s=wait_s,
            others_mean=statistics.fmean(others) if others else None, others_max=max(others) if others else None,
            load1=_load1(), steal_ticks=steal, total_ticks=total)
        return judge_contention(signals)


# --- the timer ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """Seconds per step over the timed steps (warm-up excluded), and whether the machine was busy."""

    median_s: float
    q1_s: float
    q3_s: float
    min_s: float
    max_s: float
    samples: tuple[float, ...]
    warmup_samples: tuple[float, ...] = ()
    """Seconds of each untimed warm-up step: the first holds compilation, allocation, autotuning."""
    contention: Contention | None = field(default=None, compare=False)

    @property
    def iqr_s(self) -> float:
        return self.q3_s - self.q1_s

    @property
    def rel_spread(self) -> float:
        """Interquartile range over median; with fewer than 4 samples, (max - min) over median."""
        width = self.iqr_s if len(self.samples) >= 4 else self.max_s - self.min_s
        return width / self.median_s if self.median_s > 0 else 0.0

    @property
    def noisy(self) -> bool:
        return self.rel_spread > NOISY_REL_SPREAD

    @property
    def contended(self) -> bool:
        return self.contention is not None and self.contention.contended

    @property
    def first_call_overhead_s(self) -> float | None:
        """How much longer the first warm-up step took than a timed one (compilation, first allocations)."""
        if not self.warmup_samples:
            return None
        return max(0.0, self.warmup_samples[0] - self.median_s)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["samples"] = list(self.samples)
        d["warmup_samples"] = list(self.warmup_samples)
        d["contention"] = self.contention.to_dict() if self.contention else None
        d.update(iqr_s=self.iqr_s, rel_spread=self.rel_spread, noisy=self.noisy, contended=self.contended)
        return d

    @classmethod
    def from_samples(cls, samples: list[float], warmup_samples: list[float] | tuple[float, ...] = (),
                     contention: Contention | None = None) -> Timing:
        if not samples:
            raise ValueError("at least one timed sample is needed")
        s = sorted(samples)
        if len(s) >= 2:
            q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive")
        else:
            q1 = q3 = s[0]
        return cls(statistics.median(s), q1, q3, s[0], s[-1], tuple(samples), tuple(warmup_samples), contention)


def _default_threads() -> int:
    try:
        import torch

        return torch.get_num_threads()
    except ImportError:
        return 1


def time_steps(step: Callable[[], object], *, warmup: int, steps: int,
               synchronize: Callable[[], None] = lambda: None,
               on_step: Callable[[], None] | None = None,
               max_seconds: float | None = None, min_steps: int = 3,
               threads: int | None = None) -> Timing:
    """Run ``step`` ``warmup`` times untimed, then ``steps`` times timed one by one.

    ``synchronize`` waits for the device: GPU work is asynchronous, so a timer read without it
    measures only the launch. Each step is bracketed separately so one slow step (a page fault,
    a background process) moves the spread, not the median. With ``max_seconds``, timing stops
    early once that much time went into timed steps and at least ``min_steps`` were taken, so a
    slow network cannot blow a time budget. ``threads`` is how many threads a step keeps busy
    (default: torch's intra-op threads); the contention check compares the machine against it.

    >>> t = time_steps(lambda: sum(range(1000)), warmup=1, steps=5)
    >>> len(t.samples), t.median_s > 0, isinstance(t.contended, bool)
    (5, True, True)
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    warm: list[float] = []
    for _ in range(warmup):
        t0 = time.perf_counter()
        step()
        synchronize()
        warm.append(time.perf_counter() - t0)
        if on_step:
            on_step()
    synchronize()
    monitor = ContentionMonitor(threads if threads is not None else _default_threads())
    samples: list[float] = []
    monitor.start()
    for _ in range(steps):
        if max_seconds is not None and len(samples) >= min_steps and sum(samples) >= max_seconds:
            break
        synchronize()
        t0 = time.perf_counter()
        step()
        synchronize()
        samples.append(time.perf_counter() - t0)
        monitor.sample()
        if on_step:
            on_step()
    return Timing.from_samples(samples, warm, monitor.stop())


class StepWindow:
    """:func:`time_steps` for steps someone else drives (a training loop of the user's own): call :meth:`start`
    at a step's end, :meth:`lap` at the end of each step after it, then :meth:`stop` for the :class:`Timing` of
    those steps, judged for contention like any other.

    Each sample is the wall time from one step's end to the next one's, so whatever the loop does between
    steps (loading the next batch) counts, as it does in the loop's own time. ``synchronize`` waits for the
    device before each reading (GPU work is asynchronous); ``threads`` is what the steps keep busy.

    >>> window = StepWindow(threads=1)
    >>> window.start()
    >>> for _ in range(3):
    ...     _ = sum(range(1000))
    ...     window.lap()
    >>> t = window.stop()
    >>> len(t.samples), t.median_s > 0
    (3, True)
    """

    def __init__(self, threads: int | None = None, synchronize: Callable[[], None] = lambda: None) -> None:
        self.synchronize = synchronize
        self._monitor = ContentionMonitor(threads if threads is not None else _default_threads())
        self._samples: list[float] = []
        self._last: float | None = None

    def start(self) -> None:
        """The timed steps begin after this moment (a step has just ended)."""
        self.synchronize()
        self._samples = []
        self._monitor.start()
        self._last = time.perf_counter()

    def lap(self) -> None:
        """A timed step ended."""
        if self._last is None:
            raise RuntimeError("StepWindow.lap() before start()")
        self.synchronize()
        now = time.perf_counter()
        self._samples.append(now - self._last)
        self._last = now
        self._monitor.sample()

    @property
    def laps(self) -> int:
        """Steps timed since :meth:`start`."""
        return len(self._samples)

    @property
    def elapsed_s(self) -> float:
        """Seconds the steps timed since :meth:`start` took together."""
        return sum(self._samples)

    def stop(self) -> Timing:
        """The timed steps' :class:`Timing` (at least one :meth:`lap` is needed)."""
        if self._last is None:
            raise RuntimeError("StepWindow.stop() before start()")
        contention = self._monitor.stop()
        self._last = None
        return Timing.from_samples(self._samples, contention=contention)


# --- figures of one operation: the probe's and the cost model's measurements ------------------------
def _no_sync() -> None:
    return None


def per_call_samples(fn: Callable[[], object], *, reps: int, warmup: int = 1, calls: int = 1,
                     synchronize: Callable[[], None] = _no_sync, min_seconds: float = 0.0) -> list[float]:
    """Seconds per call of ``fn`` in each timed block of ``calls`` calls, after ``warmup`` untimed calls.

    For figures of one operation (a copy, a matmul, a dispatch), where :func:`time_steps`'s contention
    watch costs more than the operation: each block is bracketed by ``synchronize`` (a GPU runs
    asynchronously), ``calls`` > 1 spreads the timer's own cost over an operation shorter than it,
    and blocks are taken ``reps`` times and then on until ``min_seconds`` have passed since the first.

    >>> samples = per_call_samples(lambda: sum(range(100)), reps=3, calls=10)
    >>> len(samples), all(s > 0 for s in samples)
    (3, True)
    """
    if reps < 1 or calls < 1 or warmup < 0:
        raise ValueError(f"need reps >= 1, calls >= 1 and warmup >= 0, got {reps}, {calls} and {warmup}")
    for _ in range(warmup):
        fn()
    synchronize()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < reps or time.perf_counter() - start < min_seconds:
        synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize()
        samples.append((time.perf_counter() - t0) / calls)
    return samples


def best_of(fn: Callable[[], object], *, reps: int, warmup: int = 1, calls: int = 1,
            synchronize: Callable[[], None] = _no_sync, min_seconds: float = 0.0) -> float:
    """The fastest per-call time of :func:`per_call_samples`: on a shared machine the block another
    process disturbed least, for a peak figure such as a bandwidth or FLOP/s."""
    return min(per_call_samples(fn, reps=reps, warmup=warmup, calls=calls, synchronize=synchronize,
                                min_seconds=min_seconds))


def median_of(fn: Callable[[], object], *, reps: int, warmup: int = 1, calls: int = 1,
              synchronize: Callable[[], None] = _no_sync) -> float:
    """The median per-call time of :func:`per_call_samples`, for a typical cost."""
    return statistics.median(per_call_samples(fn, reps=reps, warmup=warmup, calls=calls, synchronize=synchronize))


class Progress:
    """What a long measurement is trying and the time it has left, as notes at most one every ``every_s`` seconds
    (logger ``dlperf.progress``: the CLI shows them on a terminal only, so piped output stays clean).

    >>> p = Progress("plan", budget_s=30.0, every_s=0.0)
    >>> p.say("timing 2x1,contiguous,eager (round 2 of 3)")  # logged as "plan: timing ... (28 s left of 30 s)"
    """

    def __init__(self, what: str, budget_s: float | None = None, every_s: float = 3.0) -> None:
        import logging

        self.what, self.budget_s, self.every_s = what, budget_s, every_s
        self.start = time.perf_counter()
        self._last = -math.inf
        self._log = logging.getLogger("dlperf.progress")

    def say(self, doing: str, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        spent = now - self.start
        left = f" ({max(0.0, self.budget_s - spent):.0f} s left of {self.budget_s:.0f} s)" \
            if self.budget_s is not None else f" ({spent:.0f} s so far)"
        self._log.info("%s: %s%s", self.what, doing, left)

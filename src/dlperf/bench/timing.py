"""The timing protocol shared by every benchmark: warm up, synchronize around each step, median."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

# A cell whose interquartile range exceeds this fraction of its median is flagged as noisy: the
# median is still reported, but the reader should rerun with more steps on a quieter machine.
NOISY_REL_SPREAD = 0.10


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


@dataclass(frozen=True)
class Timing:
    """Seconds per step over the timed steps (warm-up excluded)."""

    median_s: float
    q1_s: float
    q3_s: float
    min_s: float
    max_s: float
    samples: tuple[float, ...]

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

    def to_dict(self) -> dict:
        d = asdict(self)
        d["samples"] = list(self.samples)
        d.update(iqr_s=self.iqr_s, rel_spread=self.rel_spread, noisy=self.noisy)
        return d

    @classmethod
    def from_samples(cls, samples: list[float]) -> Timing:
        if not samples:
            raise ValueError("at least one timed sample is needed")
        s = sorted(samples)
        if len(s) >= 2:
            q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive")
        else:
            q1 = q3 = s[0]
        return cls(statistics.median(s), q1, q3, s[0], s[-1], tuple(samples))


def time_steps(step: Callable[[], object], *, warmup: int, steps: int,
               synchronize: Callable[[], None] = lambda: None,
               on_step: Callable[[], None] | None = None,
               max_seconds: float | None = None, min_steps: int = 3) -> Timing:
    """Run ``step`` ``warmup`` times untimed, then ``steps`` times timed one by one.

    ``synchronize`` waits for the device: GPU work is asynchronous, so a timer read without it
    measures only the launch. Each step is bracketed separately so one slow step (a page fault,
    a background process) moves the spread, not the median. With ``max_seconds``, timing stops
    early once that much time went into timed steps and at least ``min_steps`` were taken, so a
    slow network cannot blow a time budget.

    >>> t = time_steps(lambda: sum(range(1000)), warmup=1, steps=5)
    >>> len(t.samples), t.median_s > 0
    (5, True)
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    for _ in range(warmup):
        step()
        if on_step:
            on_step()
    synchronize()
    samples: list[float] = []
    for _ in range(steps):
        if max_seconds is not None and len(samples) >= min_steps and sum(samples) >= max_seconds:
            break
        synchronize()
        t0 = time.perf_counter()
        step()
        synchronize()
        samples.append(time.perf_counter() - t0)
        if on_step:
            on_step()
    return Timing.from_samples(samples)

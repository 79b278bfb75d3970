"""``plan="auto"`` for a loop of the user's own: its first steps, run under candidate settings, choose the plan.

dlperf does not drive such a loop, so it cannot time candidates on copies of the model as the planner does
(:mod:`~dlperf.parallel.planning.planner`). It tunes online instead, as Horovod's autotune does: the loop's
own first steps run under each candidate in turn, in alternating rounds, and are timed where they end (the
optimizer's step) by :class:`~dlperf.timing.StepWindow`, with its contention check. Every candidate computes
the same mathematics (intra-op threads, the activations' layout, a captured forward change only float
rounding), so training goes on while it tunes.

1. **Warm up** a few steps as the user wrote the loop (first allocations).
2. **Rounds**: each candidate still in the running is switched on at a step's end, given ``settle`` untimed
   steps (the switch itself: a layout conversion, a first capture), then ``steps`` timed ones. The order
   turns every round, so a change of the machine's load between rounds moves all alike.
3. **Prune** after every round: a candidate no faster than the reference by :data:`~dlperf.decide.MIN_GAIN`
   in a round neither timing of which was contended can no longer be chosen (the rule asks that of every
   round), so it leaves: a slow candidate costs about one round of steps.
4. **Decide** by dlperf's one rule (:func:`dlperf.decide.judge`): the fastest only beyond noise in every round,
   contended rounds left out where others exist, else the reference, the loop as the user wrote it; that plan
   stays in force.

Across processes every rank runs the same schedule (it counts steps, which the gradient sums keep in step),
and each round's figures and the time budget's verdict are summed over the ranks before anything is pruned
or decided, so every rank chooses the same plan.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ...decide import MIN_GAIN, judge
from ...devices import Device
from ...errors import UsageError
from ...timing import StepWindow, Timing, doubling_up_to
from ..planning.plan import EXECUTIONS, Plan, uses_conv2d
from ..planning.planner import Measurement

__all__ = ["LoopTuning", "OnlineTuner", "loop_candidates", "MAX_WINDOW_STEPS"]

MAX_WINDOW_STEPS = 200
"""The most steps one candidate's timing in one round takes, however short they are."""

log = logging.getLogger(__name__)


@dataclass
class LoopTuning:
    """How ``plan="auto"`` measures a loop of the user's own; every field is checked when made."""

    warmup: int = 2
    """Untimed steps as the user wrote the loop before the first round (first allocations)."""
    rounds: int = 3
    """Alternating rounds; :func:`dlperf.decide.judge` compares each candidate with the reference round by round."""
    steps: int = 3
    """Timed steps per candidate per round."""
    min_window_s: float = 0.2
    """In one process each timing takes at least this many seconds of steps (up to :data:`MAX_WINDOW_STEPS`): a
    few steps of a millisecond say little on a busy machine. Across processes every rank must time the same
    steps, so the window is a step count instead, set once from the warm-up's last step."""
    settle: int = 1
    """Untimed steps after each switch, at least one: the first holds the switch's own cost (a layout
    conversion, a first capture), and after it a capture that fell back is known."""
    budget_s: float = 60.0
    """Wall seconds of tuning after which no new round starts: the decision is made on the rounds done."""
    executions: Sequence[str] | None = None
    """Executions to consider (None: ``eager`` and ``captured``, where capture can serve the model)."""
    cores: int | None = None
    """Cores this process's intra-op threads may fill (None: its share of the machine)."""

    def __post_init__(self) -> None:
        for name, low in (("warmup", 0), ("rounds", 1), ("steps", 1), ("settle", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 1000:
                raise UsageError(f"tuning {name}={value!r}: expected an integer from {low} to 1000")
        if isinstance(self.min_window_s, bool) or not isinstance(self.min_window_s, (int, float)) or \
                not 0 <= self.min_window_s <= 60:
            raise UsageError(f"tuning min_window_s={self.min_window_s!r}: expected seconds in [0, 60]")
        if isinstance(self.budget_s, bool) or not isinstance(self.budget_s, (int, float)) or \
                not 0 < self.budget_s <= 3600:
            raise UsageError(f"tuning budget_s={self.budget_s!r}: expected seconds in (0, 3600]")
        if self.cores is not None and (isinstance(self.cores, bool) or not isinstance(self.cores, int)
                                       or self.cores < 1):
            raise UsageError(f"tuning cores={self.cores!r}: expected an integer >= 1 (or None)")
        for name in self.executions or ():
            EXECUTIONS.get(name)  # a miss lists what exists


def loop_candidates(module: nn.Module, reference: Plan, devices: Sequence[Device], cores: int,
                    options: LoopTuning) -> tuple[list[Plan], list[str]]:
    """The plans worth trying in a loop of the user's own (``reference`` first), and notes on what was left out.

    Intra-op threads 1, 2, 4, ... up to ``cores`` (CPU), each layout where 2-D convolutions make it matter, and
    the model's forward captured and replayed (:func:`dlperf.hybrid.hybridize`) in one process where capture
    can serve it. Replicas stay as the run has them: a loop of one's own cannot split its batch among
    threads (autograd runs one backward on one thread on CPU), and processes are the launcher's.
    """
    notes: list[str] = []
    gpu = any(d.is_gpu for d in devices)
    threads = [reference.threads] if gpu else sorted({*doubling_up_to(cores), reference.threads})
    layouts = ["contiguous", "channels_last"] if uses_conv2d(module) else [reference.memory_format]
    executions = ["eager"]
    wanted = options.executions if options.executions is not None else ("eager", "captured")
    for name in wanted:
        if name == "eager":
            continue
        execution = EXECUTIONS.get(name)
        why = execution.unavailable(module, devices)
        if why is None and reference.launcher == "processes":
            why = "a loop across processes runs its forward eagerly"
        if why is None and execution.has_setup:
            why = (f"its one-off setup cannot be weighed against a run whose length is unknown; pin it with a "
                   f"plan such as '1x{reference.threads},{name}'")
        if why:
            notes.append(f"{name}: {why}")
        else:
            executions.append(name)
    plans = [reference]
    for way in executions:
        for t in threads:
            for layout in layouts:
                plan = Plan(replicas=reference.replicas, threads=t, launcher=reference.launcher,
                            step_thread=reference.step_thread, memory_format=layout, execution=way)
                if plan not in plans:
                    plans.append(plan)
    return plans, notes


class OnlineTuner:
    """The schedule of ``plan="auto"`` (see the module's steps), told of every step's end by :meth:`step_ended`.

    Args:
        candidates: the plans to try, the reference first (what the loop runs as the user wrote it).
        options: how many rounds and steps.
        switch: puts the loop under a plan, at a step's end.
        declined: after a candidate's settling steps, why it does not run what it says (a capture that fell
            back to eager), or None.
        threads: the intra-op threads a plan's steps keep busy (the contention check's figure).
        share: across processes, sums a tensor over the ranks (None in one process).
        synchronize: waits for the device before a step's end is read.
    """

    def __init__(self, candidates: Sequence[Plan], options: LoopTuning, switch: Callable[[Plan], None],
                 declined: Callable[[Plan], str | None], *, notes: Sequence[str] = (),
                 share: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 synchronize: Callable[[], None] = lambda: None) -> None:
        self.found = [Measurement(p) for p in candidates]
        self.options = options
        self._switch, self._declined, self._share, self._sync = switch, declined, share, synchronize
        self.notes = list(notes)
        self.plan: Plan | None = None
        """The plan decided (None while tuning)."""
        self.steps_seen = 0
        self.started = time.perf_counter()
        self.seconds = 0.0
        self._round = -1
        self._order: list[Measurement] = []
        self._slot = 0
        self._left = options.warmup
        self._phase = "warmup"
        self._window: StepWindow | None = None
        self._warm: list[float] = []
        self.window_steps = options.steps
        """Across processes, the steps of every timing (set from the warm-up's last step)."""
        self.contended = False
        """Every round that decided was contended: the choice holds for this run, it is no measured gain."""
        if len(self.found) == 1:
            self._finish()

    @property
    def reference(self) -> Measurement:
        return self.found[0]

    @property
    def tuning(self) -> bool:
        return self.plan is None

    def live(self) -> list[Measurement]:
        return [m for m in self.found if not m.note]

    # -- the schedule ----------------------------------------------------------------------------------------
    def step_ended(self) -> None:
        """A step of the loop ended (its optimizer stepped): advance the schedule by one step."""
        if self.plan is not None:
            return
        self.steps_seen += 1
        if self._phase == "timed":
            assert self._window is not None
            self._window.lap()
            if self._window_full(self._window):
                self._record(self._window.stop())
                self._next_slot()
            return
        if self._phase == "warmup":
            self._warm.append(time.perf_counter())
        self._left -= 1
        if self._left > 0:
            return
        if self._phase == "warmup":
            if self._share is not None:
                self._agree_window()
            self._next_round()
        else:  # settled
            current = self._order[self._slot]
            why = self._declined(current.plan)
            if why:
                current.note = f"dropped: {why}"
                self._next_slot()
                return
            self._phase = "timed"
            self._window = StepWindow(current.plan.threads, self._sync)
            self._window.start()

    def _window_full(self, window: StepWindow) -> bool:
        if self._share is not None:
            return window.laps >= self.window_steps
        if window.laps < self.options.steps:
            return False
        return window.laps >= MAX_WINDOW_STEPS or window.elapsed_s >= self.options.min_window_s

    def _agree_window(self) -> None:
        """Across processes: the steps every timing takes, from the warm-up's last step, the same on every rank."""
        assert self._share is not None
        steps = self.options.steps
        if len(self._warm) >= 2 and self.options.min_window_s > 0:
            step_s = max(1e-6, self._warm[-1] - self._warm[-2])
            steps = min(MAX_WINDOW_STEPS, max(steps, math.ceil(self.options.min_window_s / step_s)))
        total = self._share(torch.tensor([float(steps), 1.0], dtype=torch.float64)).tolist()
        self.window_steps = max(self.options.steps, math.ceil(total[0] / total[1]))

    def _enter(self) -> None:
        """Switch to the current slot's candidate and let it settle."""
        self._switch(self._order[self._slot].plan)
        self._phase, self._left = "settle", self.options.settle

    def _record(self, timing: Timing) -> None:
        self._order[self._slot].record(self._round, timing.median_s * 1e3, timing.contended)

    def _next_slot(self) -> None:
        self._slot += 1
        while self._slot < len(self._order) and self._order[self._slot].note:
            self._slot += 1  # dropped meanwhile
        if self._slot < len(self._order):
            self._enter()
            return
        self._end_round()

    def _next_round(self) -> None:
        self._round += 1
        live = self.live()
        turn = self._round % len(live)
        self._order = live[turn:] + live[:turn]
        self._slot = 0
        self._enter()

    def _end_round(self) -> None:
        over = time.perf_counter() - self.started > self.options.budget_s
        if self._share is not None:
            over = self._agree(over)
        reference, r = self.reference, self._round
        if r in reference.by_round and r not in reference.contended_rounds:
            for m in self.live()[1:]:
                ms = m.by_round.get(r)
                if ms is not None and r not in m.contended_rounds and ms / reference.by_round[r] >= 1 - MIN_GAIN:
                    m.note = f"dropped after round {r + 1}: {ms:.2f} ms/step against the reference's " \
                             f"{reference.by_round[r]:.2f}"
        if over:
            self.notes.append(f"budget: {self.options.budget_s:g} s spent after {r + 1} round{'s' * (r > 0)}")
        if over or r + 1 >= self.options.rounds or len(self.live()) < 2:
            self._finish()
        else:
            self._next_round()

    def _agree(self, over: bool) -> bool:
        """Every rank's figures of this round averaged (so every rank decides alike), a timing contended on any
        rank marked on all, and whether any rank ran out of time."""
        assert self._share is not None
        r, k = self._round, len(self.found)
        mine = [m.by_round.get(r, 0.0) for m in self.found] + [float(r in m.contended_rounds) for m in self.found]
        total = self._share(torch.tensor([*mine, float(over), 1.0], dtype=torch.float64)).tolist()
        ranks = total[-1]
        for i, m in enumerate(self.found):
            if r in m.by_round:
                m.record(r, total[i] / ranks, total[k + i] > 0)
        return total[-2] > 0

    def _finish(self) -> None:
        reasons = list(self.notes)
        timed = [m for m in self.found if m.by_round and not m.note.startswith("dropped:")]
        if len(timed) < 2:
            plan = self.reference.plan
            reasons.append("no other candidate was timed")
        else:
            n = 1 + max(i for m in timed for i in m.by_round)
            verdict = judge({m.plan.name: [m.by_round.get(i) for i in range(n)] for m in timed},
                            self.reference.plan.name,
                            contended=[any(i in m.contended_rounds for m in timed) for i in range(n)])
            reasons.append(f"measured: {verdict.reason}")
            best = self._plainer_twin(next(m for m in timed if m.plan.name == verdict.chosen), timed, n, reasons)
            others = [(m.plan.name, m.ms) for m in timed if m is not best and m.ms is not None]
            plan = best.plan.with_figures(best.ms, others, reasons)
            self.contended = verdict.contended
        self.plan = plan
        self.seconds = time.perf_counter() - self.started
        self._switch(plan)

    @staticmethod
    def _plainer_twin(best: Measurement, timed: list[Measurement], n: int, reasons: list[str]) -> Measurement:
        """``best``, or its eager twin (the same threads and layout) unless ``best``'s execution beat that twin too
        beyond noise: both may beat the reference by far, and a capture is kept only where it is itself faster."""
        if best.plan.execution == "eager":
            return best
        twin = next((m for m in timed if m.plan == dataclasses.replace(best.plan, execution="eager")), None)
        if twin is None:
            return best
        verdict = judge({m.plan.name: [m.by_round.get(i) for i in range(n)] for m in (twin, best)}, twin.plan.name,
                        contended=[i in twin.contended_rounds or i in best.contended_rounds for i in range(n)])
        if verdict.chosen == best.plan.name:
            return best
        reasons.append(f"{best.plan.execution}: not faster than eager with the same threads and layout beyond noise "
                       f"({verdict.reason}); eager kept")
        return twin

    def table(self) -> str:
        """Every candidate with its rounds (ms per step) and why it left, for people."""
        rows = [f"{'plan':<36} {'ms/step':>9}  rounds / note"]
        for m in self.found:
            mark = "*" if self.plan is not None and m.plan == self.plan else " "
            ms = f"{m.ms:9.2f}" if m.ms is not None else f"{'-':>9}"
            rounds = " ".join(f"{v:.2f}" for v in m.rounds_ms)
            rows.append(f"{mark}{m.plan.name:<35} {ms}  {rounds}{' ' + m.note if m.note else ''}")
        return "\n".join(rows)

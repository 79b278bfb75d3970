"""``dlperf bench --mode auto``: per cell, the fastest training step dlperf can apply, timed and kept.

The candidates change how a step runs, not its mathematics: ``eager`` (the reference), ``channels-last``,
``hybrid`` (the captured whole step, backend :data:`HYBRID_BACKEND`), ``compile`` (only when a dynamo-only trace
scaled by :data:`INDUCTOR_OVER_TRACE` predicts its compile time under a bound) and fewer threads than the cell's.
On a CPU cell the planner's plan (:mod:`dlperf.bench.plans`) replaces the layout and thread candidates. Each runs
on its own copy of the model and optimizer, all are timed in alternating rounds, and the one decider keeps a
variant only beyond :data:`MIN_GAIN` in every round; the chosen one is then applied to the caller's model. The
candidates' rules: docs/design/planner.md.
"""

from __future__ import annotations

import copy
import functools
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from .._threads import intra_op_threads
from ..decide import MIN_GAIN, judge
from ..timing import Progress, Timing, time_steps
from .modes import StepFn, compiled_step, eager_step

if TYPE_CHECKING:
    from ..parallel.planning.plan import Plan

__all__ = ["make_step", "AutoChoice", "choose", "plan_variant", "COMPILE_BOUND_S", "HYBRID_BACKEND", "MIN_GAIN",
           "USE_PLANNER"]

ROUNDS = 3
"""Alternating rounds; each candidate takes :data:`STEPS_PER_ROUND` timed steps per round."""
STEPS_PER_ROUND = 3
MIN_ROUNDS = 2
SEARCH_BUDGET_S = 60.0
"""After :data:`MIN_ROUNDS` rounds, no further round starts once the timing took this long (slow networks)."""
COMPILE_BOUND_S = 60.0
"""torch.compile is skipped when its predicted compile time exceeds this (seconds)."""
INDUCTOR_OVER_TRACE = 20.0
"""Inductor's compile time over dynamo's trace time (LeNet, this project's CPU machine: 10 s / 0.6 s)."""

USE_PLANNER = True
"""Whether a CPU cell's layout and threads come from the planner (read at each :func:`make_step`)."""
HYBRID_BACKEND = "auto"
"""How the ``hybrid`` candidate's captured step replays, ``--mode hybrid``'s default: ``auto`` times native,
graph (and CUDA graphs) against the eager step on the first call and keeps the fastest."""

Builder = Callable[[nn.Module, torch.optim.Optimizer], StepFn]
REPLAY_BACKENDS = ("native", "graph", "cuda_graphs")
"""The captured step's backends that replay a graph (``runs_on`` of a step that is not eager)."""


@dataclass
class AutoChoice:
    """What auto mode picked for one cell, and the evidence."""

    chosen: str
    gain_over_eager: float
    medians: dict[str, float]
    notes: dict[str, str] = field(default_factory=dict)
    """Candidates that were skipped or failed, and why."""
    worst_round_gain: float = 1.0
    """The fastest candidate's gain in its worst round: it must exceed 1 + MIN_GAIN to replace eager."""
    plan: str | None = None
    """The planner's plan for the cell (short name), when it chose the layout and threads."""
    plan_variant: str | None = None
    """The candidate that runs :attr:`plan`; it stands unless another beats it in every round."""
    plan_note: str = ""
    runs_on: dict[str, str] = field(default_factory=dict)
    """What replayed each timed candidate that is a captured training step (``hybrid``: native, graph)."""
    contended: bool = False
    """Every round that decided was contended: the choice stands for this run, its ratio is no measured gain."""

    def label(self, name: str) -> str:
        """``name`` as the reason prints it: a captured step says so, with the backend that replayed it."""
        return f"{name} (captured step, {self.runs_on[name]})" if name in self.runs_on else name

    @property
    def reason(self) -> str:
        eager = self.medians.get("eager")
        parts = []
        for name, median in sorted(self.medians.items(), key=lambda kv: kv[1]):
            if name in ("eager", self.chosen):
                continue
            gain = eager / median if eager and median else None
            verdict = " (slower)" if gain is not None and gain < 1 else ""
            parts.append(f"{self.label(name)} {gain:.2f}x{verdict}" if gain is not None else f"{self.label(name)} -")
        parts += [f"{name}: {why}" for name, why in self.notes.items()]
        base = self.plan_variant or "eager"
        if self.chosen != base and self.contended:
            head = (f"{self.label(self.chosen)}: chosen on contended rounds, for this run only (other work took the "
                    f"cores: its {self.gain_over_eager:.2f}x over eager is no measured gain)")
        elif self.chosen != base:
            head = f"{self.label(self.chosen)}: {self.gain_over_eager:.2f}x over eager"
        elif base == "eager":
            head = (f"eager kept: nothing beat it by more than {MIN_GAIN:.0%} in every round (the fastest's "
                    f"worst round: {self.worst_round_gain:.2f}x)")
        else:
            head = (f"{base}: {self.gain_over_eager:.2f}x over eager (the plan; nothing beat it by more than "
                    f"{MIN_GAIN:.0%} in every round)")
        plan = [" ".join(["plan", self.plan] + ([self.plan_note] if self.plan_note else []))] if self.plan else []
        return "; ".join([head, *plan, *parts])


def _optimizer_like(optimizer: torch.optim.Optimizer, params) -> torch.optim.Optimizer:
    return type(optimizer)(params, **optimizer.defaults)


def _with_threads(n: int, step: StepFn) -> StepFn:
    """``step`` run with ``n`` intra-op threads, the caller's count restored after each call."""

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with intra_op_threads(n):
            return step(x, y)

    return run


def _fewer_threads(n: int, builder: Builder) -> Builder:
    return lambda m, o: _with_threads(n, builder(m, o))


def channels_last_step(model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                       inner_step: Callable[..., StepFn] = eager_step) -> StepFn:
    """``inner_step`` (eager by default) with the model's 4-D weights and each batch in channels-last
    (NHWC) memory order.

    ``Module.to`` swaps the parameters' storage in place, so ``optimizer`` still updates them. The
    last batch's converted copy is reused while the batch is unchanged (the benchmark steps one batch).
    """
    model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stubs lack this form
    inner = inner_step(model, loss_fn, optimizer)
    last: list = [None, -1, None]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if last[0] is not x or last[1] != x._version:
            last[:] = [x, x._version, x.contiguous(memory_format=torch.channels_last)]
        return inner(last[2], y)

    return step


def _is_conv_net(model: nn.Module, x) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 4 and any(isinstance(m, nn.Conv2d) for m in model.modules())


def _on_gpu(x) -> bool:
    """Whether the batch (a tensor, tuple or dict, :mod:`dlperf.batch`) lives on a GPU."""
    from ..batch import tensors_of

    return any(t.is_cuda for t in tensors_of(x))


def probe_compile_seconds(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor) -> float:
    """A prediction of torch.compile's compile time: dynamo's trace alone, timed, times a measured ratio."""
    import torch._dynamo

    probe_model = copy.deepcopy(model)
    traced = torch.compile(lambda a, b: loss_fn(probe_model(a), b), backend="eager")
    t0 = time.perf_counter()
    with torch.no_grad():
        traced(x, y)
    trace_s = time.perf_counter() - t0
    # The probe's frames must not serve the real compile; resetting per cell also keeps a sweep's many
    # models under dynamo's recompile limit, past which it would silently run compile candidates eagerly.
    torch._dynamo.reset()
    return trace_s * INDUCTOR_OVER_TRACE


def plan_variant(plan: Plan, threads: int, loss_fn: Callable) -> tuple[str, Builder]:
    """The candidate that runs ``plan`` (a :class:`~dlperf.parallel.planning.plan.Plan`) in a cell of ``threads``."""
    if plan.replicas == 1 and plan.execution in ("eager", "compile"):
        inner = eager_step if plan.execution == "eager" else compiled_step
        if plan.memory_format == "channels_last":
            name = "channels-last" if plan.execution == "eager" else "channels-last + compile"
            builder: Builder = lambda m, o: channels_last_step(m, loss_fn, o, inner)  # noqa: E731
        else:
            name = plan.execution
            builder = lambda m, o: inner(m, loss_fn, o)  # noqa: E731
        if plan.threads == threads:
            return name, builder
        return f"{name} {plan.threads} thr", _fewer_threads(plan.threads, builder)
    return f"plan {plan.name}", lambda m, o: _trainer_step(plan, m, o, loss_fn)


def _trainer_step(plan: Plan, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable) -> StepFn:
    """A Trainer following ``plan`` on ``model`` (its replicas share the cores), stepping as a bench step does."""
    from ..devices import cpu
    from ..parallel.training.trainer import Trainer
    from ..parallel.training.trainer_config import TrainerConfig

    config = TrainerConfig("sgd", {"lr": optimizer.defaults.get("lr", 0.01)}, loss=loss_fn, plan=plan,
                           processes=None, check_finite=False)
    trainer = Trainer(model, plan.devices_for([cpu(0)]), config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return trainer.train_step(x, y)

    step.trainer = trainer  # type: ignore[attr-defined]  # its workers live as long as the step
    return step


def captured_step_builder(loss_fn: Callable, x, y, backend: str) -> Builder:
    """The ``hybrid`` candidate: ``--mode hybrid``'s step, the whole training step captured on the example
    batch (its capture step undone) and replayed by ``backend``."""
    from ..hybrid.bench_mode import make_captured_step

    return lambda m, o: make_captured_step(m, loss_fn, o, x, y, backend=backend)


def candidates(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, threads: int,
               compile_bound_s: float, notes: dict[str, str], plan: Plan | None = None) -> dict[str, Builder]:
    """The variants worth timing for this model; the ones left out get a line in ``notes``.

    With ``plan`` (the planner's), the plan's variant replaces the layout and thread-count variants."""
    out: dict[str, Builder] = {"eager": lambda m, o: eager_step(m, loss_fn, o)}
    if _is_conv_net(model, x):
        out["channels-last"] = lambda m, o: channels_last_step(m, loss_fn, o)
    out["hybrid"] = captured_step_builder(loss_fn, x, y, HYBRID_BACKEND)
    if compile_bound_s <= 0:
        notes["compile"] = "skipped (compile bound is 0 s)"
    else:
        try:
            predicted = probe_compile_seconds(model, loss_fn, x, y)
        except Exception as exc:  # noqa: BLE001 - a model dynamo cannot trace is not compiled
            notes["compile"] = f"skipped: the trace probe failed ({type(exc).__name__})"
        else:
            if predicted > compile_bound_s:
                notes["compile"] = f"skipped: predicted compile {predicted:.0f}s > bound {compile_bound_s:.0f}s"
            else:
                out["compile"] = lambda m, o: compiled_step(m, loss_fn, o, x, y)
                if "channels-last" in out:
                    out["channels-last + compile"] = lambda m, o: channels_last_step(m, loss_fn, o, compiled_step)
    if plan is not None:
        out.pop("channels-last", None)
        name, builder = plan_variant(plan, threads, loss_fn)
        return {"eager": out.pop("eager"), name: builder, **out}
    # a GPU step's host threads only launch kernels: fewer of them is no candidate
    fewer = [] if _on_gpu(x) else sorted({max(1, threads // 2), 1} - {threads}, reverse=True)
    for n in fewer:
        for base in ("eager", "channels-last"):
            if base in out:
                out[f"{base} {n} thr"] = _fewer_threads(n, out[base])
    return out


def _build(name: str, builder: Builder, model: nn.Module, optimizer: torch.optim.Optimizer, x, y,
           notes: dict[str, str]) -> StepFn | None:
    """A candidate on its own copy of the model, called once (capture, compile); None if it cannot run."""
    from ..hybrid.hybridize import HybridizeWarning

    twin = copy.deepcopy(model)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", HybridizeWarning)
            step = builder(twin, _optimizer_like(optimizer, twin.parameters()))
            step(x, y)
    except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
        notes[name] = f"failed ({type(exc).__name__}: {str(exc).strip()[:80]})"
        return None
    fell_back = [w for w in caught if issubclass(w.category, HybridizeWarning) and "eager" in str(w.message)]
    if fell_back:
        notes[name] = "not applicable (runs eagerly: " + str(fell_back[0].message).splitlines()[0][:80] + ")"
        return None
    # a captured step whose own timing kept the eager step is eager: timing it again would tell nothing
    eager_reason = getattr(step, "eager_reason", None)
    if eager_reason:
        notes[name] = f"not applicable (the captured step runs eagerly: {eager_reason[:120]})"
        return None
    return step


def choose(model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer, x: torch.Tensor,
           y: torch.Tensor, *, compile_bound_s: float | None = None, rounds: int = ROUNDS,
           steps_per_round: int = STEPS_PER_ROUND, plan: Plan | None = None) -> tuple[AutoChoice, dict[str, Builder]]:
    """Time every candidate against eager, alternating, and pick; ``model`` and ``optimizer`` are untouched.

    ``compile_bound_s`` defaults to :data:`COMPILE_BOUND_S`, read at the call. With ``plan`` (the
    planner's), its variant stands in eager's place: another must beat it in every round to replace it.
    """
    threads = torch.get_num_threads()
    notes: dict[str, str] = {}
    bound = COMPILE_BOUND_S if compile_bound_s is None else compile_bound_s
    builders = candidates(model, loss_fn, x, y, threads, bound, notes, plan=plan)
    base = plan_variant(plan, threads, loss_fn)[0] if plan is not None else "eager"
    steps = {name: s for name, b in builders.items()
             if (s := _build(name, b, model, optimizer, x, y, notes)) is not None}
    if base not in steps:  # the plan's variant could not run here: eager stands, and the notes say why
        base = "eager"
    per_round: dict[str, list[float]] = {name: [] for name in steps}
    contended: list[bool] = []
    samples: dict[str, list[float]] = {name: [] for name in steps}
    sync = torch.cuda.synchronize if _on_gpu(x) else (lambda: None)
    started = time.perf_counter()
    progress = Progress("bench --mode auto", SEARCH_BUDGET_S)
    for done in range(rounds):
        if done >= MIN_ROUNDS and time.perf_counter() - started > SEARCH_BUDGET_S:
            notes["search"] = f"stopped after {done} rounds: the {SEARCH_BUDGET_S:.0f}s budget was spent"
            break
        contended.append(False)
        for name, step in steps.items():
            progress.say(f"timing {name} (round {done + 1} of {rounds})")
            t = time_steps(functools.partial(step, x, y), warmup=0, steps=steps_per_round, threads=threads,
                           synchronize=sync)
            samples[name] += t.samples
            per_round[name].append(t.median_s)
            contended[-1] |= t.contended
    medians = {name: Timing.from_samples(s).median_s for name, s in samples.items()}
    for timed in steps.values():  # a Trainer candidate's device workers go with its copy of the model
        trainer = getattr(timed, "trainer", None)
        if trainer is not None:
            trainer.close()
    best, gain, worst, all_contended = _pick(medians, per_round, base, contended)
    choice = AutoChoice(best, gain, medians, notes, worst, contended=all_contended)
    choice.runs_on = {name: ran for name, timed in steps.items()
                      if isinstance(ran := getattr(timed, "runs_on", None), str)}
    if choice.runs_on.get("hybrid") in REPLAY_BACKENDS:
        # The caller's model is captured for the backend that was timed here: its own choosing would time
        # the backends again, and might keep another than the one that won.
        builders["hybrid"] = captured_step_builder(loss_fn, x, y, choice.runs_on["hybrid"])
    if plan is not None:
        choice.plan, choice.plan_variant = plan.name, base
    return choice, builders


def _pick(medians: dict[str, float], per_round: dict[str, list[float]], base: str = "eager",
          contended: list[bool] | None = None) -> tuple[str, float, float, bool]:
    """The candidate the one decider (:func:`dlperf.decide.judge`) keeps against ``base`` (eager, or the
    planner's plan), timed in alternating rounds; ``base`` when none beats it beyond noise in every round.

    Returns (name, gain over eager overall, the worst round's gain of the fastest candidate, whether every
    round was contended).
    """
    verdict = judge(per_round, base, contended=contended or [])
    fastest = min((n for n in medians if n not in ("eager", base)), key=medians.__getitem__, default=None)
    ratios = verdict.ratios.get(fastest, []) if fastest is not None else []
    worst_of_fastest = 1 / max(ratios) if ratios else 1.0
    return verdict.chosen, medians["eager"] / medians[verdict.chosen], worst_of_fastest, verdict.contended


def _planned(model: nn.Module, loss_fn: Callable, x, y):
    """The planner's decision for a CPU cell at this thread count, or (None, why not)."""
    if not USE_PLANNER or _on_gpu(x):
        return None, ""
    from .plans import report_plan

    try:
        return report_plan(model, (x, y), threads=torch.get_num_threads(), loss=loss_fn), ""
    except Exception as exc:  # noqa: BLE001 - a model the Trainer cannot train is timed without a plan
        return None, f"not planned ({type(exc).__name__}: {str(exc).strip()[:80]})"


def make_step(model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
              example_x: torch.Tensor, example_y: torch.Tensor, *, compile_bound_s: float | None = None,
              rounds: int = ROUNDS) -> StepFn:
    """The fastest applicable step for this model and batch (see the module docstring); eager's math.

    The returned step carries ``mode_chosen``, ``gain_over_eager``, ``auto_reason`` and ``auto_choice``.
    """
    decision, why = _planned(model, loss_fn, example_x, example_y)
    choice, builders = choose(model, loss_fn, optimizer, example_x, example_y, compile_bound_s=compile_bound_s,
                              rounds=rounds, plan=decision.plan if decision is not None else None)
    if decision is not None:
        choice.plan_note = f"[{decision.provenance()}]"
    elif why:
        choice.notes["plan"] = why
    return _AutoStep(builders[choice.chosen](model, optimizer), choice)


class _AutoStep:
    """The chosen variant's step, with what the report says of the choice. What runs it is read from the
    step when asked, not when built: a captured step falls back to eager, or captures a new batch shape,
    as it goes."""

    def __init__(self, chosen: StepFn, choice: AutoChoice) -> None:
        self._chosen = chosen
        self.mode_chosen = choice.chosen
        self.gain_over_eager = choice.gain_over_eager
        self.auto_reason = choice.reason
        self.auto_choice = choice
        self.plan = choice.plan

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._chosen(x, y)

    def close(self) -> None:
        trainer = getattr(self._chosen, "trainer", None)
        if trainer is not None:  # a Trainer plan's device workers stop when the cell is done with the step
            trainer.close()

    @property
    def runs_on(self) -> str | None:
        return getattr(self._chosen, "runs_on", None)

    @property
    def eager_reason(self) -> str | None:
        return getattr(self._chosen, "eager_reason", None)

    @property
    def backend(self) -> str:
        return self.runs_on or ("inductor" if "compile" in self.mode_chosen else self.mode_chosen)

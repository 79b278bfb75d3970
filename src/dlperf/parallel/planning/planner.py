"""The planner: which :class:`~dlperf.parallel.planning.plan.Plan` trains this model fastest here, found by measuring.

1. **Enumerate** the plans valid for the model, batch and devices (replicas x intra-op threads that fill the
   cores, layouts, then the other executions on the fastest of those; on GPUs precision, cuDNN benchmark mode,
   pinned memory).
2. **Price** each split with the cost model (:func:`~dlperf.probe.cost.step_floor`) and drop those whose floor is
   far above the best.
3. **Measure** the survivors in alternating rounds through a builder the caller gives
   (``build(plan) -> CandidateRun``), each timing with its contention mark.
4. **Keep** the fastest only if it beats the reference beyond noise in every round (:func:`_decide`, the one
   decider's rule), and cache the decision (:mod:`~dlperf.parallel.planning.plan_cache`).

Everything stays inside a time budget (10% of the planned run or 30 s, whichever is smaller): each candidate's
round is predicted first, and what would not fit is skipped and listed in :attr:`PlanDecision.skipped`;
``torch.compile`` is started only when its predicted setup fits
(:func:`~dlperf.parallel.planning.plan_cache.save_setup`,
:meth:`~dlperf.parallel.planning.plan.Execution.setup_guess_s`). Each step's rules, the budget and the compile
figures behind its guess: docs/design/planner.md.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...decide import MIN_GAIN, Verdict, judge, rank
from ...devices import Device
from ...errors import UsageError
from ...machine import usable_cores
from ...timing import Progress, time_steps
from ..allreduce import DEFAULT_ALGORITHM
from .plan import EXECUTIONS, Plan, has_batch_statistics, layer_count, uses_conv2d
from .plan_cache import (
    SETUP_RECORD_MAX_AGE_S,
    cached_plan,
    cached_time,
    default_cache_path,
    model_key,
    plan_key,
    processes_offer,
    save_plan,
    save_processes_offer,
    save_setup,
    setup_record,
)
from .plan_check import Here, usable_here
from .process_plans import launch_hint, process_plans, processes_measurable, setup_s
from .records import CandidateRun, Measurement, PlanDecision, PlannerOptions

__all__ = ["PlannerOptions", "CandidateRun", "Measurement", "PlanDecision", "search", "enumerate_plans",
           "usable_cores", "DEFAULT_BUDGET_S"]

DEFAULT_BUDGET_S = 30.0
RUN_SHARE = 0.1
"""The share of the planned run the planner may spend (when the run's length is known)."""
PRUNE_RATIO = 3.0
"""Splits whose cost-model floor exceeds the best floor this many times are not measured."""
MAX_REPLICAS_TRIED = 8
FLOOR_ALLOWANCE = 1.5
"""The budget of a short run covers one round of each candidate as predicted, times this."""
WHOLE_STEP_FIRST_CALL_STEPS = 16
"""A whole-step execution's first call, in steps: it captures the step, then times each replay it could use
and the eager step a few steps each before it answers (:mod:`dlperf.hybrid.train_step`)."""


def _inputs(batch: Any) -> Any:
    return batch[0] if isinstance(batch, (tuple, list)) and len(batch) == 2 else batch


def _examples(batch: Any) -> int:
    from ...batch import batch_size

    return batch_size(_inputs(batch), "the example batch")


def enumerate_plans(model: nn.Module, batch: Any, devices: Sequence[Device], reference: Plan,
                    options: PlannerOptions) -> tuple[list[Plan], list[str]]:
    """The eager plans worth measuring beside ``reference`` (first in the list), and notes on what was left out."""
    notes: list[str] = []
    x = _inputs(batch)
    layouts = ["contiguous"]
    if uses_conv2d(model) and isinstance(x, torch.Tensor) and x.dim() == 4:
        layouts.append("channels_last")
    base = dataclasses.replace(reference, execution="eager")
    if any(d.is_gpu for d in devices):
        return _gpu_plans(base, layouts, model, options, notes), notes
    cores = options.cores or usable_cores()
    if has_batch_statistics(model):
        splits = [(reference.replicas, max(1, cores // reference.replicas))]
        notes.append(f"replicas: kept at {reference.replicas} (BatchNorm's statistics depend on the split)")
    else:
        n = _examples(batch)
        # one replica with any number of threads (a small model runs fastest on fewer than all the cores),
        # several replicas sharing the cores evenly
        splits = [(1, t) for t in sorted({1, 2, 4, cores} - {c for c in (2, 4) if c > cores})]
        splits += [(r, cores // r) for r in range(2, min(cores, n, MAX_REPLICAS_TRIED) + 1)
                   if r * (cores // r) == cores]
    plans = [reference]
    strategies = _planned_strategies(reference, options)
    # replicas as processes, measured by launching them where the caller can (see plan_processes)
    processes = process_plans(model, devices, reference, cores, _examples(batch), layouts, notes)
    for r, t in splits:
        # a split of its own gets the cost model's allreduce (resolved in search); the reference keeps the user's
        algorithm = reference.algorithm if r == reference.replicas else ("auto" if r > 1 else DEFAULT_ALGORITHM)
        # one replica runs on the calling thread: no hand-off to a worker and back each step
        where = "caller" if r == 1 else "worker"
        for layout in layouts:
            plan = dataclasses.replace(base, replicas=r, threads=t, memory_format=layout, algorithm=algorithm,
                                       step_thread=where)
            for variant in [plan, *(dataclasses.replace(plan, strategy=name) for name in strategies if r > 1)]:
                if variant not in plans and _strategy_fits(variant):
                    plans.append(variant)
        # a split's processes right after its threads: measured before the budget is spent (DDP's shape)
        plans += [p for p in processes if (p.replicas, p.threads) == (r, t) and p not in plans]
    return plans + [p for p in processes if p not in plans], notes


def _planned_strategies(reference: Plan, options: PlannerOptions) -> list[str]:
    """The strategies, by name, to measure beside the one a plan's options imply (see PlannerOptions.strategies)."""
    from ..strategies import STRATEGIES

    if reference.kvstore is not None or reference.strategy is not None:  # the user's choice stands
        return []
    names = options.strategies if options.strategies is not None else \
        [n for n in STRATEGIES.names() if STRATEGIES.get(n).planned]
    return [n for n in names if n != "allreduce"]  # allreduce is what several replicas imply already


def _strategy_fits(plan: Plan) -> bool:
    """Whether a plan's named strategy can run its replicas in one process (as the planner measures them)."""
    if plan.strategy is None:
        return True
    from ..strategies import STRATEGIES, StrategyOptions

    return STRATEGIES.get(plan.strategy).unusable(StrategyOptions(plan.kvstore, devices=plan.replicas)) is None


def _gpu_plans(base: Plan, layouts: list[str], model: nn.Module, options: PlannerOptions,
               notes: list[str]) -> list[Plan]:
    precisions = ["off"]
    if options.allow_mixed_precision and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        precisions.append("bf16")
    elif not options.allow_mixed_precision:
        notes.append("mixed precision: not considered (it changes the numerics; allow it to consider it)")
    conv = uses_conv2d(model)
    plans = [base]
    for layout in layouts:
        for precision in precisions:
            plan = dataclasses.replace(base, memory_format=layout, mixed_precision=precision, cudnn_benchmark=conv,
                                       pin_memory=True)
            if plan not in plans:
                plans.append(plan)
    return plans


def _floors(model: nn.Module, batch: Any, plans: Sequence[Plan]) -> tuple[dict[tuple[int, int], float], str]:
    """The cost model's step floor (ms) of each replicas x threads split, and where its figures came from."""
    from ...probe.cache import load_probe
    from ...probe.cost import Hardware, count_step, step_floor

    x = _inputs(batch)
    if not isinstance(x, torch.Tensor):
        return {}, "not priced: the cost model counts models of one tensor input"
    counts = count_step(model, x)
    probe = load_probe(quiet=True)
    floors: dict[tuple[int, int], float] = {}
    source = "the saved probe" if probe is not None else "d2l's quad-core (no saved probe: run dlperf probe)"
    for r, t in sorted({(p.replicas, p.threads) for p in plans}):
        hw = None
        if probe is not None:
            try:
                hw = Hardware.from_probe_result(probe, threads=t)
            except (UsageError, KeyError, ValueError):
                hw = None
        if hw is None:
            seed = Hardware.from_seed("cpu-4core")  # one core's figures: t threads, t times the FLOP/s
            hw = dataclasses.replace(seed, flops={k: v * t for k, v in seed.flops.items()})
        floors[(r, t)] = step_floor(counts, hw, devices=r, allreduce="sharded" if r > 1 else None).no_overlap_s * 1e3
    return floors, source


def _price(model: nn.Module, batch: Any, plans: list[Plan], options: PlannerOptions,
           notes: list[str]) -> list[Measurement]:
    """Measurements-to-be for the plans the cost model does not rule out (the reference always stays)."""
    try:
        floors, source = _floors(model, batch, plans)
        if floors:
            notes.append(f"floors: the cost model with {source}")
        else:
            notes.append(source)
    except Exception as exc:  # noqa: BLE001 - counting runs the user's model on meta tensors
        floors = {}
        notes.append(f"not priced: counting the step failed ({type(exc).__name__}: {str(exc)[:80]})")
    found = [Measurement(p, floors.get((p.replicas, p.threads))) for p in plans]
    best = min((m.floor_ms for m in found if m.floor_ms is not None), default=None)
    kept = [found[0]]
    rest = sorted(found[1:], key=lambda m: m.floor_ms if m.floor_ms is not None else 0.0)
    for m in rest:
        if best is not None and m.floor_ms is not None and m.floor_ms > PRUNE_RATIO * best:
            notes.append(f"{m.plan.name}: not measured, its floor {m.floor_ms:.2f} ms is over "
                         f"{PRUNE_RATIO:g}x the best")
        elif len(kept) >= options.keep:
            notes.append(f"{m.plan.name}: not measured, beyond the {options.keep} kept after pricing")
        else:
            kept.append(m)
    return kept


def _with_algorithm(plan: Plan, model: nn.Module, devices: Sequence[Device]) -> tuple[Plan, str | None]:
    """``plan`` with the allreduce algorithm the cost model picks for its gradient buckets, and why."""
    if plan.replicas < 2 or plan.kvstore is not None or plan.algorithm != "auto":
        return plan, None
    from ..allreduce import choose_algorithm
    from ..communication.buckets import auto_bucket_bytes

    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in params]
    cap = plan.bucket_bytes or auto_bucket_bytes(params)
    nbytes = max(min(sum(sizes), cap), max(sizes, default=0))
    name, reason = choose_algorithm(nbytes, plan.devices_for(devices), workers=True)
    return dataclasses.replace(plan, algorithm=name), f"allreduce {name}: {reason}"


class _Session:
    """One search's clock, open candidate runs, what builds cost, and notes.

    The budget is kept by prediction: before a candidate is built or timed in a round, its cost is
    estimated (:meth:`cost_s`) and it is skipped for time when that would overrun; the timed steps
    themselves stop one step short of the budget. What it cannot foresee (a build or first step slower
    than every earlier one) is the slack a planning run may exceed its budget by.
    """

    def __init__(self, build: Callable[[Plan], CandidateRun], options: PlannerOptions,
                 start: float | None = None) -> None:
        self.build, self.options = build, options
        self.start = start if start is not None else time.perf_counter()
        self.budget = options.budget_s if options.budget_s is not None else DEFAULT_BUDGET_S
        self.runs: dict[int, CandidateRun] = {}
        self.skipped: list[str] = []
        self.round_index = 0
        self.build_s: list[float] = []
        """Seconds each build took (a candidate not built yet is allowed the slowest so far)."""
        self.first_extra_s: list[float] = []
        """Seconds each eager candidate's first step took beyond its steady step (first allocations)."""
        self.progress = Progress("plan", self.budget)
        self.setups: dict[str, float] = {}
        """Each execution's predicted one-off setup in seconds (measured before for this model, else guessed)."""

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def step_s(self, m: Measurement, reference: Measurement) -> float:
        """Seconds ``m``'s step is expected to take: its own figure, else the reference's scaled by the
        cost model's floors where both have one (fewer threads, a slower floor)."""
        if m.ms is not None:
            return m.ms / 1e3
        scale = 1.0
        if m.floor_ms is not None and reference.floor_ms:
            scale = max(1.0, m.floor_ms / reference.floor_ms)
        return (reference.ms or 0.0) / 1e3 * scale

    def cost_s(self, m: Measurement, reference: Measurement, steps: int | None = None) -> float:
        """Seconds ``m``'s next round is expected to take with ``steps`` timed steps (None: the options'):
        those steps, and before its first round its build (the slowest so far), its warm-up steps and what
        its first step costs beyond a steady one."""
        step, options = self.step_s(m, reference), self.options
        steps = options.steps if steps is None else steps
        if m.by_round:
            return step * steps
        execution = EXECUTIONS.get(m.plan.execution)
        if execution.whole_step:  # the first call captures, then times each way to replay it
            extra = WHOLE_STEP_FIRST_CALL_STEPS * step
        else:
            extra = max(self.first_extra_s, default=0.0) + self.setups.get(execution.name, execution.setup_s)
        # starting processes is counted by its own estimate, and kept out of the in-process builds' figure
        build = setup_s(m.plan) if m.plan.launcher == "processes" else max(self.build_s, default=0.0)
        return build + extra + step * (options.warmup + steps)

    def least_s(self, group: Sequence[Measurement], reference: Measurement) -> float:
        """What one timed step of each of ``group`` is predicted to take, first-round costs included."""
        return sum(self.cost_s(m, reference, steps=1) for m in group)

    def time_round(self, m: Measurement, index: int, reference: Measurement | None = None,
                   after: Sequence[Measurement] = ()) -> None:
        """Time ``m`` in round ``index`` (``reference``: None when ``m`` is the reference), leaving enough of
        the budget for one step of each of ``after``, the members still to come in this round."""
        run = self.runs.get(id(m))
        options = self.options
        self.progress.budget_s = self.budget
        self.progress.say(f"timing {m.plan.name} (round {index + 1})")
        if run is None and reference is not None and self.elapsed() + setup_s(m.plan) > self.budget:
            # starting processes costs seconds; the reference (reference None) is always timed
            m.note = "skipped for time"
            return
        build_s = 0.0
        try:
            if run is None:
                built = time.perf_counter()
                run = self.runs[id(m)] = self.build(m.plan)
                build_s = time.perf_counter() - built
                if m.plan.launcher != "processes":
                    self.build_s.append(build_s)
            first = m.first_step_ms is None
            warm = None
            if first and options.warmup:
                warm = time_steps(run.step, warmup=0, steps=options.warmup, synchronize=run.synchronize,
                                  threads=run.threads)
            if reference is None and m.ms is None and warm is not None:
                # the reference's first round: its warm-up stands in for its step until it is timed, so the
                # others' rounds can be predicted and their share of the budget kept
                m.by_round[index] = warm.samples[-1] * 1e3
            step = self.step_s(m, reference) if reference is not None else (m.ms or 0.0) / 1e3
            reserve = self.least_s(after, reference or m)
            if reference is None and warm is not None and self.elapsed() + step > self.budget:
                # a step so slow that the reference's warm-up spent the budget: its figure is that step (its
                # first allocations included) rather than another step past the budget
                timing = warm
            else:
                # the steps stop one step short of what the budget leaves after that (one is always taken)
                timing = time_steps(run.step, warmup=0, steps=options.steps, synchronize=run.synchronize,
                                    threads=run.threads, min_steps=1,
                                    max_seconds=max(0.0, self.budget - self.elapsed() - reserve - step))
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run here is dropped, with the reason
            m.note = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
            m.by_round.clear()
            return
        why = run.declined() if first else None
        if why:
            m.note = f"dropped: {why}"
            return
        m.record(index, timing.median_s * 1e3, timing.contended)
        if first:
            m.first_step_ms = warm.samples[0] * 1e3 if warm is not None else m.by_round[index]
            if m.plan.execution == "eager":
                self.first_extra_s.append(max(0.0, (m.first_step_ms - m.by_round[index]) / 1e3))
            elif EXECUTIONS.get(m.plan.execution).has_setup:  # its first step, warm-up or timed, holds the setup
                first_s = warm.samples[0] if warm is not None else timing.samples[0]
                m.setup_s = build_s + max(0.0, first_s - timing.median_s)

    def _fits(self, todo: list[Measurement], reference: Measurement) -> list[Measurement]:
        """Those of ``todo`` whose predicted rounds fit in the budget left, the reference's included (a round
        without it is worth nothing): new candidates first, then those with figures, most promising first."""
        left = self.budget - self.elapsed()
        if any(m is reference for m in todo):
            left -= self.cost_s(reference, reference, steps=1)
        others = [m for m in todo if m is not reference]
        others.sort(key=lambda m: (bool(m.by_round), rank(m.ratios(reference)) if m.ratios(reference) else 0.0))
        chosen: list[Measurement] = []
        for m in others:
            cost = self.cost_s(m, reference, steps=1)  # the steps beyond the first fill what is left
            if cost <= left:
                chosen.append(m)
                left -= cost
        if not chosen:
            return []
        return [m for m in todo if m is reference or any(m is c for c in chosen)]

    def rounds(self, group: list[Measurement], rounds: int, needed: Measurement | None = None) -> None:
        """Alternate over ``group`` (the reference first), the order reversed every other round so drift hits
        all alike; in each round only what is predicted to fit in the budget is built and timed (and no round
        is started without ``needed``, the member the rounds are for)."""
        reference = group[0]
        for i in range(rounds):
            index = self.round_index + i
            todo = [m for m in group if not m.note.startswith(("failed", "dropped")) and index not in m.by_round]
            fitted = self._fits(todo, reference)
            if not fitted or (needed is not None and not any(m is needed for m in fitted)):
                break
            order = fitted if i % 2 == 0 else fitted[::-1]
            for j, m in enumerate(order):
                after = order[j + 1:]
                if m is reference:
                    if i % 2 == 0 or any(index in c.by_round for c in fitted if c is not reference):
                        self.time_round(m, index, after=after)
                elif self.elapsed() + self.least_s([m, *after], reference) <= self.budget:  # none overran
                    self.time_round(m, index, reference, after)
        for m in group:
            if not m.by_round and not m.note:
                m.note = "skipped for time"
        self.round_index += rounds

    def close(self) -> None:
        for run in self.runs.values():
            run.close()
        self.runs.clear()


def _difference(plan: Plan, chosen: Plan) -> str:
    """What sets ``plan`` apart from ``chosen``, in the plan line's words (``2 x 1``, ``contiguous``)."""
    parts = []
    if (plan.replicas, plan.threads) != (chosen.replicas, chosen.threads):
        parts.append(f"{plan.replicas} x {plan.threads}")
    if plan.launcher != chosen.launcher:
        parts.append(plan.launcher)
    if plan.step_thread != chosen.step_thread:
        parts.append("calling thread" if plan.step_thread == "caller" else "worker")
    if plan.memory_format != chosen.memory_format:
        parts.append(plan.memory_format.replace("_", "-"))
    if plan.execution != chosen.execution:
        parts.append(plan.execution)
    if plan.mixed_precision != chosen.mixed_precision:
        parts.append(f"precision {plan.mixed_precision}")
    return ", ".join(parts) or plan.name


def _pays(m: Measurement, reference: Measurement, run_steps: int | None) -> tuple[bool, str]:
    """Whether an execution with a one-off setup (compile) gains back its setup over a run of known length."""
    if m.plan.execution == "eager" or not run_steps or m.first_step_ms is None:
        return True, ""
    setup_ms = max(0.0, m.first_step_ms - (m.ms or 0.0))
    if (m.ms or 0.0) * run_steps + setup_ms < (reference.ms or 0.0) * run_steps:
        return True, ""
    return False, (f"{m.plan.execution}: its setup ({setup_ms / 1e3:.1f} s) outweighs its gain over "
                   f"{run_steps} steps")


def _decide(found: list[Measurement], run_steps: int | None, reasons: list[str]) -> tuple[Measurement, Verdict]:
    """The candidate to run, by the one decider's rule (:func:`dlperf.decide.judge`, round by round against the
    reference), where an execution with a setup (compile) counts only when a run of ``run_steps`` gains it back.
    No candidate counts: the reference."""
    reference = found[0]
    if reference.ms is None:
        raise UsageError(f"the reference plan {reference.plan.name} could not run ({reference.note}); "
                         "check the model, batch and devices without a plan first")
    timed = {m.plan.name: m for m in found if m.ms is not None}
    n = max((max(m.by_round) + 1 for m in timed.values()), default=0)
    contended = [any(i in m.contended_rounds for m in timed.values()) for i in range(n)]

    def pays(name: str) -> str | None:
        ok, why = _pays(timed[name], reference, run_steps)
        return None if ok else why

    verdict = judge({name: [m.by_round.get(i) for i in range(n)] for name, m in timed.items()},
                    reference.plan.name, contended=contended, min_gain=MIN_GAIN, eligible=pays)
    reasons.append(f"measured: {verdict.reason}")
    return timed[verdict.chosen], verdict


def _setup_key(model: nn.Module, batch: Any, devices: Sequence[Device], execution: str) -> str:
    """What an execution's setup is recorded under: the model's and batch's signatures, the machine, torch (in
    :func:`~dlperf.parallel.planning.plan_cache.model_key`), the execution and the kind of device it compiles for."""
    return model_key(model, batch, f"setup:{execution}:{sorted({d.kind for d in devices})}")


def _predicted_setup(name: str, model: nn.Module, batch: Any, devices: Sequence[Device],
                     options: PlannerOptions, left: float) -> tuple[float, str]:
    """Seconds of one-off setup ``name`` is predicted to take for ``model`` here, and where that comes from:
    the slowest setup recorded (when the cache is used), else the execution's guess from the model's size. A
    record older than :data:`SETUP_RECORD_MAX_AGE_S` that would exceed the ``left`` seconds gives way to the
    guess: were it trusted, the execution would never be measured again, and the record never renewed."""
    guess, source = EXECUTIONS.get(name).setup_guess_s(model), f"guessed for {layer_count(model)} layers"
    record = setup_record(_setup_key(model, batch, devices, name), options.cache_path) if options.use_cache else None
    if record is None:
        return guess, source
    seconds, age = record[0], time.time() - record[1]
    if seconds <= left or age < SETUP_RECORD_MAX_AGE_S:
        return seconds, "as measured here before"
    return guess, (f"{source}; the {seconds:.0f} s measured here {age / 86400:.0f} days ago is older than "
                   f"{SETUP_RECORD_MAX_AGE_S / 86400:g} days")


def _executions_phase(session: _Session, found: list[Measurement], model: nn.Module, batch: Any,
                      devices: Sequence[Device]) -> list[Measurement]:
    """Every other execution on the fastest eager plan, when the run's length lets it pay and time allows."""
    options = session.options
    measured = [m for m in found if m.ms is not None]
    if not measured:
        return []
    leaders = {False: min(measured, key=lambda m: m.ms or 0.0),
               True: min((m for m in measured if m.plan.replicas == 1), key=lambda m: m.ms or 0.0, default=None)}
    names = [n for n in (options.executions or EXECUTIONS.names()) if n != "eager"]
    extra: list[Measurement] = []
    for name in names:
        execution = EXECUTIONS.get(name)
        why = execution.unavailable(model, devices)
        leader = leaders[execution.whole_step]  # a whole step runs one replica: tried on the best such plan
        if why is None and leader is None:
            why = "it runs one replica, and no one-replica plan was measured"
        if why:
            session.skipped.append(f"{name}: {why}")
            continue
        assert leader is not None
        if execution.has_setup and options.run_steps is None:
            session.skipped.append(f"{name}: the run's length is unknown, so its setup cannot be weighed")
            continue
        left = session.budget - session.elapsed()
        if execution.has_setup:
            session.setups[name], source = _predicted_setup(name, model, batch, devices, options, left)
            if session.setups[name] > left:  # started, it could not end inside the budget
                session.skipped.append(f"{name}: needs ~{session.setups[name]:.0f} s of setup ({source}), more than "
                                       f"the {max(0.0, left):.1f} s left of the time budget ({session.budget:.1f} s)")
                continue
        elif left < 0:
            session.skipped.append(f"{name}: not measured: spent the time budget ({session.budget:.1f} s)")
            continue
        m = Measurement(dataclasses.replace(leader.plan, execution=name), leader.floor_ms)
        # the reference is timed beside them: the choice is each candidate's ratio to it, round by round
        session.rounds([found[0], *([leader] if leader is not found[0] else []), m], options.rounds, needed=m)
        if m.setup_s is not None and options.use_cache:  # the next search of this model predicts from it
            save_setup(_setup_key(model, batch, devices, name), m.setup_s, options.cache_path)
        extra.append(m)
    return extra


def search(model: nn.Module, batch: Any, devices: Sequence[Device], build: Callable[[Plan], CandidateRun],
           reference: Plan, options: PlannerOptions | None = None) -> PlanDecision:
    """Choose the plan to train ``model`` on ``batch`` across ``devices`` (see the module's steps).

    ``reference`` is what the run would do without a plan; ``build(plan)`` readies a candidate on its own
    copy of the model (the caller's weights are never stepped).
    """
    options = options or PlannerOptions()
    extra = repr((reference.to_dict(), options.allow_mixed_precision, tuple(options.executions or ()),
                  options.cores or usable_cores(), options.run_steps is not None, processes_measurable(),
                  tuple(_planned_strategies(reference, options))))
    key = plan_key(model, batch, devices, extra)
    started = time.perf_counter()
    if options.use_cache and not options.replan:
        hit = cached_plan(key, options.cache_path)
        if hit is not None:  # a file's plan: used only when it can run here (else one line, and planning again)
            here = Here(devices, _examples(batch), can_launch=processes_measurable(), cores=options.cores,
                        allow_mixed_precision=options.allow_mixed_precision, executions=options.executions)
            hit = usable_here(hit, here, f"the plan cache {options.cache_path or default_cache_path()}",
                              "planning again")
        if hit is not None:
            return PlanDecision(hit, reference, planning_s=time.perf_counter() - started, cached=True,
                                cached_from=cached_time(key, options.cache_path),
                                faster_with_processes=_processes_hint(model, batch, devices, hit, options))
    plans, notes = enumerate_plans(model, batch, devices, reference, options)
    reasons = list(notes)
    plans = [_chosen_algorithm(p, model, devices, reasons) for p in plans]
    found = _price(model, batch, plans, options, reasons)
    session = _Session(build, options, started)
    try:
        # round 0's reference, leaving a step for each candidate; its step time sets the budget for a known run
        session.time_round(found[0], 0, after=found[1:])
        if options.budget_s is None and options.run_steps and found[0].ms is not None:
            _run_budget(session, found, options.run_steps, reasons, _setup_free(options, model, devices))
        session.rounds(found, options.rounds)
        found += _executions_phase(session, found, model, batch, devices)
        best, verdict = _decide(found, options.run_steps, reasons)
        if verdict.contended and best is not found[0]:
            best = _recheck(session, found[0], best, reasons)
    finally:
        session.close()
    noise = verdict.margin
    figures = _figures(found)
    chosen_ms = figures.get(id(best), best.ms)
    # a faster figure than the chosen one's is a median that was not faster in every round (or its setup did not
    # pay): said beside it, so the line's order never reads as a contradiction of the choice
    alternatives = sorted(((_difference(m.plan, best.plan) + (" [within noise]" if chosen_ms is not None and
                                                              figures[id(m)] < chosen_ms else ""), figures[id(m)])
                           for m in found if m is not best and id(m) in figures), key=lambda a: a[1])
    plan = best.plan.with_figures(chosen_ms, alternatives, reasons)
    late = [m.plan.name for m in found if m.note == "skipped for time"]
    skipped = session.skipped + ([f"for time (budget {session.budget:.1f} s): {'; '.join(late)}"] if late else [])
    decision = PlanDecision(plan, reference, found, time.perf_counter() - started, False, skipped, noise,
                            verdict.contended or any(m.contended for m in found))
    if options.use_cache:
        save_plan(key, plan, options.cache_path, contended=decision.contended, label=_label(model, batch),
                  planning_s=decision.planning_s)
        if processes_measurable():  # what a search in one process will compare its own decision with
            save_processes_offer(_offer_key(model, batch, devices, options), plan, options.cache_path)
    decision.faster_with_processes = _processes_hint(model, batch, devices, plan, options)
    return decision


def _figures(found: list[Measurement]) -> dict[int, float]:
    """Each candidate's ms per step as decided: the reference's least disturbed round, the others that times their
    median ratio to it over the rounds both ran. The figures a line prints are then in the order the decision
    weighed them (a candidate's own best round may come from a round whose reference was slowed)."""
    reference = found[0]
    if reference.ms is None:
        return {}
    out = {id(reference): reference.ms}
    for m in found[1:]:
        ratios = m.ratios(reference)
        if ratios:
            out[id(m)] = reference.ms * statistics.median(ratios)
    return out


def _recheck(session: _Session, reference: Measurement, best: Measurement, reasons: list[str]) -> Measurement:
    """A decision whose rounds were all contended: one more round of the winner beside the reference, which it must
    still win (by :data:`MIN_GAIN`) to be used for this run; else the reference."""
    index = session.round_index
    session.rounds([reference, best], 1)
    if index in best.by_round and index in reference.by_round and \
            best.by_round[index] < (1 - MIN_GAIN) * reference.by_round[index]:
        reasons.append("contended: the winner beat the reference again in a round of its own; used for this run, "
                       "measured again next time")
        return best
    reasons.append("contended: the winner did not beat the reference again in a round of its own; the reference "
                   "is kept for this run, and the plan is measured again next time")
    return reference


def _label(model: nn.Module, batch: Any) -> str:
    """What a cached decision was for, in words (``dlperf plans`` lists it): the model's class and the batch."""
    from ...batch import describe

    inner = getattr(model, "inner", model)
    return f"{type(inner).__name__} on {describe(_inputs(batch))}"[:200]


def _offer_key(model: nn.Module, batch: Any, devices: Sequence[Device], options: PlannerOptions) -> str:
    """What a decision made with process plans is recorded under: the model, the batch and what decides the
    candidates (the device count, the cores filled), so a search compares only with one that had its choices."""
    return model_key(model, batch, f"decided with processes:{len(devices)} devices:{options.cores or usable_cores()}")


def _processes_hint(model: nn.Module, batch: Any, devices: Sequence[Device], plan: Plan,
                    options: PlannerOptions) -> str | None:
    """For a decision made without process plans: a line naming the plan decided for this model when they were
    measured, when that is a processes plan faster than ``plan`` by more than :data:`MIN_GAIN` (both figures
    from their own searches), with how to get it; else None."""
    if processes_measurable() or not options.use_cache or plan.measured_ms is None or any(d.is_gpu for d in devices):
        return None
    offer = processes_offer(_offer_key(model, batch, devices, options), options.cache_path)
    if offer is None or offer.launcher != "processes" or offer.measured_ms is None:
        return None
    if offer.measured_ms >= plan.measured_ms * (1 - MIN_GAIN):
        return None
    return (f"plan: {offer.name} was measured faster ({offer.measured_ms:.2f} ms/step against "
            f"{plan.measured_ms:.2f}) where processes could be started, which a Trainer in one process cannot: "
            f"give it plan={offer.name!r} and {launch_hint(offer)}")


def _setup_free(options: PlannerOptions, model: nn.Module, devices: Sequence[Device]) -> list[str]:
    """The executions other than eager, without a one-off setup, that can run here (``captured``)."""
    names = [n for n in (options.executions or EXECUTIONS.names()) if n != "eager"]
    return [n for n in names
            if not EXECUTIONS.get(n).has_setup and EXECUTIONS.get(n).unavailable(model, devices) is None]


def _run_budget(session: _Session, found: list[Measurement], run_steps: int, reasons: list[str],
                executions: Sequence[str] = ()) -> None:
    """The budget of a run of known length: :data:`RUN_SHARE` of it, at most :data:`DEFAULT_BUDGET_S`, and
    at least what the reference (already timed) and one round of each candidate are predicted to take (times
    :data:`FLOOR_ALLOWANCE`: the prediction rests on one round of the reference), each of ``executions``
    beside the reference and a leader included, so a short run still measures what it chooses between (the
    decision is cached for the runs after it)."""
    reference = found[0]
    share = RUN_SHARE * run_steps * (reference.ms or 0.0) / 1e3
    rounds = [session.cost_s(m, reference) for m in found[1:]]
    for name in executions:  # its first round, and the reference's and the leader's steps beside it
        proxy = Measurement(dataclasses.replace(reference.plan, execution="eager"), reference.floor_ms)
        first = session.cost_s(proxy, reference)
        if EXECUTIONS.get(name).whole_step:
            first += WHOLE_STEP_FIRST_CALL_STEPS * session.step_s(reference, reference)
        rounds.append(first + 2 * session.cost_s(reference, reference))
    floor = session.elapsed() + FLOOR_ALLOWANCE * sum(rounds)
    session.budget = min(DEFAULT_BUDGET_S, max(share, floor))
    if share < session.budget:
        reasons.append(f"budget: {session.budget:.1f} s, not {share:.1f} s ({RUN_SHARE:.0%} of a {run_steps}-step "
                       f"run): enough for the reference and one round of each candidate"
                       + (f" (at most {DEFAULT_BUDGET_S:g} s)" if floor > DEFAULT_BUDGET_S else ""))


def _chosen_algorithm(plan: Plan, model: nn.Module, devices: Sequence[Device], reasons: list[str]) -> Plan:
    try:
        plan, reason = _with_algorithm(plan, model, devices)
    except UsageError as exc:
        reasons.append(f"{plan.name}: allreduce left at auto ({exc})")
        return plan
    if reason and reason not in reasons:
        reasons.append(reason)
    return plan

"""The planner's decision for a report: what ``dlperf bench --mode auto`` and ``dlperf profile`` suggest.

``dlperf train --plan auto``, ``bench --mode auto`` and ``profile`` ask one planner
(:func:`dlperf.parallel.training.planned.plan_for`) the same question, for one model and batch on this machine's
CPU cores: the same enumeration, pricing and measurement, and the same plan cache, so whichever runs
first measures and the others start at once with the same plan. The call here is the one ``dlperf train
--model ... --plan auto`` makes on its default device (``cpu:0``, every usable core): a report does not
know the run's length, so it plans as for a run of :data:`REPORT_RUN_STEPS` steps inside
:data:`REPORT_BUDGET_S` seconds, which leaves out executions whose setup alone exceeds that (``torch.compile``;
``bench --mode auto`` times compile itself on top of the plan).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..batch import call_model, tensors_of
from ..devices import cpu
from ..machine import usable_cores
from ..parallel.planning.plan import Plan
from ..parallel.planning.records import PlanDecision, PlannerOptions
from ..parallel.training.planned import plan_for
from ..probe.profile import PlanAdvice, Suggestion

__all__ = ["report_plan", "plan_advice", "REPORT_RUN_STEPS", "REPORT_BUDGET_S"]

REPORT_RUN_STEPS = 1000
"""The run a report plans for (only whether a length is known enters the cache key, as for ``dlperf train``)."""
REPORT_BUDGET_S = 15.0
"""Seconds a report's planning may take: below ``torch.compile``'s setup, so a report never compiles."""


def report_plan(model: nn.Module, batch: tuple[Any, Any], *, threads: int | None = None, loss=None,
                cache_path: str | None = None) -> PlanDecision:
    """The planner's decision for ``model`` on ``batch`` (``(inputs, targets)``) with ``threads`` cores.

    With every usable core this is the question ``dlperf train --plan auto`` asks on ``cpu:0``, and the
    cache answers both; with fewer, the reference is one replica at ``threads`` (a plain loop) and the
    planner never uses more threads than that.
    """
    from ..models.spec import CallsWithBatch

    if isinstance(model, CallsWithBatch):  # bench's adapter for a factory's model: plan the model as written
        model = model.inner
    cores = usable_cores()
    threads = threads or cores
    whole_machine = threads == cores
    options = PlannerOptions(run_steps=REPORT_RUN_STEPS, budget_s=REPORT_BUDGET_S, cache_path=cache_path,
                             cores=None if whole_machine else threads)
    return plan_for(model, batch, [cpu(0)] if whole_machine else None, loss=loss, options=options)


def _targets(model: nn.Module, x: Any, loss: Any = None) -> tuple[Any, Any] | None:
    """Targets and the loss as ``dlperf profile``'s step takes them (:class:`dlperf.losses.TimedLoss`); None for
    outputs of several tensors without a loss of their own (the planner's Trainer takes one)."""
    from ..losses import TimedLoss

    with torch.no_grad():
        out = call_model(model, x)
    timed = TimedLoss(loss, out, generator=torch.Generator().manual_seed(0))
    if timed.own:
        return None, None
    if len(timed.targets) != 1:
        return None
    return timed.targets[0].to(tensors_of(out)[0].device), timed.step_loss


def _how(plan: Plan) -> str:
    return f"dlperf train --plan {plan.name} (Trainer(..., plan={plan.name!r})): {plan.summary()}"


def _not_planned(why: str) -> PlanAdvice:
    return PlanAdvice(None, [Suggestion("plan", "dlperf train --plan auto", note=f"not planned: {why}")])


def plan_advice(model: nn.Module, x: Any, loss: Any = None) -> PlanAdvice:
    """``dlperf profile``'s thread-count and layout suggestions: the planner's candidates, each measured
    against the planner's reference in its alternating rounds; the chosen plan first."""
    if any(t.device.type != "cpu" for t in tensors_of(x)):
        return _not_planned("the batch is not on the CPU; for GPUs, dlperf train --plan auto --devices gpu(0) "
                            "plans on them")
    made = _targets(model, x, loss)
    if made is None:
        return _not_planned("the model returns several outputs, and a planned Trainer takes one loss")
    y, loss = made
    try:
        # the whole machine, whatever threads the profile ran with: "use more (or fewer) cores" is one of the
        # answers a profile owes its user, and it is the question `dlperf train --plan auto` asks
        decision = report_plan(model, (x, y), loss=loss)
    except Exception as exc:  # noqa: BLE001 - the profile stands without a plan; the line says why
        return _not_planned(f"{type(exc).__name__}: {str(exc).strip()[:120]}")
    plan = decision.plan
    by_plan = {m.plan: m for m in decision.measurements if m.ms is not None}
    reference = by_plan.get(decision.reference)
    base = reference.ms / 1e3 if reference is not None and reference.ms else None
    chosen_note = ("the planner's choice" if plan != decision.reference else
                   "the planner keeps the reference: nothing beat it by more than the noise")
    if decision.cached:
        chosen_note = "the planner's choice, cached (measured earlier on this machine; rerun with a fresh cache " \
                      "to time it again)"
        ms = plan.measured_ms / 1e3 if plan.measured_ms else None
        return PlanAdvice(plan.name, [Suggestion(f"plan {plan.name}", _how(plan), None, ms, note=chosen_note)],
                          cached=True)
    chosen = by_plan.get(plan)
    out = [Suggestion(f"plan {plan.name}", _how(plan), base, chosen.ms / 1e3 if chosen and chosen.ms else None,
                      note=chosen_note)]
    for m in decision.measurements:
        if m.plan == plan or m.plan == decision.reference:
            continue
        measured = m.ms / 1e3 if m.ms is not None else None
        faster = bool(measured and base and measured < base)
        note = m.note or ("" if measured else "not measured")
        if faster:  # the planner weighs every round, not the best one: a faster best round alone is noise
            why = ("not faster than the reference by more than the noise in every round"
                   if plan == decision.reference else f"{plan.name} beat it")
            note = "; ".join(filter(None, [note, why]))
        out.append(Suggestion(f"plan {m.plan.name}", _how(m.plan), base if measured else None, measured,
                              note=note, rejected=faster))
    return PlanAdvice(plan.name, out, cached=False, planning_s=decision.planning_s)

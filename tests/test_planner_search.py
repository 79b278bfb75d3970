"""The planner's search itself: how it decides from what it measured, and how it keeps to its time budget.
The decisions are checked on made-up measurements whose right answer is known by construction."""

from __future__ import annotations

import dataclasses
import time

import pytest

from dlperf.decide import FEW_ROUNDS_GAIN, MIN_GAIN
from dlperf.devices import cpu
from dlperf.parallel.planning.plan import Plan
from dlperf.parallel.planning.planner import _decide, search
from dlperf.parallel.planning.records import CandidateRun, Measurement, PlanDecision, PlannerOptions

REFERENCE = Plan(replicas=1, threads=2)


def measured(plan: Plan, by_round: dict[int, float]) -> Measurement:
    return Measurement(plan, by_round=dict(by_round))


def decide(*candidates: tuple[Plan, dict[int, float]], reference: dict[int, float] | None = None,
           run_steps: int | None = None) -> tuple[Plan, float, list[str]]:
    found = [measured(REFERENCE, reference or {0: 100.0, 1: 100.0, 2: 100.0})]
    found += [measured(p, r) for p, r in candidates]
    reasons: list[str] = []
    best, verdict = _decide(found, run_steps, reasons)
    return best.plan, verdict.margin, reasons


TWO_ROUNDS = Plan(replicas=2, threads=1)
ONE_ROUND = Plan(replicas=1, threads=1, step_thread="caller")


def test_one_lucky_ratio_does_not_beat_a_candidate_timed_in_more_rounds():
    # the shape seen on ResNet-18: the budget ran out before the faster-looking candidate's second round
    plan, margin, reasons = decide((TWO_ROUNDS, {0: 88.0, 1: 89.0}), (ONE_ROUND, {0: 85.0}))
    assert plan == TWO_ROUNDS and margin == MIN_GAIN
    assert "over 2 shared rounds" in reasons[-1]


def test_a_candidate_of_fewer_rounds_wins_when_clearly_faster():
    plan, margin, reasons = decide((TWO_ROUNDS, {0: 88.0, 1: 89.0}), (ONE_ROUND, {0: 70.0}))
    assert plan == ONE_ROUND and margin == FEW_ROUNDS_GAIN
    assert "over 1 shared round," in reasons[-1]


def test_one_round_alone_needs_the_larger_margin():
    # 7% faster in its only round: beyond MIN_GAIN, within FEW_ROUNDS_GAIN -> the reference stays
    assert 1 - 0.93 > MIN_GAIN and 1 - 0.93 < FEW_ROUNDS_GAIN
    plan, _, reasons = decide((ONE_ROUND, {0: 93.0}))
    assert plan == REFERENCE and "kept" in reasons[-1]
    # the same 7% held over three rounds counts
    plan, _, _ = decide((ONE_ROUND, {0: 93.0, 1: 93.5, 2: 92.5}))
    assert plan == ONE_ROUND
    # and 15% in one round is clear enough
    plan, _, _ = decide((ONE_ROUND, {0: 85.0}))
    assert plan == ONE_ROUND


def test_a_wide_spread_does_not_lose_to_a_candidate_it_beat_in_every_round():
    # the spread gates whether a candidate counts; among those that count, the median ranks them
    wide, tight = Plan(replicas=1, threads=1, step_thread="caller"), TWO_ROUNDS
    plan, _, _ = decide((tight, {0: 79.0, 1: 80.0, 2: 79.0}), (wide, {0: 30.0, 1: 78.0, 2: 60.0}))
    assert plan == wide


def test_rounds_the_reference_did_not_share_do_not_count():
    # timed in three rounds, but beside the reference in one only: judged on that one
    plan, _, _ = decide((ONE_ROUND, {0: 93.0, 5: 50.0, 6: 50.0}), reference={0: 100.0, 1: 100.0})
    assert plan == REFERENCE


def test_a_spread_wider_than_the_gain_keeps_the_reference():
    plan, margin, _ = decide((TWO_ROUNDS, {0: 80.0, 1: 99.0, 2: 97.0}))
    assert plan == REFERENCE and margin == pytest.approx((0.99 - 0.80) / 2)
    # slower in one round: never chosen, whatever its median
    plan, _, _ = decide((TWO_ROUNDS, {0: 50.0, 1: 101.0, 2: 50.0}))
    assert plan == REFERENCE


def test_an_execution_whose_setup_the_run_does_not_repay_is_not_chosen():
    compiled = Plan(replicas=1, threads=2, execution="compile")
    fast = measured(compiled, {0: 50.0, 1: 50.0})
    fast.first_step_ms = 20_000.0  # 20 s of compilation against 50 ms saved per step
    found = [measured(REFERENCE, {0: 100.0, 1: 100.0}), fast]
    reasons: list[str] = []
    assert _decide(found, 100, reasons)[0].plan == REFERENCE
    assert any("outweighs its gain over 100 steps" in r for r in reasons)
    assert _decide(found, 10_000, [])[0].plan == compiled  # 500 s saved over a long run


def test_a_round_where_the_reference_was_disturbed_proves_nothing():
    # another process slowed the reference in round 0: one ratio of 0.63, the other level
    plan, _, _ = decide((TWO_ROUNDS, {0: 65.0, 1: 99.5}), reference={0: 103.0, 1: 100.0})
    assert plan == REFERENCE


# -- the time budget ---------------------------------------------------------------------------------

def small_cnn():
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 5))


def one_batch():
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randn(12, 3, 8, 8, generator=g), torch.randint(0, 5, (12,), generator=g)


def sleepy(build_s: float, step_s: float, built: list[Plan]):
    """A builder whose builds and steps sleep: every candidate's cost is known by construction."""
    def build(plan: Plan) -> CandidateRun:
        built.append(plan)
        time.sleep(build_s)
        return CandidateRun(step=lambda: time.sleep(step_s), close=lambda: None)
    return build


def test_planning_stays_inside_its_budget_when_builds_and_steps_are_slow():
    import torch._dynamo  # noqa: F401  (pricing builds an optimizer, whose first import of dynamo takes seconds)

    # every build 0.5 s, every step 0.05 s: a candidate started just before the budget ends would overrun it
    # by a build and a warm-up; predicted, it is not started (the slack: the timer's own work under load)
    budget = 1.5
    built: list[Plan] = []
    options = PlannerOptions(rounds=3, steps=3, warmup=1, cores=2, budget_s=budget, use_cache=False)
    decision = search(small_cnn(), one_batch(), [cpu(0), cpu(1)], sleepy(0.5, 0.05, built),
                      Plan(replicas=2, threads=1), options)
    assert decision.planning_s <= budget + 0.25, decision.table()
    assert 2 <= len(built) < len(decision.measurements)
    assert any(s.startswith("for time") for s in decision.skipped), decision.table()
    # each one built was timed beside the reference, in as many rounds as fitted
    timed = [m for m in decision.measurements if m.by_round]
    assert len(timed) == len(built) and all(m.ratios(decision.measurements[0]) for m in timed[1:])


def test_a_slow_first_call_is_predicted_for_a_whole_step_execution():
    from dlperf.parallel.planning.plan import EXECUTIONS
    from dlperf.parallel.planning.planner import WHOLE_STEP_FIRST_CALL_STEPS, _Session

    reference = Measurement(Plan(replicas=1, threads=2), by_round={0: 100.0})
    captured = Measurement(Plan(replicas=1, threads=2, execution="captured"))
    eager = Measurement(Plan(replicas=1, threads=1, step_thread="caller"))
    assert EXECUTIONS.get("captured").whole_step
    session = _Session(sleepy(0.0, 0.0, []), PlannerOptions(steps=3, warmup=1))
    session.build_s = [0.5]
    assert session.cost_s(eager, reference) == pytest.approx(0.5 + 0.1 * 4)
    assert session.cost_s(captured, reference) == pytest.approx(0.5 + 0.1 * (WHOLE_STEP_FIRST_CALL_STEPS + 4))
    eager.by_round[0] = 200.0  # once timed, its own steps
    assert session.cost_s(eager, reference) == pytest.approx(0.2 * 3)


def test_a_short_run_still_measures_one_round_of_each_candidate():
    # 10% of a 5-step run of 30 ms steps is 15 ms: without a floor only the reference would be timed
    built: list[Plan] = []
    options = PlannerOptions(rounds=2, steps=3, warmup=1, cores=2, run_steps=5, use_cache=False)
    decision = search(small_cnn(), one_batch(), [cpu(0), cpu(1)], sleepy(0.0, 0.03, built),
                      Plan(replicas=2, threads=1), options)
    eager = [m for m in decision.measurements if m.plan.execution == "eager"]
    assert len(eager) > 2 and all(m.by_round for m in eager), decision.table()
    floor = [r for r in decision.plan.reasons if r.startswith("budget:")]
    assert len(floor) == 1 and "not 0.0 s (10% of a 5-step run)" in floor[0], decision.plan.reasons
    assert decision.planning_s < 5


def test_the_budgets_floor_is_capped_by_the_default():
    from dlperf.parallel.planning.planner import DEFAULT_BUDGET_S, _run_budget, _Session

    reference = Measurement(Plan(replicas=1, threads=2), by_round={0: 1000.0})
    found = [reference] + [Measurement(Plan(replicas=1, threads=1, step_thread="caller")) for _ in range(20)]
    session = _Session(sleepy(0.0, 0.0, []), PlannerOptions(steps=3, warmup=1, run_steps=10))
    reasons: list[str] = []
    _run_budget(session, found, 10, reasons)  # 20 candidates x 4 s predicted, against 1 s (10% of the run)
    assert session.budget == DEFAULT_BUDGET_S
    assert reasons and reasons[0].endswith(f"(at most {DEFAULT_BUDGET_S:g} s)")
    # a long run's own share stands, and says nothing
    reasons.clear()
    _run_budget(session, found[:2], 200, reasons)
    assert session.budget == pytest.approx(20.0) and not reasons


def test_a_step_slower_than_the_budget_allows_is_timed_once_and_nothing_else_is_built():
    import torch._dynamo  # noqa: F401  (as above: not the search's own time)

    built: list[Plan] = []
    options = PlannerOptions(rounds=2, steps=3, warmup=1, cores=2, budget_s=0.5, use_cache=False)
    decision = search(small_cnn(), one_batch(), [cpu(0), cpu(1)], sleepy(0.0, 0.3, built),
                      Plan(replicas=2, threads=1), options)
    assert decision.planning_s <= 0.5 + 0.2, decision.table()
    assert len(built) == 1 and decision.plan == Plan(replicas=2, threads=1)
    assert decision.measurements[0].ms == pytest.approx(300, rel=0.3)
    assert all(m.note == "skipped for time" for m in decision.measurements[1:] if m.plan.execution == "eager")


def test_each_member_of_a_round_leaves_a_step_for_those_after_it():
    # 0.1 s steps, 3 per round, in a budget that fits the reference's round and one step of each other
    import torch._dynamo  # noqa: F401

    built: list[Plan] = []
    options = PlannerOptions(rounds=1, steps=3, warmup=0, cores=2, budget_s=1.2, use_cache=False)
    decision = search(small_cnn(), one_batch(), [cpu(0), cpu(1)], sleepy(0.0, 0.1, built),
                      Plan(replicas=2, threads=1), options)
    eager = [m for m in decision.measurements if m.plan.execution == "eager"]
    assert decision.planning_s <= 1.2 + 0.25, decision.table()
    assert sum(bool(m.by_round) for m in eager) >= len(eager) - 1, decision.table()


def test_a_short_runs_budget_holds_a_round_of_the_captured_step_too():
    import torch
    from torch import nn

    mlp = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
    batch = (torch.randn(12, 16), torch.randint(0, 3, (12,)))
    options = PlannerOptions(rounds=2, steps=3, warmup=1, cores=2, run_steps=5, use_cache=False)
    decision = search(mlp, batch, [cpu(0), cpu(1)], sleepy(0.0, 0.03, []), Plan(replicas=1, threads=2), options)
    captured = [m for m in decision.measurements if m.plan.execution == "captured"]
    assert len(captured) == 1 and captured[0].by_round, decision.table()


COMPILE_ONLY = ("eager", "compile")
"""Executions of the compile tests below (the captured step would be measured too, and is not their subject)."""


def first_step_slow(setup_s: float, step_s: float, built: list[Plan]):
    """A builder whose compiled candidates' first step sleeps ``setup_s`` more: their setup, known by construction."""
    def build(plan: Plan) -> CandidateRun:
        built.append(plan)
        pending = [setup_s if plan.execution == "compile" else 0.0]

        def step() -> None:
            time.sleep(step_s + pending.pop() if pending else step_s)
        return CandidateRun(step=step, close=lambda: None)
    return build


def search_after_a_50s_compile(budget_s: float, age_days: float | None = None) -> tuple[PlanDecision, list[Plan], str]:
    """A search of :func:`small_cnn`'s executions within ``budget_s`` after a 50 s compile setup was recorded for
    it (made to look ``age_days`` old when given): the decision, the plans built and the record's key."""
    from dlperf.parallel.planning.plan_cache import save_setup
    from dlperf.parallel.planning.planner import _setup_key

    model, batch, devices = small_cnn(), one_batch(), [cpu(0), cpu(1)]
    key = _setup_key(model, batch, devices, "compile")
    save_setup(key, 50.0)
    if age_days is not None:
        age_setup_record(key, age_days)
    built: list[Plan] = []
    options = PlannerOptions(rounds=1, steps=2, warmup=1, cores=2, run_steps=100_000, budget_s=budget_s,
                             executions=COMPILE_ONLY)
    decision = search(model, batch, devices, first_step_slow(0.0, 0.005, built), Plan(replicas=2, threads=1), options)
    return decision, built, key


def compile_skip_line(decision: PlanDecision, built: list[Plan]) -> str:
    """The one line saying why compile was not started (and it was not)."""
    assert not any(p.execution == "compile" for p in built), decision.table()
    line = [s for s in decision.skipped if s.startswith("compile:")]
    assert len(line) == 1, line
    return line[0]


def test_a_compile_whose_recorded_setup_exceeds_the_budget_left_is_not_started():
    # 50 s measured here before: more than the 40 s budget, though the guess for 4 layers (20 s) would fit
    decision, built, _ = search_after_a_50s_compile(40)
    line = compile_skip_line(decision, built)
    assert line.startswith("compile: needs ~50 s of setup (as measured here before), more than the "), line
    assert line.endswith("s left of the time budget (40.0 s)"), line
    assert decision.planning_s < 5


def test_a_measured_compile_setup_is_recorded_and_predicts_the_next_search():
    from dlperf.parallel.planning.plan_cache import recorded_setup_s
    from dlperf.parallel.planning.planner import _setup_key

    model, batch, devices = small_cnn(), one_batch(), [cpu(0), cpu(1)]
    built: list[Plan] = []
    options = PlannerOptions(rounds=1, steps=2, warmup=1, cores=2, run_steps=100_000, budget_s=30,
                             executions=COMPILE_ONLY)
    first = search(model, batch, devices, first_step_slow(0.4, 0.005, built), Plan(replicas=2, threads=1), options)
    compiled = [m for m in first.measurements if m.plan.execution == "compile"]
    assert len(compiled) == 1 and compiled[0].setup_s == pytest.approx(0.4, abs=0.25), first.table()
    assert recorded_setup_s(_setup_key(model, batch, devices, "compile")) == compiled[0].setup_s
    # another search of the model (another reference: the first decision does not answer it) with 5 s of budget:
    # the guess for its 4 layers (20 s) would not fit, what was measured does
    built.clear()
    second = search(model, batch, devices, first_step_slow(0.4, 0.005, built), Plan(replicas=1, threads=2),
                    dataclasses.replace(options, budget_s=5))
    assert not second.cached and any(p.execution == "compile" for p in built), second.table()
    assert not any(s.startswith("compile:") for s in second.skipped), second.skipped
    # without the record (the cache not used) the guess decides, and says so
    built.clear()
    third = search(model, batch, devices, first_step_slow(0.4, 0.005, built), Plan(replicas=1, threads=2),
                   dataclasses.replace(options, budget_s=5, use_cache=False))
    assert not any(p.execution == "compile" for p in built)
    guessed = "compile: needs ~20 s of setup (guessed for 4 layers)"
    assert any(s.startswith(guessed) for s in third.skipped), third.skipped


def test_the_setup_guess_scales_with_the_layers():
    from torch import nn

    from dlperf.parallel.planning.plan import EXECUTIONS, layer_count

    compile_ = EXECUTIONS.get("compile")
    assert layer_count(small_cnn()) == 4 and compile_.setup_guess_s(small_cnn()) == pytest.approx(20.0)
    deep = nn.Sequential(*[nn.Linear(8, 8) for _ in range(12)])
    assert compile_.setup_guess_s(deep) == pytest.approx(60.0)
    assert compile_.setup_guess_s(nn.Linear(2, 2)) == pytest.approx(compile_.setup_s)  # never below the least
    assert not EXECUTIONS.get("eager").has_setup and compile_.has_setup


def test_a_warm_compile_after_a_cold_one_keeps_the_cold_setup_for_the_next_search():
    from dlperf.parallel.planning.plan_cache import recorded_setup_s
    from dlperf.parallel.planning.planner import _setup_key

    model, batch, devices = small_cnn(), one_batch(), [cpu(0), cpu(1)]
    key = _setup_key(model, batch, devices, "compile")
    options = PlannerOptions(rounds=1, steps=2, warmup=1, cores=2, run_steps=100_000, budget_s=30,
                             executions=COMPILE_ONLY)
    search(model, batch, devices, first_step_slow(0.6, 0.005, []), Plan(replicas=2, threads=1), options)
    cold = recorded_setup_s(key)
    assert cold is not None and cold == pytest.approx(0.6, abs=0.3)
    # the same compile again, served from inductor's disk cache: no setup to speak of (another reference, so
    # that the first decision does not answer it)
    built: list[Plan] = []
    warm = search(model, batch, devices, first_step_slow(0.0, 0.005, built), Plan(replicas=1, threads=2), options)
    compiled = [m for m in warm.measurements if m.plan.execution == "compile"]
    assert len(compiled) == 1 and compiled[0].setup_s is not None and compiled[0].setup_s < cold, warm.table()
    assert recorded_setup_s(key) == cold  # the next search still fits the cold compile in its budget


def age_setup_record(key: str, days: float) -> None:
    """Make the setup recorded under ``key`` look measured ``days`` ago."""
    import json
    import os

    from dlperf.parallel.planning.plan_cache import default_cache_path

    path = default_cache_path()
    with open(path) as f:
        doc = json.load(f)
    doc["setups"][key]["saved"] = time.time() - days * 86400
    with open(path, "w") as f:
        json.dump(doc, f)
    os.chmod(path, 0o600)


def test_a_recorded_setup_past_its_age_no_longer_keeps_compile_out():
    from dlperf.parallel.planning.plan_cache import SETUP_RECORD_MAX_AGE_S, recorded_setup_s

    # one loaded first compile (50 s), more than the 40 s budget, recorded a day longer ago than trusted
    decision, built, key = search_after_a_50s_compile(40, age_days=SETUP_RECORD_MAX_AGE_S / 86400 + 1)
    # the guess for its 4 layers (20 s) fits: compile is measured again, and what it took replaces the record
    assert any(p.execution == "compile" for p in built), decision.table()
    assert not any(s.startswith("compile:") for s in decision.skipped), decision.skipped
    compiled = [m for m in decision.measurements if m.plan.execution == "compile"]
    assert len(compiled) == 1 and recorded_setup_s(key) == compiled[0].setup_s < 50


def test_an_expired_record_gives_way_to_the_guess_and_the_skip_line_says_so():
    from dlperf.parallel.planning.plan_cache import SETUP_RECORD_MAX_AGE_S

    days = SETUP_RECORD_MAX_AGE_S / 86400
    decision, built, _ = search_after_a_50s_compile(10, age_days=days + 1)
    line = compile_skip_line(decision, built)
    assert line.startswith(
        f"compile: needs ~20 s of setup (guessed for 4 layers; the 50 s measured here {days + 1:.0f} days ago is "
        f"older than {days:g} days), more than the "), line

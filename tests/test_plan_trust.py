"""Decisions a user can trust on a busy machine: a search timed under contention is marked, re-checked, used for
the run only and measured again next time; stale and replanned decisions; the cache listed and cleared; the
figures beside a plan are those it was decided on. Timings are constructed (a fake timer), not measured."""

from __future__ import annotations

import os
import time

import pytest
from torch import nn

from dlperf.cli import main
from dlperf.decide import judge
from dlperf.devices import cpu
from dlperf.parallel.planning import planner
from dlperf.parallel.planning.plan import Plan
from dlperf.parallel.planning.plan_cache import cached_decisions, cached_plan, default_cache_path
from dlperf.parallel.planning.planner import search
from dlperf.parallel.planning.records import CandidateRun, PlannerOptions
from dlperf.timing import Contention, ContentionSignals, Timing

REFERENCE = Plan(replicas=2, threads=1)


def fake_timer(step_ms: dict[str, float], contended: bool, calls: list[str] | None = None):
    """``time_steps`` as the planner calls it, each candidate taking its fixed time (by the plan its step runs)."""
    signals = ContentionSignals(wall_s=1.0, cpu_s=1.0, threads=1, cores=2, run_s=0.5, wait_s=0.5, others_mean=3.0,
                                others_max=3, load1=4.0)
    verdict = Contention(contended, "two busy processes" if contended else None, signals)

    def time_steps(step, *, warmup, steps, synchronize=lambda: None, on_step=None, max_seconds=None, min_steps=3,
                   threads=None):
        name = step()
        if calls is not None:
            calls.append(name)
        seconds = step_ms[name] / 1e3
        return Timing.from_samples([seconds] * max(steps, 1), [seconds] * warmup, verdict)

    return time_steps


def builder(built: list[Plan]):
    def build(plan: Plan) -> CandidateRun:
        built.append(plan)
        return CandidateRun(step=lambda: plan.name, close=lambda: None)
    return build


def _model_and_batch():
    import torch

    return nn.Sequential(nn.Linear(4, 3)), (torch.randn(8, 4), torch.randint(0, 3, (8,)))


def test_a_contended_decision_is_marked_used_this_run_only_and_measured_again_next_time(monkeypatch):
    model, batch = _model_and_batch()
    fast = "1x2,contiguous,eager,caller"
    times = {REFERENCE.name: 10.0, fast: 5.0}
    options = PlannerOptions(rounds=2, steps=2, cores=2, keep=2)
    monkeypatch.setattr(planner, "time_steps", fake_timer({**times, "default": 10.0}, contended=True))
    monkeypatch.setattr(planner, "enumerate_plans", lambda *a: ([REFERENCE, Plan.from_dict(
        {"replicas": 1, "threads": 2, "step_thread": "caller"})], []))
    built: list[Plan] = []
    first = search(model, batch, [cpu(0), cpu(1)], builder(built), REFERENCE, options)
    assert first.contended and first.plan.name == fast  # it still won its round of re-checking
    assert any("contended: the winner beat the reference again" in r for r in first.plan.reasons)
    assert "contended: this run only" in first.provenance()
    entry = cached_decisions()[0]
    assert entry["contended"] and not entry["used"]
    built.clear()
    again = search(model, batch, [cpu(0), cpu(1)], builder(built), REFERENCE, options)
    assert not again.cached and built  # measured again, not reused


def test_a_contended_winner_that_does_not_win_again_leaves_the_reference(monkeypatch):
    model, batch = _model_and_batch()
    fast = "1x2,contiguous,eager,caller"
    times = {REFERENCE.name: 10.0, fast: 5.0}
    monkeypatch.setattr(planner, "time_steps", fake_timer(times, contended=True))
    recheck = planner._recheck

    def the_gain_was_the_loads(*args):  # in the round of re-checking, the candidate is no faster
        times[fast] = 10.5
        return recheck(*args)

    monkeypatch.setattr(planner, "_recheck", the_gain_was_the_loads)
    monkeypatch.setattr(planner, "enumerate_plans", lambda *a: ([REFERENCE, Plan.from_dict(
        {"replicas": 1, "threads": 2, "step_thread": "caller"})], []))
    decision = search(model, batch, [cpu(0), cpu(1)], builder([]), REFERENCE,
                      PlannerOptions(rounds=2, steps=1, warmup=1, cores=2, use_cache=False))
    assert decision.contended and decision.plan == REFERENCE
    assert any("did not beat the reference again" in r for r in decision.plan.reasons)


def test_a_quiet_decision_is_cached_and_reused_unless_replanned_or_stale(monkeypatch, tmp_path):
    model, batch = _model_and_batch()
    fast = "1x2,contiguous,eager,caller"
    monkeypatch.setattr(planner, "time_steps", fake_timer({REFERENCE.name: 10.0, fast: 5.0}, contended=False))
    monkeypatch.setattr(planner, "enumerate_plans", lambda *a: ([REFERENCE, Plan.from_dict(
        {"replicas": 1, "threads": 2, "step_thread": "caller"})], []))
    options = PlannerOptions(rounds=2, steps=1, cores=2)
    first = search(model, batch, [cpu(0), cpu(1)], builder([]), REFERENCE, options)
    assert not first.contended and first.provenance().startswith("planned now in")
    again = search(model, batch, [cpu(0), cpu(1)], builder([]), REFERENCE, options)
    assert again.cached and again.plan == first.plan and again.provenance().startswith("cached from 20")
    built: list[Plan] = []
    search(model, batch, [cpu(0), cpu(1)], builder(built), REFERENCE,
           PlannerOptions(rounds=2, steps=1, cores=2, replan=True))
    assert built  # replan measures again
    # a probe saved after the decision makes it stale: the machine's figures changed
    from dlperf.probe import cache as probe_cache

    probe_file = tmp_path / "probe.json"
    probe_file.write_text("{}")
    later = time.time() + 5
    os.utime(probe_file, (later, later))
    monkeypatch.setattr(probe_cache, "cache_path", lambda info=None: str(probe_file))
    assert cached_plan(next(iter(e["key"] for e in cached_decisions()))) is None
    assert not cached_decisions()[0]["used"]


def test_the_figures_beside_a_plan_are_those_it_was_decided_on():
    # per round: the reference was slowed in round 0, so B's best round looks faster than it is
    verdict = judge({"ref": [20.0, 10.0, 10.0], "A": [7.0, 7.2, 7.1], "B": [5.0, 9.9, 10.1]}, "ref")
    assert verdict.chosen == "A"
    found = []
    for name, rounds in (("ref", [20.0, 10.0, 10.0]), ("A", [7.0, 7.2, 7.1]), ("B", [5.0, 9.9, 10.1])):
        m = planner.Measurement(Plan(replicas=1, threads={"ref": 1, "A": 2, "B": 4}[name] if name != "B" else 1,
                                     memory_format="channels_last" if name == "B" else "contiguous"))
        for i, ms in enumerate(rounds):
            m.record(i, ms, False)
        found.append(m)
    figures = planner._figures(found)
    assert figures[id(found[0])] == 10.0
    assert figures[id(found[1])] == pytest.approx(10.0 * 0.71, rel=1e-6)  # the median ratio, as decided
    assert figures[id(found[2])] > figures[id(found[1])]  # B's 5 ms round was the slowed reference's


def test_dlperf_plans_lists_and_clears_the_cache(monkeypatch, capsys):
    model, batch = _model_and_batch()
    monkeypatch.setattr(planner, "time_steps", fake_timer({REFERENCE.name: 10.0, "default": 10.0}, contended=False))
    monkeypatch.setattr(planner, "enumerate_plans", lambda *a: ([REFERENCE], []))
    search(model, batch, [cpu(0), cpu(1)], builder([]), REFERENCE, PlannerOptions(rounds=1, steps=1, cores=2))
    assert main(["plans"]) == 0
    out = capsys.readouterr().out
    assert REFERENCE.name in out and "Sequential on float32[8,4]" in out and "used" in out
    assert main(["plans", "--clear"]) == 0
    assert "cleared 1 cached decision" in capsys.readouterr().out
    assert not os.path.exists(default_cache_path())
    assert main(["plans"]) == 0 and "no cached decision" in capsys.readouterr().out

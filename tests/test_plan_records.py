"""What the plan cache keeps beside decisions: each execution's measured setup, and the decision made for a model
when plans whose replicas are processes could be measured (which a Trainer planning in one process names when
it is faster). Entries are data, checked field by field; a bad one is ignored with one line."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import torch
from torch import nn

from dlperf.devices import cpu
from dlperf.parallel import Trainer
from dlperf.parallel.planning.plan import Plan
from dlperf.parallel.planning.plan_cache import (
    cached_plan,
    default_cache_path,
    processes_offer,
    recorded_setup_s,
    save_plan,
    save_processes_offer,
    save_setup,
)
from dlperf.parallel.planning.planner import search
from dlperf.parallel.planning.process_plans import measuring_processes
from dlperf.parallel.planning.records import CandidateRun, PlannerOptions

ONE_ROUND = PlannerOptions(rounds=1, steps=2, warmup=1, cores=2, executions=("eager",))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 16, generator=g), torch.randint(0, 3, (32,), generator=g)


def processes_step_s(processes_s: float, threads_s: float):
    """A builder whose process plans step in ``processes_s`` and the others in ``threads_s`` (no process started)."""
    def build(plan: Plan) -> CandidateRun:
        seconds = processes_s if plan.launcher == "processes" else threads_s
        # no step at all for 0 s: a sleep of 0 s yields the core, and a loaded machine gives it back late
        return CandidateRun(step=(lambda: time.sleep(seconds)) if seconds else (lambda: None), close=lambda: None)
    return build


def decide_with_processes(processes_s: float, threads_s: float) -> Plan:
    """What ``dlperf train --plan auto`` does first: a search that measures process plans too, cached."""
    with measuring_processes(True):
        decision = search(mlp(), batch(), [cpu(0)], processes_step_s(processes_s, threads_s),
                          Plan(replicas=1, threads=2), ONE_ROUND)
    return decision.plan


def trainer_plans(caplog, planner: PlannerOptions = ONE_ROUND, devices=None) -> tuple[Plan, str]:
    """A Trainer planning in one process on the same model and batch: its plan and what it said."""
    caplog.clear()
    with Trainer(mlp(), devices or [cpu(0)], "sgd", {"lr": 0.01}, plan="auto", planner=planner) as trainer:
        trainer.train_step(*batch())
        plan = trainer.plan
    assert plan is not None and plan.launcher == "threads"
    return plan, "\n".join(r.getMessage() for r in caplog.records)


def test_a_trainer_in_one_process_names_the_faster_processes_plan_and_how_to_get_it(caplog):
    # by construction the process plan's step does nothing: faster than any real step of the Trainer's
    offered = decide_with_processes(0.0, 0.02)
    assert offered.launcher == "processes"
    plan, said = trainer_plans(caplog)
    lines = [line for line in said.splitlines() if offered.name in line]
    assert len(lines) == 1, said
    assert lines[0].startswith(f"plan: {offered.name} was measured faster (") and f"{plan.measured_ms:.2f})" in lines[0]
    assert f"give it plan={offered.name!r} and run under dlperf launch --nproc-per-node 2" in lines[0]
    assert f"dlperf train --nproc-per-node 2 --plan {offered.name}" in lines[0]
    # the next Trainer says it again (from the cached decision, or measured again where the first was contended)
    _, again = trainer_plans(caplog)
    assert lines[0].split(" (")[0] in again and lines[0].split(") where")[1] in again


def test_a_trainer_says_nothing_without_a_faster_processes_plan(caplog):
    _, said = trainer_plans(caplog)  # no decision made with processes allowed
    assert "processes" not in said, said
    # one made with processes allowed that kept threads (its process plans were slower) names nothing either
    kept = decide_with_processes(0.5, 0.0)
    assert kept.launcher == "threads"
    _, again = trainer_plans(caplog)  # its own decision cached now: the same question asked again
    assert "processes" not in again, again


def test_a_processes_plan_measured_with_other_cores_or_devices_is_not_named(caplog):
    offered = decide_with_processes(0.0, 0.02)  # 2 cores, one device
    assert offered.launcher == "processes"
    # the same model and batch, but other candidates: a 2 x 1 processes plan is no option on one core, and
    # two devices change the reference the times were taken beside
    _, said = trainer_plans(caplog, dataclasses.replace(ONE_ROUND, cores=1))
    assert "processes" not in said, said
    _, said = trainer_plans(caplog, devices=[cpu(0), cpu(1)])
    assert "processes" not in said, said
    _, said = trainer_plans(caplog)  # what it was decided for: named
    assert offered.name in said, said


def test_a_warm_setup_measured_after_a_cold_one_keeps_the_cold_figure():
    save_setup("s1", 150.0)  # a first compile
    save_setup("s1", 2.0)  # the same compile served from inductor's disk cache
    assert recorded_setup_s("s1") == 150.0
    save_setup("s1", 160.0)  # a slower one is what the next search must fit
    assert recorded_setup_s("s1") == 160.0


def test_a_setup_record_past_its_age_is_replaced_by_the_next_one_measured():
    from dlperf.parallel.planning.plan_cache import SETUP_RECORD_MAX_AGE_S, setup_record

    long_ago = time.time() - SETUP_RECORD_MAX_AGE_S - 60
    write({"format": 1, "plans": {}, "setups": {"s1": {"seconds": 150.0, "saved": long_ago}}})
    assert setup_record("s1") == (150.0, long_ago)
    save_setup("s1", 2.0)
    seconds, saved = setup_record("s1") or (None, 0.0)
    assert seconds == 2.0 and saved > long_ago


def test_setups_and_offers_sit_beside_the_decisions_in_one_file():
    plan = Plan(replicas=2, threads=1, launcher="processes").with_figures(3.0, [("1 x 2", 4.0)])
    save_plan("k1", Plan(replicas=1, threads=2).with_figures(5.0, []))
    save_setup("s1", 12.5)
    save_processes_offer("m1", plan)
    assert recorded_setup_s("s1") == 12.5 and recorded_setup_s("nothing") is None
    assert processes_offer("m1") == plan and processes_offer("m1").measured_ms == 3.0
    assert cached_plan("k1") == Plan(replicas=1, threads=2)
    with open(default_cache_path()) as f:
        doc = json.load(f)
    assert set(doc) == {"format", "plans", "setups", "with_processes"} and doc["format"] == 1


def test_an_older_file_without_the_new_sections_still_reads(capsys):
    save_plan("k1", Plan(replicas=1, threads=2).with_figures(5.0, []))
    with open(default_cache_path()) as f:
        assert set(json.load(f)) == {"format", "plans"}
    assert recorded_setup_s("s1") is None and processes_offer("m1") is None
    save_setup("s1", 1.0)
    assert cached_plan("k1") is not None and recorded_setup_s("s1") == 1.0
    assert capsys.readouterr().err == ""


def write(doc: object) -> None:
    path = default_cache_path()
    with open(path, "w") as f:
        json.dump(doc, f)
    os.chmod(path, 0o600)


def test_a_bad_setup_entry_is_ignored_with_one_line(capsys):
    good = {"seconds": 3.0, "saved": 1.0}
    for bad in ({"seconds": "__import__('os').system('true')", "saved": 1.0}, {"seconds": -1, "saved": 1.0},
                {"seconds": 1e300, "saved": 1.0}, {"seconds": True, "saved": 1.0}, {"seconds": 1.0}, [1.0], None):
        write({"format": 1, "plans": {}, "setups": {"s1": bad, "s2": good}})
        assert recorded_setup_s("s1") is None, bad
        err = capsys.readouterr().err
        assert err.count("\n") <= 1 and ("setup s1: " in err or bad is None), (bad, err)
        assert recorded_setup_s("s2") == 3.0  # the others stay usable
    # a section of the wrong shape: the whole file is distrusted, in one line
    write({"format": 1, "plans": {}, "setups": ["s1"]})
    assert recorded_setup_s("s1") is None
    err = capsys.readouterr().err
    assert "'setups' is not an object" in err and err.count("\n") <= 1


def test_a_bad_offer_is_ignored_with_one_line(capsys):
    write({"format": 1, "plans": {}, "with_processes": {"m1": {"plan": "os.system", "measured_ms": 1.0,
                                                                "alternatives": [], "saved": 1.0}}})
    assert processes_offer("m1") is None
    err = capsys.readouterr().err
    assert "ignoring plan cache" in err and err.count("\n") <= 1


def test_full_sections_stay_inside_the_files_size_limit(monkeypatch):
    from dlperf.parallel.planning import plan_cache

    # every section at its most, each plan with its most alternatives: the file still reads back
    plan = Plan(replicas=2, threads=1, launcher="processes").with_figures(
        3.0, [(f"{i} x 1, processes, worker, contiguous, compile", 4.0 + i) for i in range(16)])
    sections = {"plans": {f"p{i:030d}": {**plan_cache._plan_entry(plan), "saved": 1.0}
                          for i in range(plan_cache.MAX_ENTRIES)},
                "setups": {f"s{i:030d}": {"seconds": 12345.678, "saved": 1.0} for i in range(plan_cache.MAX_ENTRIES)},
                "with_processes": {f"m{i:030d}": {**plan_cache._plan_entry(plan), "saved": 1.0}
                                   for i in range(plan_cache.MAX_ENTRIES // 4)}}
    with monkeypatch.context() as patched:  # one write of full sections, not 600 writes of a growing file
        patched.setattr(plan_cache, "_read_sections", lambda path: (sections, True))
        save_processes_offer("m-new", plan)  # one beyond the quarter: the oldest goes
    assert len(sections["with_processes"]) == plan_cache.MAX_ENTRIES // 4
    assert os.path.getsize(default_cache_path()) < plan_cache.MAX_BYTES
    assert processes_offer("m-new") == plan and recorded_setup_s(f"s{0:030d}") == 12345.678

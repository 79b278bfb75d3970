"""Plans from outside the run (the plan cache, a checkpoint, ``--plan``) are checked against this machine and this
run: one that cannot run here is ignored with one line naming where it came from, and the run goes on."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

from dlperf.devices import Device, cpu
from dlperf.parallel import Trainer
from dlperf.parallel.planning.plan import Plan, parse_plan
from dlperf.parallel.planning.plan_cache import default_cache_path
from dlperf.parallel.planning.plan_check import Here, keep_usable_plan, plan_problem, usable_here
from dlperf.parallel.planning.planner import search
from dlperf.parallel.planning.records import CandidateRun, PlannerOptions

CPU = Here(devices=[cpu(0)], batch_size=16, cores=2)
GPUS = Here(devices=[Device("gpu", 0), Device("gpu", 1)], batch_size=16, cores=2, allow_mixed_precision=True)


@pytest.mark.parametrize("name, here, problem", [
    ("1x3", CPU, "3 threads for each replica, more than the 2 cores"),
    ("1x1024", CPU, "1024 threads for each replica"),
    ("17x1", CPU, "17 replicas, more than the 16 examples of a batch"),
    ("1x1,bf16", CPU, "bf16 mixed precision, which is planned for GPUs, on CPU devices"),
    ("2x1,bf16", Here(devices=GPUS.devices, cores=2), "bf16 mixed precision, which changes the numerics"),
    ("2x1,fp16", GPUS, "fp16, which needs loss scaling"),
    ("1x1,kvstore-dist_sync", CPU, "kvstore dist_sync, a distributed store, which needs several processes"),
    ("1x1,kvstore-nosuch", CPU, "kvstore 'nosuch', not a store type here"),
    ("2x1,processes,kvstore-local", CPU, "kvstore local, which sums one process's devices only, across 2"),
    ("1x1,kvstore-local", Here(devices=[cpu(0)], kvstore=None, cores=2), "this run's state is laid out for allreduce"),
    ("1x2", GPUS, "1 replicas, but 2 GPUs were given"),
    ("2x1,processes", Here(devices=[cpu(0)], processes=3, cores=2), "2 processes, but this run trains as 3"),
    ("2x1,processes", Here(devices=[cpu(0)], can_launch=False, cores=2), "2 processes, which this run cannot start"),
    ("1x1", Here(devices=[cpu(0)], processes=2, cores=2), "threads of one process, but this run trains as 2"),
    ("1x1,captured", Here(devices=[cpu(0)], check_finite=True, cores=2), "cannot hold its update back"),
    ("1x1,compile", Here(devices=[cpu(0)], executions=["eager"], cores=2), "execution compile, not one of"),
    ("2x1,caller", None, None),  # (refused by Plan itself)
])
def test_each_rule_names_the_values(name, here, problem):
    if here is None:
        with pytest.raises(Exception, match="calling thread runs one replica"):
            parse_plan(name)
        return
    found = plan_problem(parse_plan(name), here)
    assert found is not None and problem in found, found


def test_plans_that_fit_pass():
    for name in ("1x1", "1x2", "2x1", "16x1", "1x2,channels-last,compile", "2x1,processes", "1x1,kvstore-local"):
        assert plan_problem(parse_plan(name), CPU) is None, name
    for name in ("2x1", "2x1,bf16"):
        assert plan_problem(parse_plan(name), GPUS) is None, name
    pinned = Plan(replicas=2, threads=1, cudnn_benchmark=True, pin_memory=True)
    assert plan_problem(pinned, GPUS) is None
    assert "for GPUs, on CPU devices" in plan_problem(pinned, CPU)


def test_an_unusable_plan_is_one_line_once_naming_its_source(capsys):
    plan = parse_plan("1x1024")
    for _ in range(3):
        assert usable_here(plan, CPU, "the plan cache /x/plans.json", "planning again") is None
    err = capsys.readouterr().err
    assert err == ("dlperf plan: ignoring the plan 1x1024,contiguous,eager from the plan cache /x/plans.json: 1024 "
                   "threads for each replica, more than the 2 cores this process may use; planning again\n")
    assert usable_here(parse_plan("1x2"), CPU, "the plan cache", "planning again") == parse_plan("1x2")


def _sleepy(built: list[Plan]):
    def build(plan: Plan) -> CandidateRun:
        built.append(plan)
        return CandidateRun(step=lambda: time.sleep(0.002), close=lambda: None)
    return build


@pytest.mark.parametrize("change, named", [
    ({"threads": 1024}, "1024 threads for each replica"),
    ({"kvstore": "dist_sync"}, "kvstore dist_sync, a distributed store"),
    ({"kvstore": "nosuch"}, "kvstore 'nosuch', not a store type here"),
    ({"mixed_precision": "bf16"}, "bf16 mixed precision"),
    ({"mixed_precision": "fp16"}, "fp16, which needs loss scaling"),
    ({"replicas": 64, "threads": 1, "step_thread": "worker", "execution": "eager"}, "64 replicas, more than the 12"),
])
def test_a_cached_plan_that_cannot_run_here_is_planned_again(change, named, capsys):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    batch = (torch.randn(12, 8), torch.randint(0, 3, (12,)))
    options = PlannerOptions(rounds=1, steps=1, cores=2)
    first = search(model, batch, [cpu(0)], _sleepy([]), Plan(replicas=1, threads=2), options)
    path = default_cache_path()
    with open(path) as f:
        doc = json.load(f)
    (entry,) = doc["plans"].values()
    entry["plan"].update(change)
    with open(path, "w") as f:
        json.dump(doc, f)
    built: list[Plan] = []
    again = search(model, batch, [cpu(0)], _sleepy(built), Plan(replicas=1, threads=2), options)
    assert not again.cached and built and plan_problem(again.plan, CPU) is None
    err = [ln for ln in capsys.readouterr().err.splitlines() if "ignoring" in ln]
    assert len(err) == 1 and f"from the plan cache {path}: " in err[0] and named in err[0], err
    assert first.plan == again.plan or again.plan.measured_ms is not None


def test_a_checkpoints_plan_that_cannot_run_here_is_dropped_and_its_buffers_fit_the_devices(capsys):
    bn = nn.BatchNorm1d(4)
    state = {"plan": parse_plan("3x1,bf16").to_dict(), "buffers": [dict(bn.named_buffers())] * 3}
    keep_usable_plan(state, Here(devices=[cpu(0), cpu(1)], cores=2), "the checkpoint ck.pt")
    assert "plan" not in state and len(state["buffers"]) == 2
    assert "from the checkpoint ck.pt: bf16 mixed precision" in capsys.readouterr().err
    fits = {"plan": parse_plan("2x1").to_dict(), "buffers": [{}, {}]}
    keep_usable_plan(fits, Here(devices=[cpu(0)], cores=2), "the checkpoint ck.pt")
    assert fits["plan"] == parse_plan("2x1").to_dict() and len(fits["buffers"]) == 2


def test_a_trainer_does_not_take_over_a_loaded_plan_that_cannot_run_here(capsys):
    model = nn.Sequential(nn.Linear(8, 3))
    with Trainer(model, [cpu(0)], plan=None) as trainer:
        state = trainer.state_dict()
        state["plan"] = Plan(replicas=1, threads=1024).to_dict()
        trainer.load_state_dict(state)
        assert trainer.planning.plan is None
    assert "ignoring the plan 1x1024,contiguous,eager from the state given to load_state_dict" in \
        capsys.readouterr().err

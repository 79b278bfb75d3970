"""A strategy of one's own, registered in one file (tests/support/sum_on_first.py), chosen by name from the Trainer,
the CLI and the planner; and the built-in ones refuse options they cannot serve, in one line."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from dlperf.cli import main
from dlperf.devices import cpu
from dlperf.errors import UsageError
from dlperf.parallel import Trainer
from dlperf.parallel.planning.plan import parse_plan
from dlperf.parallel.planning.records import PlannerOptions
from dlperf.parallel.training.planned import plan_for


@pytest.fixture(autouse=True)
def sum_on_first():
    """The strategy's module imported for each test (its import registers it), and forgotten after: the other
    tests see the built-in strategies only."""
    import importlib
    import sys

    from dlperf.parallel.strategies import STRATEGIES

    module = importlib.import_module("support.sum_on_first")
    yield module.SumOnFirst
    STRATEGIES.remove("sum-on-first")
    sys.modules.pop("support.sum_on_first", None)


def batches(n: int = 4):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def plain(model: nn.Module, data) -> nn.Module:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for X, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    return model


def test_the_trainer_takes_a_registered_strategy_by_name_and_it_trains_as_a_plain_loop(sum_on_first):
    SumOnFirst = sum_on_first
    torch.manual_seed(0)
    model, data = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)), batches()
    before = SumOnFirst.calls
    with Trainer(copy.deepcopy(model), [cpu(0), cpu(1)], "sgd", {"lr": 0.1}, strategy="sum-on-first") as trainer:
        assert trainer.strategy.name == "sum-on-first"
        for X, y in data:
            trainer.train_step(X, y)
        for p, q in zip(trainer.module.parameters(), plain(model, data).parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert trainer.max_replica_difference() == 0.0
    assert SumOnFirst.calls - before == len(data)
    with Trainer(nn.Linear(2, 2), [cpu(0), cpu(1)], "sgd", {"lr": 0.1}, strategy=SumOnFirst) as trainer:
        assert isinstance(trainer.strategy, SumOnFirst)


def test_the_cli_takes_it_by_name_or_as_module_and_class(capsys, sum_on_first):
    SumOnFirst = sum_on_first
    before = SumOnFirst.calls
    common = ["train", "--devices", "cpu:0,cpu:1", "--epochs", "1", "--batch-size", "64", "--train-size", "128",
              "--test-size", "64", "--no-progress"]
    assert main([*common, "--strategy", "sum-on-first"]) == 0
    assert main([*common, "--strategy", "support.sum_on_first:SumOnFirst"]) == 0
    assert SumOnFirst.calls - before == 4  # two steps a run
    assert capsys.readouterr().out.splitlines()[-1].startswith("test acc: ")


def test_the_planner_measures_it_and_a_plan_can_name_it():
    model, (X, y) = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)), batches(1)[0]
    options = PlannerOptions(rounds=1, steps=1, warmup=0, use_cache=False, cores=2, strategies=["sum-on-first"])
    decision = plan_for(model, (X, y), [cpu(0), cpu(1)], options=options)
    named = [m for m in decision.measurements if m.plan.strategy == "sum-on-first"]
    assert named and all(m.plan.replicas > 1 for m in named) and any(m.ms is not None for m in named)
    plan = parse_plan("2x1,strategy-sum-on-first")
    assert plan.strategy == "sum-on-first" and parse_plan(plan.name) == plan
    with Trainer(nn.Linear(5, 3), [cpu(0)], "sgd", {"lr": 0.1}, plan=plan) as trainer:
        assert trainer.strategy.name == "sum-on-first" and trainer.k == 2


@pytest.mark.parametrize("strategy, options, words", [
    ("one-device", {}, "strategy='one-device' with 2 device(s) in 1 process(es): it trains one device"),
    ("processes", {}, "it needs several processes"),
    ("kvstore", {}, "it needs a local store in one process"),
    ("parameter-servers", {"kvstore": "local"}, "it needs a distributed store"),
    ("allreduce", {"kvstore": "local"}, "it has no store"),
    ("nonesuch", {}, "unknown gradient synchronization strategy 'nonesuch'"),
])
def test_a_named_strategy_that_cannot_serve_the_options_is_one_line(strategy, options, words):
    with pytest.raises(UsageError, match=re.escape(words)) as info:
        Trainer(nn.Linear(2, 2), [cpu(0), cpu(1)], "sgd", {"lr": 0.1}, strategy=strategy, **options).close()
    assert "\n" not in str(info.value)

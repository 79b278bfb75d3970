"""Plans whose execution is the captured training step (``dlperf.hybrid.train_step``): same weights as the
plain loop, checkpoints, refusals, and the planner's choice of it read against what it measured."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from dlperf.devices import cpu
from dlperf.errors import UsageError
from dlperf.parallel import Trainer
from dlperf.parallel.planning.plan import parse_plan
from dlperf.parallel.planning.planner import _decide
from dlperf.parallel.planning.records import PlannerOptions
from dlperf.parallel.training.planned import plan_for

OPTIMIZERS = {"sgd-momentum": ("sgd", {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}),
              "adam": ("adam", {"lr": 1e-3})}


def seed() -> int:
    value = int.from_bytes(os.urandom(4), "little")
    print(f"seed {value}")  # shown when a test fails: the inputs are fresh each run
    return value


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 3))


def fresh_batches(n: int, rows: int, seed_: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed_)
    return [(torch.randn(rows, 32, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(n)]


def plain_run(model: nn.Module, optimizer: str, params: dict, batches) -> tuple[nn.Module, torch.optim.Optimizer,
                                                                                  list[float]]:
    """The oracle: eager PyTorch, one device, the whole batch."""
    net = copy.deepcopy(model)
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)(net.parameters(), **params)
    losses = []
    for X, y in batches:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(X), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return net, opt, losses


def assert_same(got: nn.Module, want: nn.Module) -> None:
    for (name, a), b in zip(got.state_dict().items(), want.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("where", ["caller", "worker"])
@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
def test_captured_plan_reaches_the_plain_loops_weights(which, where):
    optimizer, params = OPTIMIZERS[which]
    torch.manual_seed(seed())
    model = mlp()
    batches = fresh_batches(12, 4, seed())
    name = "1x1,captured" + (",caller" if where == "caller" else "")
    with Trainer(copy.deepcopy(model), [cpu(0)], optimizer, params, plan=name) as trainer:
        losses = [float(trainer.train_step(X, y)) for X, y in batches]
        assert trainer.plan == parse_plan(name) and trainer.steps == len(batches)
        assert trainer._whole_step.state == "replay", repr(trainer._whole_step)  # captured, not eager
        net, opt, want = plain_run(model, optimizer, params, batches)
        torch.testing.assert_close(losses, want, rtol=1e-4, atol=1e-5)
        assert_same(trainer.module, net)
        # the optimizer's state lives in the Trainer's optimizer, where checkpoints read it
        mine = trainer.state_dict()["optimizer"]["state"]
        for i, s in opt.state_dict()["state"].items():
            for k, v in s.items():
                torch.testing.assert_close(mine[i][k], v, rtol=1e-4, atol=1e-5, msg=f"{i}.{k}")


def test_a_captured_checkpoint_resumes_where_it_stopped():
    optimizer, params = OPTIMIZERS["adam"]
    torch.manual_seed(seed())
    model = mlp()
    batches = fresh_batches(8, 4, seed())
    with Trainer(copy.deepcopy(model), [cpu(0)], optimizer, params, plan="1x1,captured,caller") as first:
        for X, y in batches[:4]:
            first.train_step(X, y)
        state = first.state_dict()
    assert state["plan"] == parse_plan("1x1,captured,caller").to_dict()
    with Trainer(mlp(), [cpu(0)], optimizer, params) as resumed:  # no plan given: the checkpoint's is taken
        resumed.load_state_dict(state)
        assert resumed.plan == parse_plan("1x1,captured,caller")
        for X, y in batches[4:]:
            resumed.train_step(X, y)
        assert resumed.steps == len(batches)
        assert_same(resumed.module, plain_run(model, optimizer, params, batches)[0])


def test_captured_plans_it_cannot_honour_are_refused_in_one_line():
    for kwargs, plan, words in (({}, "2x1,captured", "runs one replica"),
                                ({"check_finite": True}, "1x1,captured", "check_finite"),
                                ({"kvstore": "local"}, "1x1,captured", "kvstore='local'")):
        with pytest.raises(UsageError, match=words) as info:
            Trainer(mlp(), [cpu(0)], "sgd", {"lr": 0.1}, plan=plan, **kwargs)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("rows", [1, 4])
def test_the_planner_tries_captured_and_its_choice_follows_what_it_measured(rows, tmp_path):
    """d2l's MLP at a small batch: whether captured wins is measured, so assert the choice agrees with the
    figures the decision records, not with a timing that load could flip."""
    from dlperf.models.fcn import mlp as d2l_mlp

    batch = (torch.randn(rows, 512), torch.randint(0, 2, (rows,)))
    options = PlannerOptions(rounds=3, steps=3, cache_path=str(tmp_path / "plans.json"))
    decision = plan_for(d2l_mlp(), batch, options=options)
    by_name = {m.plan.name: m for m in decision.measurements}
    captured = [m for m in decision.measurements if m.plan.execution == "captured"]
    # measured, or dropped in the rare moment its own timing found the replay no faster than eager
    assert len(captured) == 1 and (captured[0].ms is not None or captured[0].note.startswith("dropped")), \
        decision.table()
    assert captured[0].plan.replicas == 1
    reference = decision.measurements[0]
    assert decision.plan == _decide(decision.measurements, None, [])[0].plan, decision.table()
    if decision.plan.execution == "captured":
        assert max(by_name[decision.plan.name].ratios(reference)) < 1, decision.table()
    if captured[0].ms is not None:
        assert "captured" in decision.plan.line() or any("captured" in n for n, _ in decision.plan.alternatives)


def test_auto_with_captured_reaches_the_plain_loops_weights(tmp_path):
    optimizer, params = OPTIMIZERS["sgd-momentum"]
    torch.manual_seed(seed())
    model = mlp()
    batches = fresh_batches(6, 2, seed())
    options = PlannerOptions(rounds=2, steps=2, cache_path=str(tmp_path / "plans.json"))
    with Trainer(copy.deepcopy(model), [cpu(0)], optimizer, params, plan="auto", planner=options) as trainer:
        for X, y in batches:
            trainer.train_step(X, y)
        assert any(m.plan.execution == "captured" for m in trainer.planning.decision.measurements)
        assert_same(trainer.module, plain_run(model, optimizer, params, batches)[0])


def test_a_traced_one_replica_step_still_runs_as_an_engine_operation(tmp_path):
    """The calling thread's step skips the engine only while no timeline is recorded."""
    X, y = fresh_batches(1, 4, 0)[0]
    with Trainer(mlp(), [cpu(0)], "sgd", {"lr": 0.1}, plan="1x1,caller") as trainer:
        trainer.train_step(X, y)
        trainer.start_trace()
        trainer.train_step(X, y)
        names = [e.name for e in trainer.stop_trace().events]
        trainer.train_step(X, y)
        assert trainer.steps == 3
    assert any(n.startswith("fwd+bwd") for n in names), names


def test_a_captured_candidate_that_serves_the_eager_step_is_dropped(tmp_path):
    """A plan is never chosen for another plan's speed: a step that cannot be captured runs eagerly, and the
    planner says so instead of measuring it as captured."""
    import warnings

    from dlperf.hybrid.hybridize import HybridizeWarning

    model = mlp()
    model[0].register_forward_hook(lambda module, args, out: None)  # hooks: the captured step runs eagerly
    batch = fresh_batches(1, 4, 0)[0]
    options = PlannerOptions(rounds=2, steps=2, cache_path=str(tmp_path / "plans.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HybridizeWarning)
        decision = plan_for(model, batch, options=options)
    captured = [m for m in decision.measurements if m.plan.execution == "captured"]
    assert len(captured) == 1 and captured[0].note.startswith("dropped: its step runs eagerly"), decision.table()
    assert captured[0].ms is None and decision.plan.execution != "captured"


def test_auto_with_check_finite_never_adopts_a_captured_plan(tmp_path):
    options = PlannerOptions(rounds=2, steps=2, cache_path=str(tmp_path / "plans.json"))
    X, y = fresh_batches(1, 2, 0)[0]
    with Trainer(mlp(), [cpu(0)], "sgd", {"lr": 0.1}, plan="auto", planner=options, check_finite=True) as trainer:
        trainer.train_step(X, y)
        assert trainer.plan.execution != "captured"
        captured = [m for m in trainer.planning.decision.measurements if m.plan.execution == "captured"]
        assert captured and captured[0].note.startswith("failed: UsageError") and "check_finite" in captured[0].note

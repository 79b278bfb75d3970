"""The Trainer's one-replica step under a plan does the plain loop's work and no more: the same operators
(counted by torch's profiler), the plan's intra-op threads inside the step, and the plain loop's weights."""

from __future__ import annotations

import copy
import os
from collections import Counter

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from dlperf._threads import intra_op_threads
from dlperf.devices import cpu
from dlperf.parallel import Trainer
from dlperf.parallel.planning.plan import parse_plan

LR = 0.05


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(8 * 4 * 4, 5))


def fresh_batches(n: int, seed: int, channels_last: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        X = torch.randn(12, 3, 8, 8, generator=g)
        out.append((X.contiguous(memory_format=torch.channels_last) if channels_last else X,
                    torch.randint(0, 5, (12,), generator=g)))
    return out


def seed() -> int:
    value = int.from_bytes(os.urandom(4), "little")
    print(f"seed {value}")  # shown when a test fails: the inputs are fresh each run
    return value


class PlainLoop:
    """The hand-written loop making the plan's choices: its layout, its threads, SGD as the Trainer builds it."""

    def __init__(self, model: nn.Module, channels_last: bool) -> None:
        self.model = copy.deepcopy(model)
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, foreach=True)

    def step(self, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(self.model(X), y)
        loss.backward()
        self.opt.step()
        return loss.detach()


def operator_counts(step, batches) -> Counter:
    """How many times each aten operator ran over ``batches`` (detach aside: the Trainer returns a detached
    loss, the plain loop here too, but where each detaches differs between torch versions)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for X, y in batches:
            step(X, y)
    return Counter({e.key: e.count for e in prof.key_averages()
                    if e.key.startswith("aten::") and e.key != "aten::detach"})


PLANS = ["1x1,contiguous,eager,caller", "1x2,channels-last,eager,caller", "1x2,contiguous,eager,caller"]


@pytest.mark.parametrize("name", PLANS)
def test_a_one_replica_plan_runs_the_plain_loops_operators_and_reaches_its_weights(name):
    plan = parse_plan(name)
    cl = plan.memory_format == "channels_last"
    torch.manual_seed(seed())
    model = small_cnn()
    warm, timed = fresh_batches(2, seed(), cl), fresh_batches(3, seed(), cl)
    plain = PlainLoop(model, cl)
    with Trainer(copy.deepcopy(model), [cpu(0)], "sgd", {"lr": LR}, plan=plan) as trainer:
        for X, y in warm:
            torch.testing.assert_close(trainer.train_step(X, y), plain.step(X, y), rtol=1e-5, atol=1e-6)
        before = torch.get_num_threads()
        ours = operator_counts(trainer.train_step, timed)
        assert torch.get_num_threads() == before  # the plan's threads were given back after each step
        with intra_op_threads(plan.threads):  # the plain loop with the plan's threads too
            theirs = operator_counts(plain.step, timed)
        assert ours == theirs, f"extra: {ours - theirs}; missing: {theirs - ours}"
        assert trainer.steps == len(warm) + len(timed)
        for name_, value in trainer.module.state_dict().items():
            torch.testing.assert_close(value, plain.model.state_dict()[name_], rtol=1e-5, atol=1e-6, msg=name_)


def test_the_calling_thread_runs_the_step_with_the_plans_threads():
    seen = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.get_num_threads())
            return self.fc(x)

    before = torch.get_num_threads()
    plan = "1x1,contiguous,eager,caller" if before != 1 else "1x2,contiguous,eager,caller"
    with Trainer(Probe(), [cpu(0)], "sgd", {"lr": LR}, plan=plan) as trainer:
        trainer.train_step(torch.randn(8, 4), torch.randint(0, 3, (8,)))
    assert seen == [parse_plan(plan).threads] and torch.get_num_threads() == before

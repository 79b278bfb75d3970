"""A training loop of the user's own under dlperf.Loop: every plan trains to the weights the plain loop reaches on
fresh random inputs (threads, channels-last, a captured forward, plan="auto" tuning on the loop's steps); the
wrapped model and optimizer behave like the user's; AdamW with a cosine schedule and accumulation, and a
HuggingFace-style model on a dict batch, go through untouched; bad plans are one line."""

from __future__ import annotations

import copy
import logging
import os
import warnings

import pytest
import torch
from torch import nn

import dlperf
from dlperf._threads import intra_op_threads
from dlperf.errors import UsageError
from dlperf.parallel.training.own_loop import LoopModule
from support.training import TinyHF

TUNING = dict(warmup=1, rounds=2, steps=2, settle=1, min_window_s=0)


def seed() -> int:
    value = int.from_bytes(os.urandom(4), "little")
    print(f"seed {value}")  # shown when a test fails: the inputs are fresh each run
    return value


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(8 * 4 * 4, 4))


def batches(model_kind: str, n: int, g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (12, 3, 8, 8) if model_kind == "cnn" else (12, 10)
    return [(torch.randn(*shape, generator=g), torch.randint(0, 4, (12,), generator=g)) for _ in range(n)]


def plain_loop(model: nn.Module, data, lr: float = 0.05) -> nn.Module:
    """The oracle: the loop as users write it, no dlperf."""
    net = copy.deepcopy(model)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net


def wrapped_loop(model: nn.Module, data, plan, lr: float = 0.05, **options) -> tuple[nn.Module, dlperf.Loop]:
    net = copy.deepcopy(model)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    loop = dlperf.Loop(plan=plan, **options)
    try:
        wrapped, opt = loop.setup(net, opt)
        for x, y in data:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(wrapped(x), y)
            loop.backward(loss)
            opt.step()
    finally:
        loop.close()
    return net, loop


def assert_same(got: nn.Module, want: nn.Module, atol: float = 1e-5) -> None:
    for (name, a), b in zip(got.state_dict().items(), want.state_dict().values(), strict=True):
        torch.testing.assert_close(a.contiguous(), b.contiguous(), rtol=1e-4, atol=atol, msg=name)


@pytest.mark.parametrize("kind, plan", [
    ("mlp", None), ("mlp", "1x1"), ("mlp", "1x2"), ("cnn", "1x1,channels-last"), ("cnn", "1x2,contiguous"),
    ("mlp", "1x1,captured"),
])
def test_every_plan_trains_to_the_plain_loops_weights(kind, plan):
    g = torch.Generator().manual_seed(seed())
    torch.manual_seed(g.initial_seed())
    model = small_cnn() if kind == "cnn" else mlp()
    data = batches(kind, 6, g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plan that falls back says so: here none may
        got, loop = wrapped_loop(model, data, plan)
    assert_same(got, plain_loop(model, data))
    if plan is not None:
        assert loop.plan is not None and loop.plan.name.startswith(plan.split(",")[0])
    if plan == "1x1,channels-last":
        assert got[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_the_captured_forward_replays(monkeypatch):
    torch.manual_seed(seed())
    model = mlp()
    data = batches("mlp", 4, torch.Generator().manual_seed(1))
    got, loop = wrapped_loop(model, data, "1x1,captured")
    # captured and prepared (whether a replay or eager serves it is hybridize's timed choice on this machine)
    assert loop._hybrid.state == "replay" and loop._hybrid.choices
    assert loop._declined(loop.plan) in (None, "its replay was slower than the eager forward, which it serves instead")
    assert_same(got, plain_loop(model, data))


def test_auto_tunes_on_the_loops_own_steps_logs_its_choice_once_and_trains_the_same(caplog):
    g = torch.Generator().manual_seed(seed())
    torch.manual_seed(g.initial_seed())
    model = small_cnn()
    data = batches("cnn", 30, g)
    before = torch.get_num_threads()
    with caplog.at_level(logging.INFO, logger="dlperf.parallel.training.own_loop"):
        got, loop = wrapped_loop(model, data, "auto", tuning=dlperf.LoopTuning(**TUNING))
    assert_same(got, plain_loop(model, data), atol=1e-4)  # layouts and thread counts round differently
    tuner = loop.tuner
    assert tuner is not None and not tuner.tuning and tuner.plan == loop.plan
    assert tuner.found[0].plan == loop.reference and tuner.found[0].plan.threads == before
    names = {m.plan.name for m in tuner.found}
    assert {"1x1,contiguous,eager,caller", "1x1,channels-last,eager,caller"} <= names
    assert all(m.by_round or m.note for m in tuner.found)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loop plan:")]
    assert len(lines) == 1 and loop.plan.summary() in lines[0], lines
    assert torch.get_num_threads() == before  # given back on close


def test_auto_with_nothing_to_try_keeps_the_loop_as_written_and_adds_no_hook():
    torch.manual_seed(seed())
    model = mlp()
    data = batches("mlp", 4, torch.Generator().manual_seed(2))
    options = dlperf.LoopTuning(executions=["eager"], cores=1)
    with intra_op_threads(1):  # one thread, one core, eager only: the reference is the only candidate
        net = copy.deepcopy(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        with dlperf.Loop(plan="auto", tuning=options) as loop:
            wrapped, opt = loop.setup(net, opt)
            assert loop.tuner.plan == loop.plan == loop.reference and loop._tuning_hook is None
            assert loop._route.plain and not opt._optimizer_step_post_hooks
            for x, y in data:
                opt.zero_grad()
                loop.backward(nn.functional.cross_entropy(wrapped(x), y))
                opt.step()
    assert_same(net, plain_loop(model, data))


def test_the_model_and_optimizer_behave_like_the_users():
    torch.manual_seed(seed())
    model = small_cnn()
    model.note = "mine"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with dlperf.Loop(plan="1x1,channels-last") as loop:
        wrapped, same_opt = loop.setup(model, opt)
        assert same_opt is opt and isinstance(wrapped, LoopModule) and wrapped.module is model
        assert list(wrapped.state_dict()) == list(model.state_dict())
        assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in model.named_parameters()]
        assert all(a is b for a, b in zip(wrapped.parameters(), model.parameters(), strict=True))
        assert wrapped.note == "mine" and getattr(wrapped, "0") is model[0]  # the model's attributes, read through
        wrapped.eval()
        assert not model.training
        with torch.no_grad():
            assert wrapped(torch.randn(2, 3, 8, 8)).shape == (2, 4)
        wrapped.train()
        assert model.training
        bare = small_cnn()
        bare.load_state_dict(wrapped.state_dict())  # a checkpoint of the wrapper loads into the bare model
        wrapped.load_state_dict(bare.state_dict())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        loss = wrapped(torch.randn(4, 3, 8, 8)).sum()
        loop.backward(loss)
        opt.step()
        sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(5e-4)


def test_adamw_with_a_cosine_schedule_and_accumulation_through_the_users_own_loop():
    g = torch.Generator().manual_seed(seed())
    torch.manual_seed(g.initial_seed())
    model = mlp()
    micro = batches("mlp", 12, g)
    accumulate = 3

    def train(net: nn.Module, loop: dlperf.Loop | None) -> nn.Module:
        opt = torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.01)
        if loop is not None:
            net, opt = loop.setup(net, opt)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=len(micro) // accumulate)
        for i, (x, y) in enumerate(micro):
            last = (i + 1) % accumulate == 0
            loss = nn.functional.cross_entropy(net(x), y) / accumulate
            if loop is None:
                loss.backward()
            else:
                with loop.no_backward_sync(enabled=not last):
                    loop.backward(loss)
            if last:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
                opt.step()
                sched.step()
                opt.zero_grad()
        return net

    plain = train(copy.deepcopy(model), None)
    with dlperf.Loop(plan="1x1") as loop:
        got = train(copy.deepcopy(model), loop)
    assert_same(got, plain)


def hf_batches(n: int, g: torch.Generator, batch: int = 12) -> list[dict[str, torch.Tensor]]:
    out = []
    for _ in range(n):
        ids = torch.randint(0, 20, (batch, 7), generator=g)
        labels = torch.bucketize((ids < 10).sum(1), torch.tensor([2, 4]))
        out.append({"input_ids": ids, "attention_mask": torch.ones(batch, 7, dtype=torch.int64), "labels": labels})
    return out


@pytest.mark.parametrize("plan", [None, "1x1,captured", "auto"])
def test_a_huggingface_style_model_on_dict_batches_trains_on_its_own_loss(plan):
    g = torch.Generator().manual_seed(seed())
    torch.manual_seed(g.initial_seed())
    model = TinyHF()
    data = hf_batches(40, g)

    def train(net: nn.Module, loop: dlperf.Loop | None) -> tuple[nn.Module, list[float]]:
        opt = torch.optim.AdamW(net.parameters(), lr=0.05)
        if loop is not None:
            net, opt = loop.setup(net, opt)
        losses = []
        for batch in (loop.setup_data(data) if loop is not None else data):
            opt.zero_grad()
            loss = net(**batch)["loss"]
            (loop.backward if loop is not None else torch.Tensor.backward)(loss)
            opt.step()
            losses.append(float(loop.all_mean(loss)) if loop is not None else float(loss.detach()))
        return net, losses

    plain, plain_losses = train(copy.deepcopy(model), None)
    options = {"tuning": dlperf.LoopTuning(**TUNING)} if plan == "auto" else {}
    with dlperf.Loop(plan=plan, **options) as loop:
        got, losses = train(copy.deepcopy(model), loop)
    assert_same(got, plain, atol=1e-4)
    assert losses == pytest.approx(plain_losses, rel=1e-3, abs=1e-4)
    assert sum(losses[-5:]) < sum(losses[:5])  # it learns
    if plan == "1x1,captured":  # the keywords are named positionally, so the forward is captured
        assert loop._hybrid.state == "replay" and loop._hybrid.choices


def test_in_one_process_data_and_figures_pass_through():
    with dlperf.Loop() as loop:
        data = [1, 2, 3]
        assert loop.setup_data(data) is data
        t = torch.tensor(2.0, requires_grad=True) * 2
        assert loop.all_mean(t).requires_grad is False and float(loop.all_mean(t)) == 4.0
        assert loop.all_mean(3) == 3.0 and loop.all_mean({"acc": torch.tensor(0.5), "n": 4}) == {"acc": 0.5, "n": 4.0}
        assert (loop.rank, loop.world, loop.plan) == (0, 1, None)
        with loop.no_backward_sync():
            pass


@pytest.mark.parametrize("make, needles", [
    (lambda: dlperf.Loop(plan="2x1"), None),
    (lambda: dlperf.Loop(plan="2x1,processes"), None),
    (lambda: dlperf.Loop(plan="1x1", tuning=dlperf.LoopTuning()), ["tuning=", "plan='auto'"]),
    (lambda: dlperf.Loop(plan=3), ["plan=3", "'auto'"]),
    (lambda: dlperf.Loop(plan="1x1,kvstore-local"), None),
    (lambda: dlperf.Loop(plan="1x1,bf16"), None),
    (lambda: dlperf.LoopTuning(rounds=0), ["rounds=0"]),
    (lambda: dlperf.LoopTuning(settle=0), ["settle=0"]),
], ids=["threads-replicas", "processes-in-one", "tuning-without-auto", "not-a-plan", "kvstore", "bf16-on-cpu",
        "rounds", "settle"])
def test_bad_plans_and_options_are_one_line(make, needles):
    with pytest.raises(UsageError) as info:
        loop = make()
        try:
            loop.setup(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.1))
        finally:
            if isinstance(loop, dlperf.Loop):
                loop.close()
    text = str(info.value)
    assert "\n" not in text
    for needle in needles or ["plan '"]:
        assert needle in text, text


def test_setup_checks_what_it_is_given():
    with dlperf.Loop() as loop:
        with pytest.raises(UsageError, match="torch.nn.Module"):
            loop.setup("model")
        with pytest.raises(UsageError, match="not a torch.optim.Optimizer"):
            loop.setup(mlp(), "sgd")
        loop.setup(mlp())
        with pytest.raises(UsageError, match="one Loop runs one model"):
            loop.setup(mlp())
    with pytest.raises(UsageError, match="closed"):
        loop.backward(torch.zeros(()))
    with dlperf.Loop(plan="auto") as loop, pytest.raises(UsageError, match="pass the optimizer"):
        loop.setup(small_cnn())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_pinned_compiled_forward_trains_to_the_plain_loops_weights():
    g = torch.Generator().manual_seed(seed())
    torch.manual_seed(g.initial_seed())
    model = mlp()
    data = batches("mlp", 4, g)
    got, loop = wrapped_loop(model, data, "1x1,compile")
    assert loop.plan.execution == "compile" and loop._route.run is not loop._route.captured
    assert_same(got, plain_loop(model, data))

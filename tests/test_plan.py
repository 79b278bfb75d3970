"""Plans: every plan trains to the weights a plain loop reaches; the planner picks what is faster by construction;
checkpoints keep the plan; a failing plan falls back; the cache is used, bounded and distrusted."""

from __future__ import annotations

import copy
import json
import os
import time

import pytest
import torch
from torch import nn

from dlperf.devices import cpu
from dlperf.errors import UsageError
from dlperf.parallel import Trainer
from dlperf.parallel.planning.plan import EXECUTIONS, Execution, Plan, parse_plan, register_execution
from dlperf.parallel.planning.plan_cache import MAX_BYTES, default_cache_path
from dlperf.parallel.planning.planner import search
from dlperf.parallel.planning.records import CandidateRun, PlannerOptions
from dlperf.parallel.training.planned import plan_for

LR = 0.05
QUICK = PlannerOptions(rounds=2, steps=2, warmup=1, use_cache=False)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(8 * 4 * 4, 5))


def fresh_batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(12, 3, 8, 8, generator=g), torch.randint(0, 5, (12,), generator=g)) for _ in range(n)]


def plain_weights(model: nn.Module, batches) -> dict[str, torch.Tensor]:
    """The oracle: one device, eager, the whole batch, SGD."""
    net = copy.deepcopy(model)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for X, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(net(X), y).backward()
        opt.step()
    return net.state_dict()


def assert_same(got: nn.Module, want: dict[str, torch.Tensor]) -> None:
    for name, value in got.state_dict().items():
        torch.testing.assert_close(value.contiguous(), want[name], rtol=1e-4, atol=1e-5, msg=name)


def seed() -> int:
    value = int.from_bytes(os.urandom(4), "little")
    print(f"seed {value}")  # shown when a test fails: the inputs are fresh each run
    return value


# -- the plan itself -----------------------------------------------------------------------------------

def test_plan_names_round_trip_and_bad_values_are_one_line():
    for name in ("1x2,contiguous,eager", "2x1,channels-last,eager", "2x1,contiguous,eager,kvstore-local",
                 "2x1,contiguous,eager,allreduce-ring", "1x1,contiguous,compile"):
        plan = parse_plan(name)
        assert plan.name == name
        assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    for bad, words in (("two", "REPLICASxTHREADS"), ("1x2,sideways", "unknown part 'sideways'"),
                       ("0x2", "replicas=0"), ("1x2,allreduce-nope", "allreduce algorithm")):
        with pytest.raises(UsageError, match=words) as info:
            parse_plan(bad)
        assert "\n" not in str(info.value)
    with pytest.raises(UsageError, match="unexpected fields"):
        Plan.from_dict({"replicas": 1, "evil": "os.system"})
    with pytest.raises(UsageError, match="plan=3.5"):
        Trainer(small_cnn(), [cpu(0)], plan=3.5)  # neither a name nor a Plan


def test_describe_prints_the_figures_it_was_chosen_on():
    plan = parse_plan("1x2,channels-last").with_figures(47.9, [("2 x 1", 58.7), ("contiguous", 66.1)], ["why"])
    assert plan.line() == ("plan: 1 replica x 2 threads, channels-last, eager: 47.9 ms/step "
                           "(2 x 1: 58.7; contiguous: 66.1)")
    assert "because: why" in plan.describe() and "memory_format    'channels_last'" in plan.describe()
    assert plan == parse_plan("1x2,channels-last")  # figures do not take part in equality


def test_trainer_refuses_plans_it_cannot_realise():
    with pytest.raises(UsageError, match="--nproc-per-node 2"):
        Trainer(small_cnn(), [cpu(0)], plan="2x1,processes")
    with pytest.raises(UsageError, match="fp16 needs loss scaling"):
        Trainer(small_cnn(), [cpu(0)], plan="1x1,fp16")


# -- same mathematics under every plan -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["1x2,contiguous", "1x2,channels-last", "2x1,contiguous", "2x1,channels-last",
                                  "2x1,contiguous,kvstore-local", "2x1,channels-last,allreduce-ring",
                                  "1x1,contiguous", "1x2,channels-last,caller", "1x1,contiguous,caller"])
def test_every_plan_reaches_the_plain_loops_weights(name):
    torch.manual_seed(seed())
    model = small_cnn()
    batches = fresh_batches(4, seed())
    with Trainer(copy.deepcopy(model), [cpu(0), cpu(1)], "sgd", {"lr": LR}, plan=name) as trainer:
        assert trainer.plan == parse_plan(name) and trainer.k == trainer.plan.replicas
        for X, y in batches:
            trainer.train_step(X, y)
        assert trainer.max_replica_difference() == 0.0
        assert_same(trainer.module, plain_weights(model, batches))


@pytest.mark.slow
def test_compiled_plan_reaches_the_plain_loops_weights(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # compile in this process: no worker pool left behind
    torch.manual_seed(seed())
    model = small_cnn()
    batches = fresh_batches(3, seed())
    with Trainer(copy.deepcopy(model), [cpu(0)], "sgd", {"lr": LR}, plan="1x1,contiguous,compile") as trainer:
        for X, y in batches:
            trainer.train_step(X, y)
        assert_same(trainer.module, plain_weights(model, batches))


def test_auto_plans_on_the_first_batch_and_reaches_the_same_weights():
    torch.manual_seed(seed())
    model = small_cnn()
    batches = fresh_batches(3, seed())
    config_options = {"planner": QUICK}
    with Trainer(copy.deepcopy(model), [cpu(0), cpu(1)], "sgd", {"lr": LR}, plan="auto", **config_options) as trainer:
        assert trainer.plan is None  # planned when the first batch comes
        for X, y in batches:
            trainer.train_step(X, y)
        decision = trainer.planning.decision
        assert trainer.plan == decision.plan and trainer.k == trainer.plan.replicas
        names = {m.plan.name for m in decision.measurements}
        assert names >= {"2x1,channels-last,eager", "1x2,contiguous,eager,caller", "1x1,channels-last,eager,caller"}
        assert_same(trainer.module, plain_weights(model, batches))


def test_batchnorm_keeps_the_replica_count():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    X, y = fresh_batches(1, 0)[0]
    decision = plan_for(model, (X, y), [cpu(0), cpu(1)], options=QUICK)
    assert {m.plan.replicas for m in decision.measurements} == {2}
    assert any("BatchNorm" in r for r in decision.plan.reasons)


# -- checkpoints and fallback ----------------------------------------------------------------------------

def test_checkpoint_records_the_plan_and_resume_honours_it():
    torch.manual_seed(seed())
    model = small_cnn()
    batches = fresh_batches(4, seed())
    with Trainer(copy.deepcopy(model), [cpu(0), cpu(1)], "sgd", {"lr": LR, "momentum": 0.9},
                 plan="1x2,channels-last") as first:
        for X, y in batches[:2]:
            first.train_step(X, y)
        state = first.state_dict()
    assert state["plan"] == parse_plan("1x2,channels-last").to_dict()
    with Trainer(small_cnn(), [cpu(0), cpu(1)], "sgd", {"lr": LR, "momentum": 0.9}) as resumed:  # no plan given
        resumed.load_state_dict(state)
        assert resumed.plan == parse_plan("1x2,channels-last") and resumed.k == 1
        for X, y in batches[2:]:
            resumed.train_step(X, y)
        with Trainer(copy.deepcopy(model), [cpu(0)], "sgd", {"lr": LR, "momentum": 0.9}) as straight:
            for X, y in batches:
                straight.train_step(X, y)
            assert_same(resumed.module, straight.module.state_dict())


def test_a_plan_that_breaks_falls_back_with_one_line(caplog):
    calls = []

    def broken(module):
        def forward(x):
            calls.append(1)
            raise RuntimeError("device lost")
        return forward

    register_execution(Execution("test-broken", broken), replace=True)
    try:
        torch.manual_seed(seed())
        model = small_cnn()
        batches = fresh_batches(3, seed())
        with Trainer(copy.deepcopy(model), [cpu(0)], "sgd", {"lr": LR}, plan="1x1,contiguous,test-broken") as trainer:
            for X, y in batches:
                trainer.train_step(X, y)
            assert trainer.plan.execution == "eager" and calls == [1]
            assert_same(trainer.module, plain_weights(model, batches))
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("plan:")]
        assert len(lines) == 1 and "failed (RuntimeError: device lost); falling back" in lines[0]
    finally:
        EXECUTIONS.remove("test-broken")


# -- the planner's choice --------------------------------------------------------------------------------

class SlowOnChannelsLast(nn.Module):
    """A convolution that costs 30 ms more whenever its input arrives channels-last: by construction the
    contiguous layout is the right answer (and the Trainer's default, channels-last on CPU, the wrong one)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
            time.sleep(0.03)
        return self.head(self.conv(x).flatten(1))


def test_planner_picks_the_layout_that_is_faster_by_construction():
    X, y = fresh_batches(1, seed())[0]
    decision = plan_for(SlowOnChannelsLast(), (X, y), [cpu(0)], options=QUICK)
    assert decision.reference.memory_format == "channels_last"  # what the Trainer does without a plan
    assert decision.plan.memory_format == "contiguous", decision.table()
    assert decision.plan.measured_ms is not None and decision.plan.alternatives


def _sleepy_builder(slow_replicas: int, built: list[Plan], clock: StepClock | None = None):
    """Candidates whose step takes 20 ms with ``slow_replicas`` replicas and 2 ms otherwise: slept, or with
    ``clock``, added to it (exact, whatever else the machine runs)."""
    def build(plan: Plan) -> CandidateRun:
        built.append(plan)
        pause = 0.02 if plan.replicas == slow_replicas else 0.002
        step = (lambda: clock.advance(pause)) if clock else (lambda: time.sleep(pause))
        return CandidateRun(step=step, close=lambda: None)
    return build


class StepClock:
    """The timer's clock, moved only by the candidates' steps: what the planner measures is what they were built
    to take, so a decision between equal candidates cannot turn on another process's noise."""

    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


@pytest.fixture
def step_clock(monkeypatch) -> StepClock:
    import dlperf.timing

    clock = StepClock()
    monkeypatch.setattr(dlperf.timing, "time", clock)
    return clock


def test_planner_keeps_the_reference_unless_beaten_and_caches_the_decision(step_clock):
    model, batch = small_cnn(), fresh_batches(1, 0)[0]
    reference = Plan(replicas=2, threads=1, memory_format="channels_last")
    options = PlannerOptions(rounds=2, steps=2, cores=2)
    built: list[Plan] = []
    first = search(model, batch, [cpu(0), cpu(1)], _sleepy_builder(2, built, step_clock), reference, options)
    assert first.plan.replicas == 1 and not first.cached  # 2 replicas are slow by construction
    assert built and os.path.exists(default_cache_path())
    built.clear()
    timed_until = step_clock.now
    again = search(model, batch, [cpu(0), cpu(1)], _sleepy_builder(2, built, step_clock), reference, options)
    # answered from the cache: nothing built, not one step timed
    assert again.cached and again.plan == first.plan and built == [] and step_clock.now == timed_until
    # equal candidates: the reference stays
    even = search(model, batch, [cpu(0), cpu(1)], _sleepy_builder(99, [], step_clock), reference,
                  PlannerOptions(rounds=2, steps=2, cores=2, use_cache=False))
    assert even.plan == reference


def test_budget_skips_and_says_so():
    model, batch = small_cnn(), fresh_batches(1, 0)[0]
    reference = Plan(replicas=2, threads=1)
    decision = search(model, batch, [cpu(0), cpu(1)], _sleepy_builder(0, []), reference,
                      PlannerOptions(rounds=2, steps=2, cores=2, budget_s=0.001, use_cache=False))
    assert decision.plan == reference
    assert any(s.startswith("for time") for s in decision.skipped)
    assert any("compile" in s for s in decision.skipped)  # the run's length is unknown


@pytest.mark.parametrize("content", [b"{", b"[]", json.dumps({"format": 1, "plans": {"k": {"plan": {"replicas": -1}}}}
                                                                ).encode(), b" " * (MAX_BYTES + 1)])
def test_a_hostile_cache_is_ignored_with_one_line(content, capsys, tmp_path, monkeypatch):
    # in dlperf's own cache directory a damaged file is dlperf's, and is replaced by a good one
    monkeypatch.delenv("DLPERF_PLAN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = default_cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(content)
    os.chmod(path, 0o600)
    model, batch = small_cnn(), fresh_batches(1, 0)[0]
    built: list[Plan] = []
    decision = search(model, batch, [cpu(0), cpu(1)], _sleepy_builder(2, built), Plan(replicas=2, threads=1),
                      PlannerOptions(rounds=1, steps=1, cores=2))
    assert not decision.cached and built
    if content.startswith(b"{\"format\""):  # a bad entry only matters when it is the one looked up
        return
    err = [ln for ln in capsys.readouterr().err.splitlines() if "plan cache" in ln]
    assert len(err) >= 1 and all("\n" not in ln for ln in err)
    with open(path, "rb") as f:
        assert json.loads(f.read())["format"] == 1  # replaced by a good one


@pytest.mark.parametrize("content", [b"{", b"[]", b"my notes\n"])
def test_a_file_of_other_content_named_as_the_cache_is_left_as_it_is(content, capsys):
    path = default_cache_path()  # DLPERF_PLAN_CACHE: a path of the user's, outside dlperf's cache directory
    with open(path, "wb") as f:
        f.write(content)
    os.chmod(path, 0o600)
    model, batch = small_cnn(), fresh_batches(1, 0)[0]
    built: list[Plan] = []
    decision = search(model, batch, [cpu(0), cpu(1)], _sleepy_builder(2, built), Plan(replicas=2, threads=1),
                      PlannerOptions(rounds=1, steps=1, cores=2))
    assert not decision.cached and built
    err = [ln for ln in capsys.readouterr().err.splitlines() if "plan cache" in ln]
    assert len(err) == 1 and "it is left as it is" in err[0]
    with open(path, "rb") as f:
        assert f.read() == content


def test_a_cache_others_can_write_is_not_trusted(capsys):
    model, batch = small_cnn(), fresh_batches(1, 0)[0]
    options = PlannerOptions(rounds=1, steps=1, cores=2)
    search(model, batch, [cpu(0), cpu(1)], _sleepy_builder(2, []), Plan(replicas=2, threads=1), options)
    os.chmod(default_cache_path(), 0o666)
    built: list[Plan] = []
    again = search(model, batch, [cpu(0), cpu(1)], _sleepy_builder(2, built), Plan(replicas=2, threads=1), options)
    assert not again.cached and built
    assert "that only it can write" in capsys.readouterr().err


def test_gpu_plans_write_the_gpu_choices_and_mixed_precision_only_when_allowed():
    from dlperf.devices import Device
    from dlperf.parallel.planning.planner import enumerate_plans

    gpus = [Device("gpu", 0), Device("gpu", 1)]
    X, y = fresh_batches(1, 0)[0]
    reference = Plan(replicas=2, threads=1)
    plans, notes = enumerate_plans(small_cnn(), (X, y), gpus, reference, PlannerOptions())
    assert plans[0] == reference and all(p.replicas == 2 for p in plans)
    assert all(p.cudnn_benchmark and p.pin_memory for p in plans[1:])
    assert {p.memory_format for p in plans} == {"contiguous", "channels_last"}
    assert all(p.mixed_precision == "off" for p in plans) and any("mixed precision" in n for n in notes)
    with pytest.raises(UsageError, match="bf16 mixed precision is planned for GPUs"):
        Trainer(small_cnn(), [cpu(0)], plan="1x1,bf16")
    with pytest.raises(UsageError, match="calling thread runs one replica"):
        parse_plan("2x1,caller")


def test_a_candidate_that_fails_is_dropped_not_measured_as_another_plan(caplog):
    def broken(module):
        def forward(x):
            raise RuntimeError("device lost")
        return forward

    register_execution(Execution("test-broken", broken), replace=True)
    try:
        X, y = fresh_batches(1, seed())[0]
        decision = plan_for(small_cnn(), (X, y), [cpu(0)], options=QUICK)
        failed = [m for m in decision.measurements if m.plan.execution == "test-broken"]
        assert failed and failed[0].note.startswith("failed: RuntimeError: device lost") and failed[0].ms is None
        assert decision.plan.execution == "eager"
        assert "falling back" not in caplog.text
    finally:
        EXECUTIONS.remove("test-broken")


def test_the_cache_keeps_the_newest_entries_only(monkeypatch):
    from dlperf.parallel.planning import plan_cache

    monkeypatch.setattr(plan_cache, "MAX_ENTRIES", 2)
    for i, key in enumerate(("a", "b", "c")):
        plan_cache.save_plan(key, Plan(replicas=1, threads=i + 1).with_figures(1.0 + i, [("x", 2.0)]))
        time.sleep(0.01)
    assert plan_cache.cached_plan("a") is None
    assert plan_cache.cached_plan("c") == Plan(replicas=1, threads=3)
    assert plan_cache.cached_plan("c").measured_ms == 3.0


def test_a_named_plan_keeps_the_runs_own_store_and_algorithm():
    plan = parse_plan("2x1").filled(algorithm="ring", bucket_bytes=4096, kvstore="local")
    assert (plan.algorithm, plan.bucket_bytes, plan.kvstore) == ("ring", 4096, "local")
    pinned = parse_plan("2x1,allreduce-naive").filled(algorithm="ring")
    assert pinned.algorithm == "naive"  # what the plan names wins


def test_a_slow_step_cannot_stretch_planning_far_beyond_the_budget():
    built: list[Plan] = []

    def build(plan: Plan) -> CandidateRun:
        built.append(plan)
        return CandidateRun(step=lambda: time.sleep(0.1), close=lambda: None)

    model, batch = small_cnn(), fresh_batches(1, 0)[0]
    decision = search(model, batch, [cpu(0), cpu(1)], build, Plan(replicas=2, threads=1),
                      PlannerOptions(rounds=3, steps=3, warmup=1, cores=2, budget_s=0.25, use_cache=False))
    assert decision.planning_s < 1.5 and len(built) <= 2
    assert any(s.startswith("for time") for s in decision.skipped)

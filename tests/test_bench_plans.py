"""``dlperf bench --mode auto``, ``dlperf profile`` and ``dlperf train --plan auto`` ask one planner: the same
plan, and the second and third start from the first one's cached decision."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dlperf.bench import auto
from dlperf.bench.plans import plan_advice, report_plan
from dlperf.cli import main
from dlperf.machine import usable_cores
from dlperf.parallel.planning.plan import parse_plan
from dlperf.probe.profile import profile


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def quiet_machine(monkeypatch):
    """Every timing judged uncontended: these tests are about one cache shared by the verbs, and a decision timed
    under contention is (rightly) measured again rather than reused (tests/test_plan_trust.py tests that)."""
    from dlperf import timing

    monkeypatch.setattr(timing, "judge_contention",
                        lambda signals: timing.Contention(False, None, signals))


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_profile_bench_and_train_name_the_same_plan_from_one_cache(factories, monkeypatch, capsys, quiet_machine):
    _profile_bench_and_train_name_the_same_plan(monkeypatch, capsys)


def test_profile_bench_and_train_planned_in_one_process_name_the_same_plan(plans_in_one_process, factories,
                                                                          monkeypatch, capsys, quiet_machine):
    _profile_bench_and_train_name_the_same_plan(monkeypatch, capsys)


def _profile_bench_and_train_name_the_same_plan(monkeypatch, capsys) -> None:
    monkeypatch.setattr(auto, "COMPILE_BOUND_S", 0.0)
    cores = str(usable_cores())
    assert main(["profile", "plan_factories:make_model", "--input", "32x16", "--threads", cores, "--steps", "2",
                 "--json", "-"]) == 0
    out = capsys.readouterr().out
    profiled = _last_json(out)
    plan = profiled["plan"]
    assert plan and parse_plan(plan).name == plan
    top = profiled["suggestions"][0]
    assert top["name"] == f"plan {plan}" and top["measured_s"] and "the planner" in top["note"]
    assert f"plan: {plan} (the planner's" in out

    assert main(["bench", "--networks", "plan_factories:make_model", "--input", "32x16", "--threads", cores,
                 "--steps", "2", "--warmup", "1", "--mode", "auto", "--json", "-"]) == 0
    cell = _last_json(capsys.readouterr().out)["cells"][0]
    assert cell["plan"] == plan and f"plan {plan} [cached from " in cell["auto_reason"]
    variant = auto.plan_variant(parse_plan(plan), int(cores), nn.functional.cross_entropy)[0]
    assert cell["mode_chosen"] in (variant, "hybrid")  # the plan stands unless the captured training step beat it

    assert main(["train", "--model", "plan_factories:make_model", "--data", "plan_factories:make_data",
                 "--epochs", "1", "--plan", "auto", "--no-progress", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # train also measures plans whose replicas are processes (it can start them): its own question, its own
    # decision, printed first with the figures it was chosen on
    trained = parse_plan(json.loads(lines[-1])["plan"])
    assert lines[0].startswith(f"plan: {trained.summary()}: ") and "ms/step" in lines[0]


def test_profile_suggestions_are_the_planners_candidates_against_its_reference(quiet_machine):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(16, 8)
    report = profile(net, x, steps=2, plans=plan_advice)
    planned = [s for s in report.suggestions if s.name.startswith("plan ")]
    assert planned[0].name == f"plan {report.plan}" and report.suggestions[0] is planned[0]
    # one baseline for every candidate: the planner's reference, timed in the same rounds
    assert len({s.baseline_s for s in planned if s.measured_s}) == 1
    # only the planner's choice is recommended: a candidate faster at its best round alone is not
    assert not any(s.recommended for s in planned[1:])
    assert not any(s.name.startswith(("threads ", "channels-last")) for s in report.suggestions)
    assert report.to_dict()["plan"] == report.plan
    # the decision is the planner's, cached under the key the next report finds at once
    again = report_plan(net, (x, torch.randint(0, 3, (16,))), threads=torch.get_num_threads())
    assert again.cached and again.plan.name == report.plan


def test_without_plans_profile_keeps_its_own_layout_and_thread_suggestions():
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    report = profile(net, torch.randn(8, 1, 8, 8), steps=2)
    assert report.plan is None and any(s.name == "channels-last" for s in report.suggestions)


def test_a_plan_stands_in_bench_unless_another_beats_it_in_every_round(monkeypatch):
    plan = parse_plan("1x1,channels-last,eager,caller")
    name, _ = auto.plan_variant(plan, 2, nn.functional.cross_entropy)
    assert name == "channels-last 1 thr"
    assert auto.plan_variant(parse_plan("1x2"), 2, nn.functional.cross_entropy)[0] == "eager"
    assert auto.plan_variant(parse_plan("2x1"), 2, nn.functional.cross_entropy)[0] == "plan 2x1,contiguous,eager"
    # a plan cached by a run that could weigh compile keeps its execution in the cell
    assert auto.plan_variant(parse_plan("1x2,channels-last,compile"), 2, nn.functional.cross_entropy)[0] == \
        "channels-last + compile"
    per_round = {"eager": [0.02, 0.02, 0.02], name: [0.010, 0.010, 0.010], "hybrid": [0.0099, 0.0098, 0.0099]}
    medians = {k: sorted(v)[1] for k, v in per_round.items()}
    best, gain, _, _ = auto._pick(medians, per_round, name)
    assert best == name and gain == pytest.approx(2.0)  # hybrid is within the noise of the plan
    per_round["hybrid"] = [0.008, 0.008, 0.008]
    medians["hybrid"] = 0.008
    assert auto._pick(medians, per_round, name)[0] == "hybrid"


def test_a_two_replica_plan_runs_as_a_trainer_with_eagers_math():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    ref.load_state_dict(net.state_dict())
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    loss = nn.functional.cross_entropy
    _, builder = auto.plan_variant(parse_plan("2x1"), 2, loss)
    step = builder(net, torch.optim.SGD(net.parameters(), lr=0.1))
    ref_step = auto.eager_step(ref, loss, torch.optim.SGD(ref.parameters(), lr=0.1))
    try:
        for _ in range(2):
            torch.testing.assert_close(step(x, y), ref_step(x, y), rtol=1e-5, atol=1e-6)
        for a, b in zip(step.trainer.module.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    finally:
        step.trainer.close()


def test_a_model_the_planner_cannot_train_is_profiled_with_the_reason(monkeypatch):
    import dlperf.bench.plans as plans

    def refuse(*args, **kwargs):
        raise RuntimeError("no replica fits")

    monkeypatch.setattr(plans, "plan_for", refuse)
    report = profile(nn.Sequential(nn.Linear(8, 3)), torch.randn(8, 8), steps=1, plans=plan_advice)
    assert report.plan is None
    assert report.suggestions[0].line().startswith("plan") and "not planned: RuntimeError: no replica fits" in \
        report.suggestions[0].line()

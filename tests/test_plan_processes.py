"""Plans whose replicas are processes: enumerated where they can be launched, measured by launching them,
realised in a launched job with the plain run's weights, refused in one line elsewhere."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from dlperf.cli import main
from dlperf.devices import cpu
from dlperf.errors import UsageError
from dlperf.parallel import Trainer
from dlperf.parallel.launchers import ProcessLauncher, rank_info
from dlperf.parallel.planning.plan import Plan, parse_plan
from dlperf.parallel.planning.planner import enumerate_plans
from dlperf.parallel.planning.process_plans import measuring_processes, setup_s
from dlperf.parallel.planning.records import PlannerOptions
from dlperf.parallel.training.planned import plan_for, start_candidate
from dlperf.parallel.training.trainer_config import TrainerConfig

STEPS = 3
LR = 0.05


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 3))


def batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(32, 12, generator=g), torch.randint(0, 3, (32,), generator=g)) for _ in range(n)]


class FailsInRankOne(nn.Module):
    """Trains in rank 0 and raises in rank 1: a candidate whose processes fail."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if rank_info().rank == 1:
            raise RuntimeError("rank one cannot step")
        return self.lin(x)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has ended
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_process_plans_only_where_the_caller_can_launch_them():
    model, batch = mlp(), batches(1)[0]
    reference = Plan(replicas=1, threads=2)
    options = PlannerOptions(cores=2)
    plans, _ = enumerate_plans(model, batch, [cpu(0)], reference, options)
    assert all(p.launcher == "threads" for p in plans)
    with measuring_processes():
        plans, _ = enumerate_plans(model, batch, [cpu(0)], reference, options)
    assert parse_plan("2x1,processes") in plans
    assert setup_s(parse_plan("2x1,processes")) > 0 and setup_s(parse_plan("2x1")) == 0


def test_batchnorm_keeps_process_plans_to_the_references_replica_count():
    model = nn.Sequential(nn.Linear(12, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    batch = batches(1)[0]
    with measuring_processes():
        plans, notes = enumerate_plans(model, batch, [cpu(0)], Plan(replicas=1, threads=2), PlannerOptions(cores=2))
        assert not [p for p in plans if p.launcher == "processes"]
        assert any("processes: not measured" in n for n in notes)
        plans, _ = enumerate_plans(model, batch, [cpu(0), cpu(1)], Plan(replicas=2, threads=1),
                                   PlannerOptions(cores=2))
        assert [p.replicas for p in plans if p.launcher == "processes"] == [2]


def test_a_trainer_in_one_process_refuses_a_process_plan_naming_the_launch():
    with pytest.raises(UsageError, match="dlperf launch --nproc-per-node 2"):
        Trainer(mlp(), [cpu(0)], "sgd", {"lr": LR}, plan="2x1,processes", processes=None)


@pytest.mark.parametrize("argv, expect", [
    (["--plan", "2x1,processes", "--nproc-per-node", "3"], "--plan 2x1,contiguous,eager,processes with 3 processes"),
    (["--plan", "1x2", "--nproc-per-node", "2"], "--plan 1x2,contiguous,eager with 2 processes"),
    (["--plan", "auto", "--nproc-per-node", "2"], "--plan auto with 2 processes"),
])
def test_bad_combinations_are_one_line(argv, expect, capsys):
    assert main(["train", "--epochs", "1", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err


def _plan_worker(plan: str, steps: list) -> dict:
    trainer = Trainer(mlp(), [cpu(0)], "sgd", {"lr": LR}, plan=plan)
    for X, y in steps:
        trainer.train_step(X, y)
    state = {"weights": [p.detach().clone() for p in trainer.replicas[0].parameters()], "plan": trainer.plan,
             "world": trainer.world, "recorded": trainer.state_dict().get("plan")}
    trainer.close()
    return state


@pytest.mark.distributed
def test_a_process_plan_reaches_the_plain_runs_weights():
    steps = batches()
    plain = mlp()
    opt = torch.optim.SGD(plain.parameters(), lr=LR)
    for X, y in steps:
        opt.zero_grad()
        nn.functional.cross_entropy(plain(X), y).backward()
        opt.step()
    results = ProcessLauncher(2, backend="gloo", join_timeout_s=120).launch(_plan_worker, "2x1,processes", steps)
    for r in results:
        assert r["world"] == 2 and r["plan"] == parse_plan("2x1,processes")
        assert r["recorded"]["launcher"] == "processes"  # a checkpoint keeps it, so resume can start as many
        for got, want in zip(r["weights"], plain.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_a_candidate_steps_in_its_processes_and_a_failing_one_leaves_none_behind():
    X, y = batches(1)[0]
    config = TrainerConfig("sgd", {"lr": LR}, processes=None)
    run = start_candidate(parse_plan("2x1,processes"), mlp(), (X, y), config, start_timeout_s=90)
    try:
        for _ in range(3):
            run.step()
    finally:
        run.close()
    assert not run._thread.is_alive()

    bad = start_candidate(parse_plan("2x1,processes"), FailsInRankOne(), (X, y), config, start_timeout_s=90)
    pids = [int(bad.store.get(f"pid/{r}")) for r in range(2)]
    with pytest.raises(RuntimeError, match="2x1,contiguous,eager,processes: a process failed to step"):
        bad.step()
    bad.close()
    assert not bad._thread.is_alive() and not any(_alive(p) for p in pids)


@pytest.mark.distributed
def test_the_planner_measures_process_plans_beside_the_others(tmp_path):
    X, y = batches(1)[0]
    options = PlannerOptions(rounds=2, steps=2, budget_s=60, cache_path=str(tmp_path / "plans.json"))
    decision = plan_for(mlp(), (X, y), optimizer_params={"lr": LR}, options=options, processes=True)
    found = {m.plan.name: m for m in decision.measurements}
    m = found["2x1,contiguous,eager,processes"]
    assert m.ms is not None and m.ms > 0 and not m.note, m.note
    assert set(m.by_round) & set(decision.measurements[0].by_round)  # timed in the reference's rounds


def test_a_process_plan_that_does_not_fit_the_budget_is_skipped_for_time(tmp_path):
    X, y = batches(1)[0]
    options = PlannerOptions(rounds=1, steps=1, budget_s=0.5, use_cache=False)
    decision = plan_for(mlp(), (X, y), optimizer_params={"lr": LR}, options=options, processes=True)
    found = {m.plan.name: m for m in decision.measurements}
    assert found["2x1,contiguous,eager,processes"].note == "skipped for time"
    assert decision.plan.launcher == "threads"


def test_decisions_that_weighed_processes_are_cached_apart(tmp_path):
    X, y = batches(1)[0]
    options = PlannerOptions(rounds=1, steps=1, budget_s=0.5, cache_path=str(tmp_path / "plans.json"))
    assert not plan_for(mlp(), (X, y), options=options, processes=True).cached
    assert not plan_for(mlp(), (X, y), options=options).cached  # another question: not answered by the first
    assert plan_for(mlp(), (X, y), options=options, processes=True).cached


@pytest.mark.distributed
def test_dlperf_train_starts_a_process_plan_records_it_and_resume_follows_it(tmp_path, monkeypatch):
    from dlperf.parallel.training.checkpoint import load_checkpoint

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ck = tmp_path / "ck.pt"
    small = ["--model", "lenet", "--train-size", "256", "--test-size", "64", "--batch-size", "128", "--no-progress",
             "--checkpoint", str(ck)]
    assert main(["train", *small, "--epochs", "1", "--plan", "2x1,processes"]) == 0
    recorded = load_checkpoint(ck)["trainer"]["plan"]
    assert (recorded["replicas"], recorded["launcher"]) == (2, "processes")
    assert main(["train", *small, "--epochs", "2", "--resume", str(ck)]) == 0  # starts 2 processes again
    done = load_checkpoint(ck)
    assert len(done["history"]) == 2 and done["trainer"]["plan"]["launcher"] == "processes"


@pytest.mark.distributed
def test_plan_auto_that_picks_processes_trains_as_them(tmp_path, monkeypatch, capsys):
    """The measuring is the planner's (tested above); here its pick, a processes plan, is what the run becomes."""
    from dlperf.parallel.planning.records import PlanDecision
    from dlperf.parallel.training import planned as planning
    from dlperf.parallel.training.checkpoint import load_checkpoint

    picked = parse_plan("2x1,processes").with_figures(12.5, [("1 x 2, threads", 20.0)])
    monkeypatch.setattr(planning, "plan_for",
                        lambda *a, processes=False, **k: PlanDecision(picked if processes else Plan(), Plan()))
    ck = tmp_path / "ck.pt"
    assert main(["train", "--model", "lenet", "--train-size", "256", "--test-size", "64", "--batch-size", "128",
                 "--no-progress", "--epochs", "1", "--plan", "auto", "--checkpoint", str(ck)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("plan: 2 replicas x 1 thread (processes), contiguous, eager: 12.5 ms/step"), out
    assert load_checkpoint(ck)["trainer"]["plan"]["launcher"] == "processes"


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("head", [["train"], ["launch", "--nproc-per-node", "1", "--", "train"]])
def test_a_process_plan_launches_its_processes_once(head, tmp_path):
    """A launched process is one of the plan's processes: it trains, it never launches the plan again."""
    import signal
    import subprocess
    import sys

    argv = [*head, "--plan", "1x1,processes", "--model", "lenet", "--train-size", "64", "--test-size", "32",
            "--batch-size", "32", "--epochs", "1", "--no-progress"]
    env = {**os.environ, "DLPERF_PLAN_CACHE": str(tmp_path / "plans.json"), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "dlperf.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # relaunching itself: stop the whole tree
        out, err = proc.communicate()
        pytest.fail(f"still running after 150 s; {out.count('plan: ')} plan lines: {out[-400:]}")
    assert proc.returncode == 0, err
    assert out.count("plan: 1 replica x 1 thread (processes)") == 1, out
    assert out.splitlines()[-1].startswith("test acc:") and "leaked semaphore" not in err, err

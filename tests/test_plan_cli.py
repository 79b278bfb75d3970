"""``dlperf train --plan`` and ``--model/--data pkg.module:factory``: the plan line, checkpoints that keep the plan,
your own model and data, and bad values as one line with exit status 2."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from dlperf.cli import main
from dlperf.parallel.training.checkpoint import load_checkpoint

SMALL = ["--train-size", "600", "--test-size", "200", "--batch-size", "100", "--no-progress"]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _plan_auto_prints_the_plan_line_first(capsys) -> None:
    assert main(["train", "--devices", "cpu:0,cpu:1", "--epochs", "1", "--plan", "auto", *SMALL]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("plan: ") and " x " in out[0] and "ms/step" in out[0]
    assert out[-1].startswith("test acc: ")


@pytest.mark.distributed
def test_plan_auto_prints_the_plan_line_first(capsys):
    _plan_auto_prints_the_plan_line_first(capsys)


def test_plan_auto_in_one_process_prints_the_plan_line_first(plans_in_one_process, capsys):
    _plan_auto_prints_the_plan_line_first(capsys)


def test_a_pinned_plan_is_recorded_and_resume_follows_it(tmp_path, capsys):
    ck = tmp_path / "ck.pt"
    common = ["--devices", "cpu:0,cpu:1", "--lr", "0.1", *SMALL]
    assert main(["train", *common, "--epochs", "1", "--plan", "1x2,contiguous", "--checkpoint", str(ck)]) == 0
    assert load_checkpoint(ck)["trainer"]["plan"]["replicas"] == 1
    capsys.readouterr()
    assert main(["train", *common, "--epochs", "2", "--resume", str(ck), "--checkpoint", str(ck)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "plan: 1 replica x 2 threads, contiguous, eager (from the checkpoint)"
    state = load_checkpoint(ck)
    assert state["trainer"]["plan"]["replicas"] == 1 and len(state["history"]) == 2
    # the same two epochs straight through under the same plan reach the same weights
    straight = tmp_path / "straight.pt"
    assert main(["train", *common, "--epochs", "2", "--plan", "1x2,contiguous", "--checkpoint", str(straight)]) == 0
    for name, value in load_checkpoint(straight)["trainer"]["model"].items():
        torch.testing.assert_close(state["trainer"]["model"][name], value, rtol=0, atol=0)


def _your_own_model_and_data(capsys) -> None:
    argv = ["train", "--model", "plan_factories:make_model", "--data", "plan_factories:make_data",
            "--devices", "cpu:0,cpu:1", "--epochs", "2", "--lr", "0.2", "--plan", "auto", "--json", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("plan: ")
    doc = json.loads(out[-1])
    assert len(doc["epochs"]) == 2 and doc["plan"] is not None and doc["epochs"][1]["loss"] < doc["epochs"][0]["loss"]


@pytest.mark.distributed
def test_your_own_model_and_data(factories, capsys):
    _your_own_model_and_data(capsys)


def test_your_own_model_and_data_planned_in_one_process(plans_in_one_process, factories, capsys):
    _your_own_model_and_data(capsys)


def test_your_own_model_on_the_embedded_data(factories, tmp_path, capsys):
    (tmp_path / "plan_cnn.py").write_text("from torch import nn\n"
                                          "def make():\n    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))\n")
    assert main(["train", "--model", "plan_cnn:make", "--epochs", "1", *SMALL]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("test acc: ")
    sys.modules.pop("plan_cnn", None)


@pytest.mark.parametrize("argv, words", [
    (["--plan", "3x"], "--plan: plan '3x' does not start with REPLICASxTHREADS"),
    (["--plan", "1x2,sideways"], "unknown part 'sideways'"),
    (["--model", "nope"], "'nope' is neither a model"),
    (["--data", "nomodule_here:f"], "no module named 'nomodule_here'"),
    (["--plan", "auto", "--nproc-per-node", "2"], "--plan auto with 2 processes"),
    (["--model", "plan_factories:make_model", "--data", "plan_factories:not_batches", "--devices", "cpu:0"],
     "train batch 0 is"),
])
def test_bad_values_are_one_line_and_exit_2(factories, argv, words, capsys):
    assert main(["train", "--epochs", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_auto_on_a_checkpoint_without_a_plan_resumes_as_it_was_trained(tmp_path, capsys):
    ck = tmp_path / "ck.pt"
    common = ["--devices", "cpu:0,cpu:1", *SMALL]
    assert main(["train", *common, "--epochs", "1", "--checkpoint", str(ck)]) == 0
    capsys.readouterr()
    assert main(["train", *common, "--epochs", "2", "--resume", str(ck), "--plan", "auto"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "plan: as the checkpoint was trained (it records no plan)"

"""Resume checks every field of a checkpoint against the run: crafted checkpoints are one line and exit 2."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dlperf.cli import main
from dlperf.devices import cpu
from dlperf.parallel import Trainer
from dlperf.parallel.optimizers import make_optimizer
from dlperf.parallel.training.checkpoint import state_checksum
from dlperf.parallel.training.resume import trainer_state_problem

SMALL = ["--train-size", "300", "--test-size", "100", "--batch-size", "100", "--no-progress", "--devices",
         "cpu:0,cpu:1", "--lr", "0.2"]


@pytest.fixture(scope="module")
def honest(tmp_path_factory) -> dict:
    """A checkpoint of one epoch written by dlperf train itself."""
    path = tmp_path_factory.mktemp("resume") / "ck.pt"
    assert main(["train", *SMALL, "--epochs", "1", "--checkpoint", str(path)]) == 0
    return torch.load(path, weights_only=True)


def _crafted(honest: dict, tmp_path, change) -> str:
    state = {**honest, "trainer": dict(honest["trainer"]), "history": [dict(h) for h in honest["history"]]}
    state["trainer"]["optimizer"] = {"state": dict(honest["trainer"]["optimizer"]["state"]),
                                     "param_groups": [dict(g) for g in honest["trainer"]["optimizer"]["param_groups"]]}
    state["trainer"]["model"] = dict(honest["trainer"]["model"])
    state["trainer"]["buffers"] = [dict(b) for b in honest["trainer"]["buffers"]]
    change(state)
    state["checksum"] = state_checksum(state)  # crafted to pass the checksum: every other check must hold
    path = tmp_path / "crafted.pt"
    torch.save(state, path)
    return str(path)


def _group(state: dict) -> dict:
    return state["trainer"]["optimizer"]["param_groups"][0]


def _set(where, key, value):
    def change(state):
        where(state)[key] = value
    return change


def _momentum_buffer(shape=None, momentum=None, sparse=False):
    def change(state):
        if momentum is not None:
            _group(state)["momentum"] = momentum
        first = next(iter(state["trainer"]["model"].values()))
        buffer = torch.zeros(shape or first.shape)
        state["trainer"]["optimizer"]["state"][0] = {"momentum_buffer": buffer.to_sparse() if sparse else buffer}
    return change


def _history(records):
    def change(state):
        state["history"] = records(state["history"])
    return change


def _first_weight(dtype):
    def change(state):
        name = next(iter(state["trainer"]["model"]))
        state["trainer"]["model"][name] = state["trainer"]["model"][name].to(dtype)
    return change


def _extra_buffer(state):
    state["trainer"]["buffers"][1]["ghost"] = torch.zeros(3)


def _sparse_weight(state):
    name = next(iter(state["trainer"]["model"]))
    state["trainer"]["model"][name] = state["trainer"]["model"][name].to_sparse()


FROM_CHECKPOINT = ["--resume-hparams-from-checkpoint"]
ONLY = "(--resume-hparams-from-checkpoint takes over lr, momentum, weight_decay only)"


CASES = {
    "momentum on a plain-SGD run": (_set(_group, "momentum", 0.99), [],
                                    ["['param_groups'][0]['momentum'] is 0.99 but this run's is 0",
                                     "--resume-hparams-from-checkpoint"]),
    "lr NaN": (_set(_group, "lr", float("nan")), [], ["['param_groups'][0]['lr'] is nan, expected a finite number"]),
    "lr NaN from the checkpoint": (_set(_group, "lr", float("nan")), ["--resume-hparams-from-checkpoint"],
                                   ["['lr'] is nan, expected a finite number"]),
    "lr beyond range from the checkpoint": (_set(_group, "lr", 1e9), ["--resume-hparams-from-checkpoint"],
                                            ["['lr'] is 1000000000.0, expected > 0 and <= 100"]),
    "lr a string": (_set(_group, "lr", "fast"), [], ["['param_groups'][0]['lr'] is 'fast', expected a number"]),
    "a momentum buffer on a plain-SGD run": (_momentum_buffer(), [],
                                             ["['state'][0] holds 'momentum_buffer', which this run's SGD has "
                                              "momentum 0"]),
    "a momentum buffer of the wrong shape": (_momentum_buffer((3, 3), momentum=0.9),
                                             ["--resume-hparams-from-checkpoint"],
                                             ["['state'][0]['momentum_buffer'] is a torch.float32 tensor of shape "
                                              "(3, 3), expected a torch.float32 tensor of shape (",
                                              "(parameter 0's)"]),
    "negative steps": (_set(lambda s: s["trainer"], "steps", -5), [], ["trainer['steps'] is -5, expected a count"]),
    "steps 2**200": (_set(lambda s: s["trainer"], "steps", 2**200), [], ["trainer['steps'] is 16069380442589"]),
    "steps beyond the epochs'": (_set(lambda s: s["trainer"], "steps", 4), [],
                                 ["trainer['steps'] is 4, but 1 epochs of 3 batches run 2 to 3 steps"]),
    "a negative epoch": (_history(lambda h: [{**h[0], "epoch": -3}]), [],
                         ["history[0]['epoch'] is -3, expected 1"]),
    "50 epochs of history": (_history(lambda h: [{**h[0], "epoch": i + 1} for i in range(50)]), [],
                             ["history holds 50 epochs but --epochs is 2", "--epochs 51"]),
    "an accuracy above 1": (_history(lambda h: [{**h[0], "test_acc": 7.0}]), [], ["history[0]['test_acc'] is 7.0"]),
    "an extra buffer key": (_extra_buffer, [], ["trainer['buffers'][1] has unexpected entries ['ghost']"]),
    "int64 weights": (_first_weight(torch.int64), [], ["trainer['model']['0.weight'] is torch.int64, "
                                                       "expected torch.float32"]),
    # the flag takes over what the README names (momentum, lr, weight decay), never what else a file says
    "maximize from the checkpoint": (_set(_group, "maximize", True), FROM_CHECKPOINT,
                                     ["['param_groups'][0]['maximize'] is True but this run's is False", ONLY]),
    "nesterov from the checkpoint": (lambda s: _group(s).update(momentum=0.9, nesterov=True), FROM_CHECKPOINT,
                                     ["['param_groups'][0]['nesterov'] is True but this run's is False", ONLY]),
    "dampening from the checkpoint": (_set(_group, "dampening", 0.5), FROM_CHECKPOINT,
                                      ["['param_groups'][0]['dampening'] is 0.5 but this run's is 0", ONLY]),
    "a sparse momentum buffer": (_momentum_buffer(momentum=0.9, sparse=True), FROM_CHECKPOINT,
                                 ["['state'][0]['momentum_buffer'] is a sparse_coo torch.float32 tensor of shape",
                                  "expected a dense tensor"]),
    "a sparse weight": (_sparse_weight, [], ["trainer['model']['0.weight'] is a sparse_coo torch.float32 tensor",
                                             "expected a dense tensor"]),
}


@pytest.mark.parametrize("case", CASES)
def test_a_crafted_checkpoint_is_one_line_naming_the_field_and_exit_2(case, honest, tmp_path, capfd):
    change, extra, needles = CASES[case]
    path = _crafted(honest, tmp_path, change)
    assert main(["train", *SMALL, "--epochs", "2", "--resume", path, *extra]) == 2
    captured = capfd.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(f"dlperf train: --resume {path}: ") or f"--resume {path}: " in lines[0], lines[0]
    assert all(n in lines[0] for n in needles), lines[0]
    assert captured.out == ""


def test_the_checkpoints_hyperparameters_are_taken_when_asked(honest, tmp_path, capfd):
    path = _crafted(honest, tmp_path, _set(_group, "momentum", 0.5))
    out = tmp_path / "next.pt"
    assert main(["train", *SMALL, "--epochs", "2", "--resume", path, "--resume-hparams-from-checkpoint",
                 "--checkpoint", str(out)]) == 0
    saved = torch.load(out, weights_only=True)
    assert saved["trainer"]["optimizer"]["param_groups"][0]["momentum"] == 0.5
    assert [h["epoch"] for h in saved["history"]] == [1, 2] and saved["trainer"]["steps"] == 6
    assert all(v["momentum_buffer"].shape == saved["trainer"]["model"][k].shape
               for v, k in zip(saved["trainer"]["optimizer"]["state"].values(), saved["trainer"]["model"]))


def test_the_flag_without_resume_is_refused(capfd):
    assert main(["train", *SMALL, "--epochs", "1", "--resume-hparams-from-checkpoint"]) == 2
    err = capfd.readouterr().err
    assert "--resume-hparams-from-checkpoint needs --resume FILE" in err and err.count("\n") == 1


def test_an_honest_checkpoint_resumes(honest, tmp_path, capfd):
    path = _crafted(honest, tmp_path, lambda state: None)
    assert main(["train", *SMALL, "--epochs", "2", "--resume", path]) == 0
    assert capfd.readouterr().out.splitlines()[0].startswith("epoch 2: loss ")


def _store_trainer_state() -> tuple[dict, nn.Module]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    with Trainer(net, [cpu(0), cpu(1)], "sgd", {"lr": 0.2}, kvstore="local", update_on_kvstore=True) as trainer:
        trainer.train_step(torch.randn(8, 4), torch.randint(0, 3, (8,)))
        return trainer.state_dict(), net


def _store_problem(state: dict, net: nn.Module, from_checkpoint: bool = False) -> str | None:
    return trainer_state_problem(state, model=net, devices=2, on_store=True, from_checkpoint=from_checkpoint,
                                 make_reference=lambda params: make_optimizer("sgd", params, {"lr": 0.2}))


def test_a_stores_state_is_checked_like_an_optimizers():
    state, net = _store_trainer_state()
    assert _store_problem(state, net) is None
    # a distributed store's layout: each key's optimizer state per part, and the parts counted
    store = state["kvstore"]
    dist = {**state, "kvstore": {"values": store["values"], "parts": {k: 1 for k in store["values"]},
                                 "optimizers": {k: {0: s} for k, s in store["optimizers"].items()}}}
    assert _store_problem(dist, net) is None
    bad_parts = {**dist, "kvstore": {**dist["kvstore"], "parts": {0: 0}}}
    assert "trainer['kvstore']['parts']" in _store_problem(bad_parts, net)
    first = next(iter(store["optimizers"]))
    fast = copy.deepcopy(dist)
    fast["kvstore"]["optimizers"][first][0]["param_groups"][0]["lr"] = "fast"
    assert f"trainer['kvstore']['optimizers'][{first}][0]['param_groups'][0]['lr'] is 'fast'" in \
        _store_problem(fast, net, from_checkpoint=True)
    wide = copy.deepcopy(state)
    wide["kvstore"]["values"][0] = torch.zeros(9, 9)
    assert "trainer['kvstore']['values']['0'] has shape (9, 9), expected (6, 4)" in _store_problem(wide, net)
    assert "trainer holds store state" in trainer_state_problem(
        state, model=net, devices=2, on_store=False, from_checkpoint=False,
        make_reference=lambda params: make_optimizer("sgd", params, {"lr": 0.2}))

"""Training as users write it, through the verbs: a GRU regressor ([B, 1] and [B] heads, float targets), a
HuggingFace-style classifier (keyword forward with ``labels=None``, mapping batches, a dict output with ``loss``),
each from a module of the user's. Nothing trains or is timed with a loss that cannot be right: without ``--loss``
a regression head is one line and exit 2, with it every verb runs and says which loss it minimises."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap

import pytest

from dlperf.cli import main

MODELS = textwrap.dedent('''
    import torch
    from torch import nn


    class GRURegressor(nn.Module):
        def __init__(self, flat=False):
            super().__init__()
            self.gru = nn.GRU(3, 8, batch_first=True)
            self.head = nn.Linear(8, 1)
            self.flat = flat

        def forward(self, x):
            out, _ = self.gru(x)
            y = self.head(out[:, -1])
            return y.squeeze(1) if self.flat else y


    class TinyHF(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(20, 8)
            self.head = nn.Linear(8, 3)

        def forward(self, input_ids, attention_mask, labels=None):
            mask = attention_mask.unsqueeze(-1).float()
            logits = self.head((self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1))
            out = {"logits": logits}
            if labels is not None:
                out["loss"] = nn.functional.cross_entropy(logits, labels)
            return out


    def make_gru():
        torch.manual_seed(0)
        return GRURegressor()


    def make_flat_gru():
        torch.manual_seed(0)
        return GRURegressor(flat=True)


    def make_hf():
        torch.manual_seed(0)
        return TinyHF()


    def _regression(n, flat, seed):
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n):
            x = torch.randn(16, 5, 3, generator=g)
            y = x[:, -1].mean(1, keepdim=True)
            out.append((x, y.squeeze(1) if flat else y))
        return out


    def gru_data():
        return _regression(30, False, 0), _regression(4, False, 1)


    def flat_gru_data():
        return _regression(30, True, 0), _regression(4, True, 1)


    def _hf(n, seed):
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n):
            ids = torch.randint(0, 20, (12, 7), generator=g)
            out.append({"input_ids": ids, "attention_mask": torch.ones(12, 7, dtype=torch.int64),
                        "labels": torch.bucketize((ids < 10).sum(1), torch.tensor([2, 4]))})
        return out


    def hf_data():
        return _hf(20, 0), _hf(4, 1)
''')


@pytest.fixture
def models(tmp_path, monkeypatch):
    (tmp_path / "your_models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("your_models")
    sys.modules.pop("your_models", None)


def one_error_line(err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("factory", ["make_gru", "make_flat_gru"])
def test_train_on_a_regression_head_without_a_loss_is_one_line_naming_the_flag(models, capsys, factory):
    data = "your_models:gru_data" if factory == "make_gru" else "your_models:flat_gru_data"
    assert main(["train", "--model", f"your_models:{factory}", "--data", data, "--epochs", "1",
                 "--no-progress"]) == 2
    one_error_line(capsys.readouterr().err, "--loss mse")


@pytest.mark.parametrize("factory, data", [("make_gru", "gru_data"), ("make_flat_gru", "flat_gru_data")])
def test_train_a_regressor_with_mse_learns(models, capsys, factory, data):
    assert main(["train", "--model", f"your_models:{factory}", "--data", f"your_models:{data}", "--loss", "mse",
                 "--lr", "0.2", "--epochs", "3", "--no-progress", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.splitlines()[-1])
    losses = [e["loss"] for e in doc["epochs"]]
    assert losses[-1] < 0.6 * losses[0], losses


def test_train_a_huggingface_style_model_on_its_own_loss_with_a_checkpoint_and_resume(models, capsys, tmp_path):
    ck = tmp_path / "hf.pt"
    common = ["train", "--model", "your_models:make_hf", "--data", "your_models:hf_data", "--lr", "0.5",
              "--no-progress", "--checkpoint", str(ck), "--json"]
    assert main([*common, "--epochs", "2"]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert main([*common, "--epochs", "4", "--resume", str(ck)]) == 0
    doc = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert [e["epoch"] for e in doc["epochs"]] == [1, 2, 3, 4] and doc["epochs"][:2] == first["epochs"]
    assert doc["epochs"][-1]["loss"] < doc["epochs"][0]["loss"] and doc["test_acc"] > 0.5


def test_profile_and_bench_time_the_named_loss_and_refuse_a_wrong_default(models, capsys):
    assert main(["profile", "your_models:make_gru", "--input", "16x5x3", "--no-suggest", "--steps", "1"]) == 2
    one_error_line(capsys.readouterr().err, "--loss mse")
    assert main(["profile", "your_models:make_gru", "--input", "16x5x3", "--no-suggest", "--steps", "1",
                 "--loss", "mse"]) == 0
    assert "loss mse" in capsys.readouterr().out.splitlines()[0]
    assert main(["bench", "--networks", "your_models:make_gru", "--input", "16x5x3", "--devices", "cpu",
                 "--threads", "1", "--steps", "1", "--warmup", "1"]) == 2
    one_error_line(capsys.readouterr().err, "--loss mse")
    assert main(["bench", "--networks", "your_models:make_gru", "--input", "16x5x3", "--devices", "cpu",
                 "--threads", "1", "--steps", "1", "--warmup", "1", "--loss", "mse"]) == 0


def test_scale_measures_a_step_with_the_named_loss(models, capsys):
    assert main(["scale", "--model", "your_models:make_gru", "--input", "16x5x3", "--loss", "mse", "--hosts", "2",
                 "--link", "1gbit"]) == 0
    assert "loss mse" in capsys.readouterr().out


def test_adamw_a_cosine_schedule_accumulation_and_clipping_from_the_cli_and_a_resume(models, tmp_path):
    from dlperf.parallel.training.checkpoint import load_checkpoint

    common = ["train", "--model", "your_models:make_gru", "--data", "your_models:gru_data", "--loss", "mse",
              "--optimizer", "adamw", "--lr", "0.02", "--weight-decay", "0.01", "--lr-schedule", "cosine",
              "--accumulate", "2", "--clip-grad-norm", "1.0", "--no-progress"]
    ck = tmp_path / "ck.pt"
    assert main([*common, "--epochs", "2", "--checkpoint", str(ck)]) == 0
    done = load_checkpoint(ck)
    assert done["config"]["optimizer"] == "adamw" and done["config"]["accumulate"] == 2
    assert done["trainer"]["steps"] == 2 * 15  # 30 batches an epoch, an update every 2
    assert done["trainer"]["schedule"]["last_epoch"] == 30  # the cosine's updates, the run's whole length
    assert done["history"][-1]["loss"] < done["history"][0]["loss"]
    # the run goes on from its checkpoint (the schedule, at its end, included); another optimizer is refused
    assert main([*common, "--epochs", "3", "--checkpoint", str(ck), "--resume", str(ck)]) == 0
    assert len(load_checkpoint(ck)["history"]) == 3
    assert main([*common[:10], "sgd", *common[11:], "--epochs", "4", "--resume", str(ck)]) == 2

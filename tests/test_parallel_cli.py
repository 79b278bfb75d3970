from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

from dlperf.cli import train as cli
from dlperf.errors import UsageError


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cli.register(sub)
    args = parser.parse_args(["train", *argv])
    return args.func(args)


SMALL = ["--train-size", "600", "--test-size", "200", "--batch-size", "100", "--no-progress"]


def test_train_prints_accuracy_and_seconds_per_epoch(capsys):
    assert _run(["--devices", "cpu:0,cpu:1", "--epochs", "1", *SMALL]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("epoch 1: loss ")
    assert out[-1].startswith("test acc: ") and out[-1].endswith("sec/epoch on [cpu(0), cpu(1)]")


def test_json_last_line(capsys):
    _run(["--epochs", "1", "--json", *SMALL])
    doc = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert doc["devices"] == ["cpu(0)"] and len(doc["epochs"]) == 1 and 0 <= doc["test_acc"] <= 1


def test_checkpoint_and_resume_continue_bit_identically(tmp_path, capsys):
    straight, ck = tmp_path / "straight.pt", tmp_path / "ck.pt"
    common = ["--devices", "cpu:0,cpu:1", "--lr", "0.1", *SMALL]
    _run([*common, "--epochs", "2", "--checkpoint", str(straight)])
    _run([*common, "--epochs", "1", "--checkpoint", str(ck)])
    _run([*common, "--epochs", "2", "--resume", str(ck), "--checkpoint", str(ck)])
    a = torch.load(straight, weights_only=False)
    b = torch.load(ck, weights_only=False)
    for k, v in a["trainer"]["model"].items():
        assert torch.equal(v, b["trainer"]["model"][k]), k
    assert [h["test_acc"] for h in a["history"]] == [h["test_acc"] for h in b["history"]]
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temporaries


def test_resume_with_other_settings_is_refused(tmp_path):
    ck = tmp_path / "ck.pt"
    _run(["--epochs", "1", "--checkpoint", str(ck), *SMALL])
    with pytest.raises(UsageError, match="settings differ"):
        _run(["--epochs", "2", "--resume", str(ck), "--lr", "0.5", *SMALL])


@pytest.mark.parametrize("argv,match", [
    (["--devices", "cpu:0,cpu:0"], "lists 'cpu:0' twice"),
    (["--devices", "cpu:0,cpu"], "lists cpu\\(0\\) twice"),
    (["--devices", "tpu:0"], "not valid"),
    (["--batch-size", "0"], "batch-size"),
    (["--algorithm", "tree"], "unknown allreduce algorithm 'tree'; valid choices: "),
    (["--resume", "/nonexistent/ck.pt"], "does not exist"),
    (["--lr", "nan"], "'nan' is not a finite number"),
    (["--lr", "1e300"], "'1e300' is out of range"),
    (["--seed", str(2**64)], "out of range"),
    (["--download"], "--download needs --data"),
    (["--train-size", str(10**12)], "needs about .* but only .* of memory is available"),
    (["--devices", "cpu:0,cpu:1,cpu:2", "--batch-size", "2"], "smaller than the 3 devices"),
    (["--bucket-bytes", "0"], "--bucket-bytes"),
    (["--bucket-bytes", "1MB"], "--bucket-bytes"),
])
def test_bad_input_is_one_clear_error(argv, match, capsys):
    from dlperf.cli import main

    assert main(["train", "--epochs", "1", *SMALL, *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and err.count("\n") == 1, err


def test_lenet_two_epochs_two_devices_reaches_one_device_accuracy(capsys):
    """d2l 12.5.7: same seed and batch, 1 vs 2 devices: the same optimization up to float rounding.

    Rounding differs (gradients are summed in another order), and 190 SGD steps amplify it, so the
    accuracies agree within a tolerance rather than exactly (measured here: 0.83 vs 0.81).
    """
    argv = ["--epochs", "2", "--train-size", "3000", "--test-size", "500", "--batch-size", "32",
            "--lr", "0.2", "--json", "--no-progress"]
    _run(["--devices", "cpu:0", *argv])
    one = json.loads(capsys.readouterr().out.splitlines()[-1])
    _run(["--devices", "cpu:0,cpu:1", *argv])
    two = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert one["test_acc"] > 0.6  # it learned (chance is 0.1)
    assert abs(one["test_acc"] - two["test_acc"]) <= 0.05


def test_last_batch_smaller_than_the_device_count_is_skipped(capsys):
    # 33 examples in batches of 32: the last batch has one example for two devices
    assert _run(["--train-size", "33", "--test-size", "33", "--batch-size", "32", "--devices", "cpu:0,cpu:1",
                 "--epochs", "1", "--no-progress", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert len(doc["epochs"]) == 1 and 0 <= doc["test_acc"] <= 1


class _NotData:
    pass


@pytest.mark.parametrize("content", ["garbage", "truncated", "object", "tensor", "wrong-trainer"])
def test_resume_from_a_bad_file_is_one_clear_error(tmp_path, content):
    ck = tmp_path / "ck.pt"
    if content == "garbage":
        ck.write_bytes(b"\x00not a checkpoint" * 10)
    elif content == "truncated":
        _run(["--epochs", "1", "--checkpoint", str(ck), *SMALL])
        ck.write_bytes(ck.read_bytes()[:300])
    elif content == "object":  # unpickling it would run code outside the allow-list
        torch.save({"format": 1, "payload": _NotData()}, ck)
    elif content == "tensor":
        torch.save(torch.zeros(3), ck)
    else:
        _run(["--epochs", "1", "--checkpoint", str(ck), *SMALL])
        state = torch.load(ck, weights_only=True)
        state["trainer"]["model"] = {"bogus": torch.zeros(1)}
        torch.save(state, ck)
    with pytest.raises(UsageError, match="ck.pt"):
        _run(["--epochs", "2", "--resume", str(ck), *SMALL])

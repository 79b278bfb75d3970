"""``dlperf export``: the verb module on a fresh parser."""

from __future__ import annotations

import argparse

import pytest
import torch

from dlperf.errors import UsageError
from dlperf.hybrid import load
from dlperf.hybrid.cli import register
from dlperf.models import get_spec


def _parse(argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="verb"))
    return parser.parse_args(argv)


def test_export_verb_writes_a_loadable_model(tmp_path, capsys):
    spec = get_spec("lenet")
    torch.manual_seed(3)
    model = spec.build().eval()
    weights = tmp_path / "w.pt"
    torch.save(model.state_dict(), weights)
    args = _parse(["export", "lenet", str(tmp_path / "out"), "--batch", "3", "--weights", str(weights)])
    assert args.func(args) == 0
    assert "differs from the model's by at most 0" in capsys.readouterr().out
    x = torch.randn(5, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(load(tmp_path / "out")(x), model(x))


def test_export_verb_rejects_bad_input(tmp_path):
    args = _parse(["export", "nonet", str(tmp_path)])
    with pytest.raises(UsageError, match="valid choices"):
        args.func(args)
    args = _parse(["export", "mlp", str(tmp_path), "--weights", str(tmp_path / "missing.pt")])
    with pytest.raises(UsageError, match="no such file"):
        args.func(args)

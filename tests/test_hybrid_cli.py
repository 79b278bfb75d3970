"""``dlperf export``: the verb module on a fresh parser."""

from __future__ import annotations

import argparse
import importlib
import re

import pytest
import torch

from dlperf.cli.export import register
from dlperf.errors import UsageError
from dlperf.hybrid import load
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


@pytest.mark.parametrize("argv, match", [
    (["export", "nonet", "{tmp}"], "unknown network 'nonet'; valid choices: "),
    (["export", "mlp", "{tmp}", "--weights", "{tmp}/missing.pt"], "missing.pt' does not exist"),
    (["export", "mlp", "{tmp}", "--weights", "{tmp}"], "is a directory, not a file"),
    (["export", "mlp", "{tmp}", "--batch", "0"], "'0' is out of range; give --batch"),
    (["export", "mlp", "{tmp}", "--batch", "2.5"], "'2.5' is not an integer"),
    (["export", "mlp", "{tmp}", "--seed", "-1"], "'-1' is out of range; give --seed"),
])
def test_export_verb_rejects_bad_input(tmp_path, capsys, argv, match):
    from dlperf.cli import main

    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and err.count("\n") == 1, err


def test_output_path_that_is_a_file_is_a_usage_error(tmp_path, capsys):
    from dlperf.cli import main

    target = tmp_path / "taken.json"
    target.write_text("{}")
    assert main(["export", "mlp", str(target), "--no-check"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert target.read_text() == "{}"


def test_batch_beyond_memory_is_refused_before_allocating(tmp_path, capsys, monkeypatch):
    import dlperf._cliargs
    from dlperf.cli import main

    monkeypatch.setattr(dlperf._cliargs, "available_memory_bytes", lambda: 10 * 2**20)
    assert main(["export", "mlp", str(tmp_path / "out"), "--batch", "1000000"]) == 2
    err = capsys.readouterr().err
    assert "--batch 1000000 needs about" in err and "10.0 MiB of memory is available" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content, match", [
    (lambda p: torch.save({"a": torch.zeros(1)}, p), "does not fit model 'mlp': missing .*unexpected a"),
    (lambda p: torch.save(torch.zeros(3), p), "holds a Tensor, not a state_dict"),
    (lambda p: p.write_text('{"not": "torch"}'), "not a state_dict of tensors"),
    (lambda p: torch.save({"x": _Opaque()}, p), "not a state_dict of tensors"),
], ids=["wrong-keys", "tensor", "json", "arbitrary-object"])
def test_bad_weights_file_is_a_usage_error(tmp_path, content, match):
    weights = tmp_path / "w.pt"
    content(weights)
    args = _parse(["export", "mlp", str(tmp_path / "out"), "--weights", str(weights)])
    with pytest.raises(UsageError, match=match):
        args.func(args)


def test_wrong_shapes_in_weights_is_a_usage_error(tmp_path):
    state = {k: torch.zeros(1) for k in get_spec("mlp").build().state_dict()}
    torch.save(state, tmp_path / "w.pt")
    args = _parse(["export", "mlp", str(tmp_path / "out"), "--weights", str(tmp_path / "w.pt")])
    with pytest.raises(UsageError, match="tensor shapes differ"):
        args.func(args)


class _Opaque:
    """A picklable object that a weights-only load must refuse."""


@pytest.mark.parametrize("perturb", [lambda y: y + 0.5, lambda y: torch.full_like(y, float("nan"))],
                         ids=["offset", "nan"])
def test_check_fails_when_the_loaded_export_differs(tmp_path, capsys, monkeypatch, perturb):
    export_mod = importlib.import_module("dlperf.hybrid.export")  # the package re-exports a function of that name
    real_load = export_mod.load

    def perturbed_load(path, *a, **kw):
        module = real_load(path, *a, **kw)
        return lambda x: perturb(module(x))

    monkeypatch.setattr(export_mod, "load", perturbed_load)
    args = _parse(["export", "mlp", str(tmp_path / "out")])
    assert args.func(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not reproduce the model" in err[0] and "nothing was written" in err[0]
    assert not (tmp_path / "out" / "graph.json").exists()


def test_check_passes_within_float_tolerance(tmp_path, capsys, monkeypatch):
    export_mod = importlib.import_module("dlperf.hybrid.export")  # the package re-exports a function of that name
    real_load = export_mod.load
    def nudged_load(path, *a, **kw):
        module = real_load(path, *a, **kw)
        return lambda x: module(x) * (1 + 1e-7)

    monkeypatch.setattr(export_mod, "load", nudged_load)
    args = _parse(["export", "mlp", str(tmp_path / "out")])
    assert args.func(args) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_weights_that_are_not_finite_are_refused_in_one_line(tmp_path, capsys, value):
    from dlperf.cli import main

    model = get_spec("mlp").build()
    state = model.state_dict()
    name = next(iter(state))
    state[name][0, 0] = value
    torch.save(state, tmp_path / "w.pt")
    assert main(["export", "mlp", str(tmp_path / "out"), "--weights", str(tmp_path / "w.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"parameter {name!r} holds 1 non-finite value" in err, err
    assert not (tmp_path / "out").exists()


def test_the_check_fails_when_both_outputs_are_nan():
    from dlperf.hybrid.export import _close

    nan = torch.full((2, 3), float("nan"))
    assert not _close(nan, nan.clone())
    assert not _close(torch.zeros(2), torch.tensor([0.0, float("inf")]))
    assert _close(torch.ones(2), torch.ones(2))


_USER_MODELS = '''
import torch
from torch import nn


def make_cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.1), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 10))


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(2, 3)

    def forward(self, x, z):
        return self.a(x) + self.b(z)
'''


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    (tmp_path / "export_user_models.py").write_text(_USER_MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("export_user_models")
    import sys

    sys.modules.pop("export_user_models", None)


@pytest.mark.parametrize("factory, inputs, example", [
    ("make_cnn", ["2x3x8x8"], lambda: (torch.randn(5, 3, 8, 8),)),
    ("TwoInputs", ["2x4", "2x2"], lambda: (torch.randn(5, 4), torch.randn(5, 2))),
])
def test_export_takes_your_model_and_its_example_input(user_models, tmp_path, capsys, factory, inputs, example):
    argv = ["export", f"export_user_models:{factory}", str(tmp_path / factory)]
    for spec in inputs:
        argv += ["--input", spec]
    args = _parse(argv)
    assert args.func(args) == 0
    assert "differs from the model's by at most" in capsys.readouterr().out
    model = getattr(user_models, factory)().eval()
    # the weights are the exported ones: the factory seeds itself or the CLI's --seed did
    loaded = load(tmp_path / factory)
    torch.manual_seed(0)
    xs = example()
    with torch.no_grad():
        got = loaded(*xs)
    assert got.shape[0] == 5 and torch.isfinite(got).all()
    if factory == "make_cnn":
        with torch.no_grad():
            torch.testing.assert_close(got, model(*xs))


def test_export_of_your_model_without_an_input_is_one_line(user_models, tmp_path):
    args = _parse(["export", "export_user_models:make_cnn", str(tmp_path / "o")])
    with pytest.raises(UsageError, match="needs its example input: give --input"):
        args.func(args)

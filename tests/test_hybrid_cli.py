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

from __future__ import annotations

import argparse
import json
import re

import pytest

from dlperf.bench.scaling import GLOBAL_BATCH, PAPER_TABLE8, device_counts, main_scaling
from dlperf.devices import cpu
from dlperf.errors import UsageError


def test_paper_figures_are_table_8():
    assert GLOBAL_BATCH == {"fcn-r": 4096, "alexnet-r": 1024, "resnet-56": 128}
    assert PAPER_TABLE8["alexnet-r"]["MXNet"] == (0.122, 0.070, 0.041)
    assert PAPER_TABLE8["resnet-56"]["Torch"] == (0.301, 0.182, 0.096)
    assert all(len(v) == 5 for v in PAPER_TABLE8.values())


def test_device_counts():
    assert device_counts(1) == [1]
    assert device_counts(2) == [1, 2]
    assert device_counts(4) == [1, 2, 4]


def test_main_scaling_small_run_prints_table_and_json(capsys):
    args = argparse.Namespace(networks=["fcn-r"], devices=[cpu(0), cpu(1)], steps=1, warmup=0, quick=True,
                              json=True, global_batch={"fcn-r": 16})
    assert main_scaling(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Table 8")
    doc = json.loads(out[-1])
    assert [r["devices"] for r in doc["rows"]] == [1, 2]
    assert doc["rows"][1]["paper_s"]["MXNet"] == 0.104
    assert all(r["median_s"] > 0 for r in doc["rows"])


def test_unknown_network_is_refused():
    args = argparse.Namespace(networks=["lstm"], devices=[cpu(0)], steps=1, warmup=0, quick=True, json=False)
    with pytest.raises(UsageError, match="Table 8 has no network 'lstm'"):
        main_scaling(args)


def test_through_the_bench_verb(capsys, tmp_path):
    from dlperf.cli import main

    out_file = tmp_path / "t8.json"
    argv = ["bench", "--scaling", "--networks", "resnet-56", "--devices", "cpu:0,cpu:1", "--steps", "1",
            "--warmup", "0", "--batch-size", "4"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert [r["global_batch"] for r in doc["rows"]] == [4, 4]
    assert main([*argv, "--json", str(out_file)]) == 0
    assert json.loads(out_file.read_text())["table"] == 8


@pytest.mark.parametrize("extra,match", [
    (["--steps", "0"], "argument --steps: '0' is out of range"),
    (["--warmup", "-1"], "argument --warmup: '-1' is out of range"),
    (["--batch-size", "0"], "argument --batch-size: '0' is out of range"),
    (["--networks", "lenet"], "Table 8 has no network 'lenet'"),
    (["--devices", "cpu:0,"], "argument --devices: 'cpu:0,' has an empty entry"),
])
def test_bad_values_are_one_line_before_any_work(extra, match, monkeypatch, capsys):
    import dlperf.bench.scaling as scaling
    from dlperf.cli import main

    def no_work(*a, **k):
        raise AssertionError("measured before checking the options")

    monkeypatch.setattr(scaling, "measure_scaling", no_work)
    argv = ["bench", "--scaling", "--networks", "resnet-56", "--devices", "cpu:0,cpu:1", "--steps", "1", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and err.count("\n") == 1, err


@pytest.mark.parametrize("extra,match", [
    (["--batch-size", "1"], "at least the 2 devices"),
    (["--mode", "hybrid"], "does not take --mode hybrid"),
    (["--threads", "1,2"], "does not take --threads"),
    (["--csv"], "does not take --csv"),
    (["--markdown", "t.md"], "does not take --markdown"),
    (["--plot", "t.png"], "does not take --plot"),
])
def test_bad_or_ignored_options_are_refused_before_any_work(extra, match, monkeypatch):
    import dlperf.bench.scaling as scaling
    from dlperf.bench import cli as bench_cli

    def no_work(*a, **k):
        raise AssertionError("measured before checking the options")

    monkeypatch.setattr(scaling, "measure_scaling", no_work)
    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "--scaling", "--networks", "resnet-56", "--devices", "cpu:0,cpu:1",
                              "--steps", "1", *extra])
    with pytest.raises(UsageError, match=match):
        args.func(args)


def test_json_file_is_written_atomically(tmp_path, monkeypatch):
    import dlperf._io
    import dlperf.bench.scaling as scaling

    written = []
    real = dlperf._io.atomic_write_text
    monkeypatch.setattr(dlperf._io, "atomic_write_text", lambda p, t: written.append(p) or real(p, t))
    monkeypatch.setattr(scaling, "measure_scaling", lambda *a, **k: [])
    out = tmp_path / "sub" / "t8.json"
    args = argparse.Namespace(networks=["fcn-r"], devices=[cpu(0)], steps=1, warmup=0, quick=True, json=str(out))
    assert main_scaling(args) == 0
    assert written == [str(out)] and json.loads(out.read_text())["rows"] == []
    assert not [p for p in out.parent.iterdir() if p.name != "t8.json"]  # no temporary left behind

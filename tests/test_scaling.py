from __future__ import annotations

import argparse
import json

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

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dlperf.bench.scaling import GLOBAL_BATCH, PAPER_TABLE8, device_counts
from dlperf.cli.bench import main_scaling
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
])
def test_bad_or_ignored_options_are_refused_before_any_work(extra, match, monkeypatch):
    import dlperf.bench.scaling as scaling
    from dlperf.cli import bench as bench_cli

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


def test_every_output_of_a_small_sweep(tmp_path, capsys):
    from dlperf.cli import main

    files = {"json": tmp_path / "t8.json", "csv": tmp_path / "t8.csv", "markdown": tmp_path / "t8.md"}
    argv = ["bench", "--scaling", "--networks", "resnet-56", "--devices", "cpu:0,cpu:1", "--steps", "2",
            "--warmup", "0", "--batch-size", "4", "--plot", str(tmp_path / "t8.png")]
    for flag, path in files.items():
        argv += [f"--{flag}", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("Table 8") and "speedup" in out and "resnet-56" in out  # the rich table
    doc = json.loads(files["json"].read_text())
    assert doc["interrupted"] is False and doc["rows_planned"] == 2 and isinstance(doc["contended"], bool)
    assert [r["devices"] for r in doc["rows"]] == [1, 2]
    assert all(isinstance(r["contended"], bool) and (r["contention"] is None) is (not r["contended"])
               for r in doc["rows"])
    rows = files["csv"].read_text().splitlines()
    assert rows[0].startswith("network,devices,global_batch,median_s") and "contended" in rows[0]
    assert len(rows) == 3 and rows[1].startswith("resnet-56,1,4,")
    md = files["markdown"].read_text()
    assert "| resnet-56 | 2 | 4 |" in md and "0.301" in md  # the paper's Torch figure on one device
    assert (tmp_path / "t8.png").read_bytes()[:4] == b"\x89PNG"


def test_a_contended_row_is_marked_in_every_output():
    from dlperf.bench import scaling

    row = {"network": "fcn-r", "devices": 1, "global_batch": 16, "median_s": 0.5, "q1_s": 0.5, "q3_s": 0.5,
           "noisy": False, "contended": True, "contention": "threads waited for a CPU 40% of the time",
           "samples": 3, "speedup": 1.0, "paper_s": {}}
    result = scaling.ScalingResult(["fcn-r"], [cpu(0)], 3, 1, rows=[row])
    assert "0.500!" in scaling.render_markdown(result)
    assert "! fcn-r, 1 devices: threads waited for a CPU 40% of the time" in scaling.render_markdown(result)
    assert json.loads(scaling.render_json(result))["contended"] is True
    assert ",True,threads waited" in scaling.render_csv(result)


SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.mark.subprocess
@pytest.mark.timeout(180)
def test_ctrl_c_after_the_first_row_keeps_it_in_every_output_and_exits_130(tmp_path):
    files = {"json": tmp_path / "t8.json", "csv": tmp_path / "t8.csv", "markdown": tmp_path / "t8.md"}
    argv = ["bench", "--scaling", "--networks", "resnet-56", "--devices", "cpu:0,cpu:1", "--steps", "40",
            "--warmup", "0", "--batch-size", "4", "--plot", str(tmp_path / "t8.png")]
    for flag, path in files.items():
        argv += [f"--{flag}", str(path)]
    env = {**os.environ, "PYTHONPATH": SRC}
    env.pop("PYTEST_CURRENT_TEST", None)
    proc = subprocess.Popen([sys.executable, "-m", "dlperf.cli", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 150
        while not any("row 2/2" in line for line in list(err)):  # the first row finished
            assert proc.poll() is None, "".join(err)
            assert time.monotonic() < deadline, "".join(err)
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        out = proc.stdout.read()  # to EOF: the process has ended; stderr stays with the reader thread alone
        proc.wait(timeout=60)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    text = "".join(err)
    assert proc.returncode == 130, text
    assert "interrupted after 1 of 2 rows" in text and "Traceback" not in text
    assert "INTERRUPTED: 1 of 2 rows finished" in out
    doc = json.loads(files["json"].read_text())
    assert doc["interrupted"] is True and [r["devices"] for r in doc["rows"]] == [1]
    assert doc["rows"][0]["samples"] == 40
    assert len(files["csv"].read_text().splitlines()) == 2
    assert "INTERRUPTED: 1 of 2 rows finished" in files["markdown"].read_text()
    assert (tmp_path / "t8.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]

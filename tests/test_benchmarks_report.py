"""benchmarks/report.py: BENCHMARKS.md is what the records render, a damaged record is one line, a run becomes a record.

The report is loaded from its file (benchmarks/ is not a package); every check runs in this process, and the
one command it runs is a ``python -c`` stand-in that prints a table and a JSON line, as a benchmark does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("benchmarks_report_under_test", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _record(report, name="engine", **fields):
    record = {"benchmark": name, "command": "python benchmarks/bench_engine.py --quick", "date": "2026-11-25",
              "time": "21:06-21:07", "machine": "2 vCPUs", "load": "0.7-2.0", "contended": False, "commit": "bac980e",
              "runs": 1, "source": "json", "note": None, "figures": {"async_vs_torch": 1.2, "sync_vs_torch": 4.5}}
    record.update(fields)
    return record


def test_benchmarks_md_is_what_the_records_render(report):
    rendered = report.render(report.load_records(report.RESULTS))
    assert (ROOT / "BENCHMARKS.md").read_text() == rendered, "run: python benchmarks/report.py"
    assert len(rendered.splitlines()) <= 300


def test_every_benchmark_script_is_declared(report):
    scripts = {p.name for p in (ROOT / "benchmarks").glob("bench_*.py")}
    commands = " ".join(b.command for b in report.BENCHMARKS)
    assert not [s for s in scripts if f"benchmarks/{s}" not in commands], "declare it in benchmarks/report.py"
    assert len(report.BY_NAME) == len(report.BENCHMARKS)  # one name, one benchmark


def test_figures_are_judged_against_their_targets(report):
    assert report.verdict(1.2, "<= 1.5") == "<= 1.5: met"
    assert report.verdict(4.5, "<= 4") == "<= 4: **missed**"
    assert report.verdict([2.03, 2.11, 1.62], "<= 2") == "<= 2: **met in 1 of 3**"
    assert report.verdict({"mlp": 0.5, "lenet": 0.3}, "<= 2") == "<= 2: met in 2 of 2"
    assert report.verdict(1.01, "0.9..1.1") == "0.9..1.1: met"
    assert report.verdict(False, "== true") == "== true: **missed**"
    assert report.verdict("2.74-2.93", "<= 2") == "<= 2"  # a range as the text gave it: shown, not judged
    assert report.verdict(None, "<= 2") == "<= 2"
    lines = report.render_benchmark(report.BY_NAME["engine"], _record(report))
    assert "| `async_vs_torch` | 1.2 | <= 1.5: met |" in lines
    assert "| `sync_vs_torch` | 4.5 | <= 4: **missed** |" in lines
    assert "| `frontend_fraction` | - | <= 0.002 |" in lines  # not in this run: shown as missing


def test_show_keeps_the_figures_digits_and_the_table_whole(report):
    assert [report.show(v) for v in (0.910, 1.0, 133.03, 7e-05, 1.8612345678, 13, True, None)] == \
        ["0.91", "1.0", "133.03", "7e-05", "1.86123", "13", "true", "-"]
    assert report.show("a | b") == "a \\| b"
    assert report.show([1.5, 2.0]) == "1.5 / 2.0"


@pytest.mark.parametrize("damage, expected", [
    (b"{not json", "not valid JSON"),
    (b'{"a": NaN}', "not valid JSON"),
    (b"[1, 2]", "holds a JSON list, not an object"),
    (json.dumps({k: v for k, v in _record(None).items() if k != "machine"}).encode(), "lacks machine"),
    (json.dumps({**_record(None), "extra": 1}).encode(), "has unknown fields extra"),
    (json.dumps(_record(None, runs="1")).encode(), 'runs is "1", expected int'),
    (json.dumps(_record(None, contended="no")).encode(), 'contended is "no", expected bool or null'),
    (json.dumps(_record(None, runs=True)).encode(), "runs is true, expected int"),
    (json.dumps(_record(None, date="2026-13-40")).encode(), "is no day of the calendar"),
    (json.dumps(_record(None, commit="HEAD")).encode(), "is not 7-40 hex digits"),
    (json.dumps(_record(None, benchmark="table7")).encode(), "benchmark 'table7' is recorded in the file of 'engine'"),
    (json.dumps(_record(None, source="guess")).encode(), "source 'guess' is none of json, text"),
    (json.dumps(_record(None, note="two\nlines")).encode(), "note is not one printable line"),
    (json.dumps(_record(None, figures={"x": "\x1b[2J"})).encode(), "figures.x holds control characters"),
    (json.dumps(_record(None, figures={"x": {"y": [1, {"z": "a\nb"}]}})).encode(), "figures.x.y.1.z holds control"),
    (b'{"benchmark": "engine", "benchmark": "engine"}', "appears twice"),
])
def test_a_damaged_record_is_refused_in_one_line(report, tmp_path, capsys, damage, expected):
    (tmp_path / "engine.json").write_bytes(damage)
    assert report.main(["--results", str(tmp_path), "--out", str(tmp_path / "B.md")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and str(tmp_path / "engine.json") in err, err
    assert "report.py run engine" in err and "Traceback" not in err
    assert not (tmp_path / "B.md").exists()


def test_a_stray_file_a_fifo_and_a_link_are_refused(report, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    assert report.main(["--results", str(tmp_path), "--out", str(tmp_path / "B.md")]) == 2
    assert "is no benchmark's record" in capsys.readouterr().err
    (tmp_path / "notes.txt").unlink()
    os.mkfifo(tmp_path / "engine.json")
    assert report.main(["--results", str(tmp_path), "--out", str(tmp_path / "B.md")]) == 2
    assert "a FIFO, not a regular file" in capsys.readouterr().err  # refused at once, never waited on
    (tmp_path / "engine.json").unlink()
    real = tmp_path.parent / f"{tmp_path.name}-real.json"
    real.write_text(json.dumps(_record(None)))
    (tmp_path / "engine.json").symlink_to(real)
    assert report.main(["--results", str(tmp_path), "--out", str(tmp_path / "B.md")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "engine.json: a symbolic link, which is not followed here" in err


def test_check_says_when_the_page_is_stale(report, tmp_path, capsys):
    (tmp_path / "engine.json").write_text(json.dumps(_record(report)))
    out = tmp_path.parent / f"{tmp_path.name}.md"
    assert report.main(["--results", str(tmp_path), "--out", str(out)]) == 0
    assert report.main(["--results", str(tmp_path), "--out", str(out), "--check"]) == 0
    out.write_text(out.read_text() + "edited by hand\n")
    assert report.main(["--results", str(tmp_path), "--out", str(out), "--check"]) == 1
    assert "is not what the records render" in capsys.readouterr().err
    text = report.render({"engine": _record(report)})
    assert "## Data parallelism" in text and "Not recorded yet: `python benchmarks/report.py run data_parallel`" in text


STAND_IN = ("import json; print('a table for people'); "
            "print(json.dumps({'async_vs_torch': 1.25, 'sync_vs_torch': float('nan'), 'contended': ['cell 3'], "
            "'why': 'a\\nb'}))")


def test_run_records_the_last_json_line_with_where_and_when(report, tmp_path, capsys):
    out = tmp_path / "B.md"
    code = report.main(["run", "engine", "--results", str(tmp_path), "--out", str(out), "--",
                        "python", "-c", STAND_IN])
    assert code == 0
    assert "a table for people" in capsys.readouterr().out  # the benchmark's output still reaches the user
    record = report.load_record(tmp_path / "engine.json")
    assert record["figures"] == {"async_vs_torch": 1.25, "sync_vs_torch": None, "contended": ["cell 3"],
                                 "why": "a\\nb"}
    assert record["contended"] is True and record["source"] == "json" and record["runs"] == 1
    assert record["command"].startswith("python -c ") and record["machine"] and record["load"]
    assert "| `async_vs_torch` | 1.25 | <= 1.5: met |" in out.read_text()


def test_run_of_a_failing_or_silent_command_writes_nothing(report, tmp_path, capsys):
    args = ["run", "engine", "--results", str(tmp_path), "--out", str(tmp_path / "B.md"), "--", "python", "-c"]
    assert report.main([*args, "import sys; print('{}'); sys.exit(3)"]) == 2
    assert "exited with status 3; no record written" in capsys.readouterr().err
    assert report.main([*args, "print('no json here')"]) == 2
    assert "its last line is not valid JSON" in capsys.readouterr().err
    assert report.main([*args, "print('[1]')"]) == 2
    assert "is not a JSON object" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []

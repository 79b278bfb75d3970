"""dlperf trace on a hostile file: names from the file never drive the terminal or forge a row."""

from __future__ import annotations

import json

from dlperf.cli import main


def _trace(tmp_path, worker: str):
    events = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": worker}},
              {"ph": "X", "name": "\x1b]0;owned\x07op", "pid": 1, "tid": 1, "ts": 0, "dur": 5},
              {"ph": "X", "name": "op", "pid": 1, "tid": 2, "ts": 1, "dur": 5}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_escape_sequences_and_newlines_in_names_are_printed_escaped(tmp_path, capsys):
    path = _trace(tmp_path, "\x1b]0;owned\x07w\nforged 99 1.000 100.0%")
    assert main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert not any(line.startswith("forged") for line in out.splitlines())  # no row of the file's making
    assert "\\x1b]0;owned\\x07w\\nforged" in out


def test_json_output_keeps_the_names_as_json_strings(tmp_path, capsys):
    path = _trace(tmp_path, "\x1b[31mw")
    assert main(["trace", str(path), "--json"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out  # JSON escapes control characters itself
    assert "\x1b[31mw" in {w["worker"] for w in json.loads(out)["workers"]}

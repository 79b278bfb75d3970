"""Engine timelines: records, Chrome trace JSON round trip, summary, and the `trace` CLI verb."""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from dlperf.cli.trace import register
from dlperf.devices import cpu
from dlperf.engine import create_engine, load_trace
from dlperf.engine.trace import Trace, TraceEvent, format_summary, summarize
from dlperf.errors import UsageError


def _parallel_trace():
    barrier = threading.Barrier(2, timeout=10)

    def meet_then_work():
        barrier.wait()
        time.sleep(0.03)

    with create_engine(trace=True) as eng:
        v = eng.new_var("v")
        w = eng.new_var("w")
        eng.push(meet_then_work, reads=[v], device=cpu(0), name="left")
        eng.push(meet_then_work, reads=[v], device=cpu(1), name="right")
        eng.push(lambda: None, reads=[v], writes=[w], device=cpu(0), name="join")
        eng.waitall()
        return eng.stop_trace()


def test_trace_records_ops_workers_and_dependencies():
    trace = _parallel_trace()
    by_name = {e.name: e for e in trace.events}
    assert set(by_name) == {"left", "right", "join"}
    assert by_name["left"].worker == "cpu(0)/compute" and by_name["right"].worker == "cpu(1)/compute"
    assert all(e.end_us >= e.start_us >= 0 for e in trace.events)
    s = trace.summary()
    assert s.overlap_us > 20_000  # the two 30 ms sleeps overlapped
    assert {w.worker for w in s.workers} == {"cpu(0)/compute", "cpu(1)/compute"}


def test_dependencies_point_at_earlier_writers():
    with create_engine("naive", trace=True) as eng:
        v = eng.new_var()
        a = eng.push(lambda: None, writes=[v], name="a")
        b = eng.push(lambda: None, reads=[v], name="b")
        t = eng.stop_trace()
    assert [e.name for e in t.events] == ["a", "b"]
    assert t.events[1].deps == (a.id,) and b.id > a.id


def test_chrome_json_round_trip(tmp_path):
    trace = _parallel_trace()
    path = trace.save(tmp_path / "t.json")
    doc = json.loads(path.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 3 and all({"ts", "dur", "pid", "tid", "args"} <= set(e) for e in xs)
    again = load_trace(path)
    assert [(e.name, e.worker) for e in again.events] == [(e.name, e.worker) for e in trace.events]
    assert again.summary().overlap_us == pytest.approx(trace.summary().overlap_us, abs=1.0)


def test_summary_by_hand():
    ev = [TraceEvent(1, "a", "cpu(0)/compute", 0, 10), TraceEvent(2, "b", "cpu(0)/compute", 5, 20),
          TraceEvent(3, "c", "cpu(1)/compute", 10, 30), TraceEvent(4, "d", "gpu(0)/copy", 40, 40)]
    s = summarize(ev)
    assert s.span_us == 40
    busy = {w.worker: w.busy_us for w in s.workers}
    assert busy == {"cpu(0)/compute": 20, "cpu(1)/compute": 20, "gpu(0)/copy": 0}
    assert s.overlap_us == 10 and s.parallelism == 1.0
    assert "cpu(1)/compute" in format_summary(s)
    assert summarize([]).span_us == 0


def _cli(argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="verb")
    register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def test_trace_verb_prints_summary(tmp_path, capsys):
    path = _parallel_trace().save(tmp_path / "run.json")
    assert _cli(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "cpu(0)/compute" in out and "busy %" in out and "mean parallelism" in out
    assert _cli(["trace", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["overlap_fraction"] > 0


def test_trace_verb_rejects_bad_files(tmp_path, capsys):
    from dlperf.cli import main

    assert main(["trace", str(tmp_path / "missing.json")]) == 2
    assert "missing.json' does not exist" in capsys.readouterr().err
    assert main(["trace", str(tmp_path)]) == 2
    assert "is a directory, not a file" in capsys.readouterr().err
    with pytest.raises(UsageError, match="does not exist"):
        load_trace(tmp_path / "missing.json")
    with pytest.raises(UsageError, match="is a directory"):
        load_trace(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UsageError, match="not Chrome trace JSON"):
        _cli(["trace", str(bad)])
    bad.write_text('{"traceEvents": 3}')
    with pytest.raises(UsageError, match="traceEvents"):
        _cli(["trace", str(bad)])


MALFORMED = {
    "args_string": '{"traceEvents": [{"ph": "X", "ts": 0, "dur": 1, "args": "x"}]}',
    "id_not_int": '{"traceEvents": [{"ph": "X", "ts": 0, "dur": 1, "args": {"id": "abc"}}]}',
    "deps_not_ints": '{"traceEvents": [{"ph": "X", "ts": 0, "dur": 1, "args": {"deps": ["a"]}}]}',
    "meta_args_string": '{"traceEvents": [{"ph": "M", "name": "thread_name", "args": "x"}]}',
    "pid_list": '{"traceEvents": [{"ph": "X", "ts": 0, "dur": 1, "pid": [1], "tid": 1}]}',
    "no_ts": '{"traceEvents": [{"ph": "X"}]}',
    "list_of_numbers": "[1, 2]",
    "no_operations": '{"traceEvents": []}',
    "events_not_a_list": '{"traceEvents": "x"}',
    "not_utf8": b"\xff\xfe",
    "ts_nan": '{"traceEvents": [{"ph": "X", "ts": NaN, "dur": 1}]}',
    "dur_infinity": '{"traceEvents": [{"ph": "X", "ts": 0, "dur": Infinity}]}',
    "dur_overflows_to_inf": '{"traceEvents": [{"ph": "X", "ts": 0, "dur": 1e999}]}',
    "dur_negative": '{"traceEvents": [{"ph": "X", "ts": 0, "dur": -100}]}',
    "ts_negative": '{"traceEvents": [{"ph": "X", "ts": -5, "dur": 1}]}',
    "ts_absurd": '{"traceEvents": [{"ph": "X", "ts": 1e300, "dur": 1}]}',
    "ts_string": '{"traceEvents": [{"ph": "X", "ts": "0", "dur": 1}]}',
    "ts_bool": '{"traceEvents": [{"ph": "X", "ts": true, "dur": 1}]}',
    "ts_5000_digits": '{"traceEvents": [{"ph": "X", "ts": ' + "9" * 5000 + ', "dur": 1}]}',
    "id_5000_digits": '{"traceEvents": [{"ph": "X", "ts": 0, "args": {"id": ' + "9" * 5000 + '}}]}',
    "id_negative": '{"traceEvents": [{"ph": "X", "ts": 0, "args": {"id": -1}}]}',
    "id_too_big": '{"traceEvents": [{"ph": "X", "ts": 0, "args": {"id": 99999999999999999999}}]}',
    "deps_not_list": '{"traceEvents": [{"ph": "X", "ts": 0, "args": {"deps": 3}}]}',
    "nested_100000": "[" * 100000 + "]" * 100000,
    "nested_args": '{"traceEvents": [{"ph": "X", "ts": 0, "args": {"x": ' + "[" * 500 + "]" * 500 + '}}]}',
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_traces_give_one_usage_error_and_exit_2(tmp_path, capsys, name):
    from dlperf.cli import main

    bad = tmp_path / f"{name}.json"
    content = MALFORMED[name]
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UsageError, match=f"trace file .*{name}"):
        load_trace(bad)
    assert main(["trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: trace file" in err and "Traceback" not in err


def test_busy_fraction_is_never_negative_or_above_one(tmp_path):
    doc = {"traceEvents": [{"ph": "X", "ts": 10, "dur": 5, "pid": 1, "tid": 1},
                           {"ph": "X", "ts": 0, "dur": 0, "pid": 1, "tid": 2}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    s = load_trace(path).summary()
    assert s.span_us == 15 and [w.busy_fraction for w in s.workers] == [5 / 15, 0.0]


def test_json_array_format_traces_are_read(tmp_path):
    path = tmp_path / "array.json"
    path.write_text(json.dumps([{"ph": "X", "name": "op", "ts": 5, "dur": 2, "pid": 1, "tid": 1}]))
    (ev,) = load_trace(path).events
    assert (ev.name, ev.worker, ev.start_us, ev.end_us) == ("op", "1/1", 5.0, 7.0)


def test_save_replaces_the_file_atomically(tmp_path, monkeypatch):
    import os

    trace = _parallel_trace()
    path = trace.save(tmp_path / "t.json")
    before = path.read_text()

    def interrupted(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(OSError, match="disk full"):
        Trace([]).save(path)
    assert path.read_text() == before  # a failed save leaves the old file whole
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # and no temporary file behind


def test_a_trace_larger_than_the_cap_is_refused_unread(tmp_path, monkeypatch):
    import dlperf.engine.trace as trace_mod

    path = _parallel_trace().save(tmp_path / "run.json")
    monkeypatch.setattr(trace_mod, "MAX_TRACE_BYTES", 10)
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: pytest.fail("read a file over the cap"))
    with pytest.raises(UsageError, match=r"run.json' is larger than 10 bytes \(\d+ bytes\); .*trace a shorter run"):
        load_trace(path)


def _profiled_step(path: Path) -> None:
    from torch import nn
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(2):
            with record_function("train_step"):
                model(x).sum().backward()
            prof.step()
    prof.export_chrome_trace(str(path))


@pytest.mark.timeout(60)
def test_torch_profiler_trace_workers_are_threads_that_ran_operators(tmp_path, capsys):
    from dlperf.cli import main

    path = tmp_path / "profile.json"
    _profiled_step(path)
    raw = json.loads(path.read_text())["traceEvents"]
    op_tracks = {(e["pid"], e["tid"]) for e in raw if e.get("ph") == "X" and e.get("cat") == "cpu_op"}
    assert main(["trace", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    workers = summary["workers"]
    # one worker per thread that ran an aten operator; no track for the profiler's span, the
    # record_function annotations or the Python stacks
    assert len(workers) == len(op_tracks) >= 1
    assert all(w["worker"].startswith("thread ") for w in workers)
    assert all(0 < w["busy_fraction"] <= 1.0 for w in workers) and summary["parallelism"] <= len(workers)
    # busy time is the union of the thread's operator intervals, computed here by hand
    pid, tid = next(iter(op_tracks))
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in raw
                   if e.get("ph") == "X" and e.get("cat") == "cpu_op" and (e["pid"], e["tid"]) == (pid, tid))
    union, reach = 0.0, float("-inf")
    for s, e in spans:
        union += max(0.0, e - max(s, reach))
        reach = max(reach, e)
    mine = next(w for w in workers if w["worker"].startswith(f"thread {tid} "))
    assert mine["busy_us"] == pytest.approx(union, rel=1e-9)
    assert union < sum(e - s for s, e in spans)  # nested operators: a plain sum would count them twice
    assert 1 <= mine["ops"] < len(spans)  # outermost operators only
    assert main(["trace", str(path)]) == 0
    text = capsys.readouterr().out
    assert "PyTorch Profiler" not in text and "train_step" not in text and "busy %" in text


def test_profiler_gpu_streams_are_workers_and_annotations_are_not(tmp_path):
    doc = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7"}},
        {"ph": "M", "name": "process_name", "pid": 42, "tid": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "thread_name", "pid": 42, "tid": 42, "args": {"name": "thread 42 (python)"}},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
         "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 42, "tid": 42, "ts": 0, "dur": 900},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#1", "pid": 0, "tid": 7, "ts": 0, "dur": 900},
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 42, "tid": 42, "ts": 100, "dur": 200},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "pid": 42, "tid": 42, "ts": 150, "dur": 100},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 42, "tid": 42, "ts": 200, "dur": 20},
        {"ph": "X", "cat": "kernel", "name": "sgemm", "pid": 0, "tid": 7, "ts": 250, "dur": 150},
    ]}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(doc))
    s = load_trace(path).summary()
    busy = {w.worker: (w.ops, w.busy_us) for w in s.workers}
    assert busy == {"GPU 0/stream 7": (1, 150.0), "thread 42 (python)": (1, 200.0)}
    assert s.span_us == 300.0 and s.overlap_us == 50.0


def test_a_trace_of_only_profiler_spans_has_no_operations(tmp_path):
    path = tmp_path / "spans.json"
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": 1, "ts": 0, "dur": 5}]}))
    with pytest.raises(UsageError, match="profiler's own spans"):
        load_trace(path)


def test_union_intervals_matches_a_cell_by_cell_reference():
    import random

    from dlperf.engine.trace import union_intervals

    rng = random.Random(7)
    for _ in range(200):
        spans = [(a, a + rng.randint(0, 6)) for a in (rng.randint(0, 40) for _ in range(rng.randint(0, 8)))]
        merged = union_intervals(spans)
        covered = {c for a, b in spans for c in range(a, b)}  # unit cells [c, c + 1) some span covers
        assert {c for a, b in merged for c in range(a, b)} == covered
        assert all(merged[i][1] < merged[i + 1][0] for i in range(len(merged) - 1))  # disjoint, apart, sorted
        assert all(any(a == s for s, _ in spans) for a, _ in merged)  # every start is a span's start

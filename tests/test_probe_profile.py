"""``dlperf profile`` and dlperf.probe.profile on models defined here, not in the zoo."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from torch import nn

from dlperf.cli import main
from dlperf.probe.cost import Hardware, Link
from dlperf.probe.profile import GROUPS, VERDICTS, Suggestion, profile


class TinyConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        return self.head(self.pool(torch.relu(self.norm(self.conv(x)))).flatten(1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x):
        return self.body(x)


def _hardware() -> Hardware:
    link = Link(1e-7, 1e10)
    return Hardware("test", {"float32": 1e10}, 1e10, 1e-6, {k: link for k in ("copy", "host", "device", "network")})


@pytest.mark.timeout(60)
def test_profile_conv_net_groups_times_and_suggestions():
    model = TinyConvNet()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    report = profile(model, torch.randn(8, 3, 8, 8), steps=2, hardware=_hardware())
    rows = report.groups_by_name()
    assert set(rows) == set(GROUPS)
    for group in ("conv", "norm", "pooling", "matmul", "loss", "optimizer", "elementwise"):
        assert rows[group].time_s > 0, group
        assert rows[group].ops > 0, group
    assert rows["conv"].flops == 2 * (2 * 8 * 4 * 8 * 8 * 27)  # forward + weight gradient; the input needs none
    assert all(r.verdict in VERDICTS for r in report.groups)
    assert sum(r.time_s for r in report.groups) == pytest.approx(report.profiled_step_s, rel=0.02)
    assert sum(r.share for r in report.groups) == pytest.approx(1.0)
    names = {s.name for s in report.suggestions}
    assert {"channels-last", "hybridize"} <= names
    channels_last = next(s for s in report.suggestions if s.name == "channels-last")
    assert channels_last.baseline_s > 0 and channels_last.measured_s > 0 and channels_last.speedup > 0
    text = str(report)
    assert "conv" in text and "verdict" in text and "channels-last" in text and "floor on test" in text
    # the caller's model is not trained by profiling it
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())


@pytest.mark.timeout(60)
def test_profile_mlp_with_mse_output_and_floor():
    class Regressor(nn.Module):  # a 3-D output: MSE, not cross-entropy
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(12, 3)

        def forward(self, x):
            return self.lin(x).unsqueeze(-1)

    for model, loss in ((MLP(), None), (Regressor(), "mse")):
        report = profile(model, torch.randn(4, 12), steps=2, hardware=_hardware(), suggest=False, loss=loss)
        rows = report.groups_by_name()
        assert rows["matmul"].time_s > 0 and rows["loss"].time_s > 0
        assert rows["conv"].ops == 0 and rows["conv"].flops == 0
        assert report.floor.no_overlap_s > 0 and report.floor.measured_s == report.step.median_s
        assert report.suggestions == []
        json.dumps(report.to_dict())


@pytest.mark.timeout(60)
def test_profile_threads_are_restored_and_reported():
    before = torch.get_num_threads()
    report = profile(MLP(), torch.randn(4, 12), steps=1, threads=1, suggest=False, hardware=_hardware())
    assert report.threads == 1 and torch.get_num_threads() == before


@pytest.mark.timeout(60)
def test_an_overhead_bound_step_gets_a_measured_larger_batch():
    report = profile(MLP(), torch.randn(2, 12), steps=2, hardware=_hardware())
    overhead = sum(r.time_s for r in report.groups if r.verdict == "overhead-bound")
    assert overhead > 0.3 * report.profiled_step_s
    batch = next(s for s in report.suggestions if s.name == "larger batch")
    assert batch.unit == "example" and batch.baseline_s > 0 and batch.measured_s > 0
    assert "batch 4 instead of 2" in batch.how


def test_suggestion_effect_and_line():
    faster = Suggestion("x", "do x", 2.0, 1.0)
    assert faster.speedup == 2.0 and faster.recommended and "2.00x (recommended)" in faster.line()
    assert not Suggestion("y", "do y", 1.0, 1.02).recommended
    unmeasured = Suggestion("z", "do z", note="not applicable: because")
    assert unmeasured.speedup is None and "not measured" in unmeasured.line()


@pytest.mark.timeout(60)
def test_profile_takes_tuple_outputs_and_refuses_one_without_a_floating_tensor():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x), x

    class Ids(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x).argmax(1)

    from dlperf.errors import UsageError

    report = profile(Pair(), torch.randn(2, 2), steps=1, suggest=False, hardware=_hardware())
    assert report.groups_by_name()["loss"].ops > 0
    with pytest.raises(UsageError, match="no floating tensor"):
        profile(Ids(), torch.randn(2, 2), steps=1, suggest=False)
    with pytest.raises(UsageError, match=r"float32\[2,3\]"):
        profile(MLP(), torch.randn(2, 3), steps=1, suggest=False)


# --- the CLI -------------------------------------------------------------------------------------------------

USER_MODULE = textwrap.dedent("""
    import torch
    from torch import nn

    def make_model():
        return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))

    def broken():
        raise ValueError("no weights here")

    def not_a_model():
        return 42

    def pair():
        class Pair(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(6, 6)

            def forward(self, x):
                return self.lin(x), x
        return Pair()

    def ids_only():
        class Ids(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(6, 6)

            def forward(self, x):
                return self.lin(x.flatten(1)[:, :6]).argmax(1)
        return Ids()

    def frozen():
        return nn.Flatten()

    def quits():
        raise SystemExit(3)

    def no_batch():
        return {"n": 3}

    NOT_CALLABLE = 3
""")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_nets_for_profile.py").write_text(USER_MODULE)
    (tmp_path / "user_broken_import.py").write_text("import torch\nraise RuntimeError('bad import')\n")
    (tmp_path / "user_needs_dep.py").write_text("import not_installed_dep_xyz\n")
    (tmp_path / "user_script_that_exits.py").write_text("import sys\nsys.exit(1)\n")
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "nan.json").write_text('{"flops": {"float32": NaN}}')
    (tmp_path / "zero.json").write_text('{"flops": {"float32": 1e9}, "memory_bandwidth": 0, "dispatch_s": 1e-6}')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in ("user_nets_for_profile", "user_broken_import", "user_script_that_exits", "user_needs_dep"):
        sys.modules.pop(name, None)  # the next test's tmp_path holds its own copy


@pytest.mark.timeout(120)
def test_cli_profiles_a_user_module_with_json(user_module, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(user_module / "cache"))  # the planner's decision stays the test's
    trace = user_module / "trace.json"
    out_json = user_module / "report.json"
    rc = main(["profile", "user_nets_for_profile:make_model", "--input", "4x1x6x6", "--steps", "2", "--threads",
               "1", "--trace", str(trace), "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "conv" in out and "suggestions" in out
    doc = json.loads(out_json.read_text())
    assert doc["input_shape"] == [4, 1, 6, 6] and doc["threads"] == 1
    assert {g["group"] for g in doc["groups"]} == set(GROUPS)
    assert all(g["verdict"] in VERDICTS for g in doc["groups"])
    assert any(s["speedup"] for s in doc["suggestions"])
    assert doc["suggestions"][0]["name"] == f"plan {doc['plan']}"  # the planner's plan comes first
    assert "traceEvents" in json.loads(trace.read_text())
    assert not [p.name for p in user_module.iterdir() if p.name.startswith(".")]  # no temporaries left

    rc = main(["profile", "user_nets_for_profile:make_model", "--input", "2x1x6x6", "--steps", "1", "--no-suggest",
               "--hardware", "seed:cpu-4core", "--json"])
    out = capsys.readouterr().out
    doc = json.loads(out.strip().splitlines()[-1])
    assert rc == 0 and doc["input_shape"] == [2, 1, 6, 6]
    assert doc["hardware"]["flops"] == {"float32": 64e9, "float64": 32e9} and "quad-core" in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "expected"), [
    (["no_such_module_xyz:make"], "no module named 'no_such_module_xyz'"),
    (["user_broken_import:make"], "RuntimeError: bad import"),
    (["user_nets_for_profile:missing"], "has no attribute 'missing'"),
    (["user_nets_for_profile:NOT_CALLABLE"], "is a int, not callable"),
    (["user_nets_for_profile:broken"], "raised ValueError: no weights here"),
    (["user_needs_dep:make"], "No module named 'not_installed_dep_xyz'; install what it imports"),
    (["user_nets_for_profile:quits"], "raised SystemExit: 3"),
    (["user_script_that_exits:make"], "importing 'user_script_that_exits' failed: SystemExit"),
    (["user_nets_for_profile:not_a_model"], "returned int, not a torch.nn.Module"),
    (["user_nets_for_profile:ids_only"], "no floating tensor"),
    (["user_nets_for_profile:frozen"], "has no trainable parameters"),
    (["user_nets_for_profile:make_model", "--input", "4x3x6x6"], "failed on the input float32[4,3,6,6]"),
    (["user_nets_for_profile:make_model", "--input", "0x3"], "'0x3' has a dimension outside"),
    (["user_nets_for_profile:make_model", "--input", "abc"], "'abc' is neither a tensor spec"),
    (["user_nets_for_profile:make_model", "--input", "4x6:complex7"], "names dtype 'complex7'"),
    (["user_nets_for_profile:make_model", "--input", "4x6:float32:0-9"], "ranges are for integer"),
    (["user_nets_for_profile:make_model", "--input", "4x6:int8:0-1000"], "does not fit int8"),
    (["user_nets_for_profile:make_model", "--input", "4x6:int64:9-1"], "LOW < HIGH"),
    (["user_nets_for_profile:make_model", "--input", "4x6", "--input", "2x6"], "batch sizes 2, 4"),
    (["user_nets_for_profile:make_model", "--input", "user_nets_for_profile:no_batch"], "with no tensor"),
    (["user_nets_for_profile:make_model", "--input", "user_nets_for_profile:make_model", "--input", "4x6"],
     "a batch factory makes the whole batch"),
    (["user_nets_for_profile:make_model", "--input", "4x"], "'4x' is not a shape"),
    (["not a target"], "is not MODULE:FACTORY"),
    (["user_nets_for_profile:make_model", "--hardware", "seed:tpu"], "unknown seed hardware 'tpu'"),
    (["user_nets_for_profile:make_model", "--hardware", "missing.json"], "does not exist"),
    (["user_nets_for_profile:make_model", "--hardware", "bad.json"], "is not valid JSON"),
    (["user_nets_for_profile:make_model", "--hardware", "nan.json"], "is not valid JSON"),
    (["user_nets_for_profile:make_model", "--hardware", "zero.json"], "memory_bandwidth is 0"),
    (["user_nets_for_profile:make_model", "--steps", "0"], "--steps"),
])
def test_cli_bad_input_is_one_line_and_exit_2(user_module, capsys, args, expected):
    argv = ["profile", *args]
    if "--input" not in args:
        argv += ["--input", "2x1x6x6"]
    if "--steps" not in args:
        argv += ["--steps", "1", "--no-suggest"]
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("USDT:")]
    assert rc == 2
    assert len(lines) == 1 and expected in lines[0], err
    assert "Traceback" not in err


def test_an_estimate_below_what_the_step_reached_is_raised():
    from dlperf.probe.cost import StepCounts
    from dlperf.probe.profile import _at_least_observed

    slow = Hardware("slow", {"float32": 10.0}, 10.0, 1e-6, _hardware().links)
    counts = StepCounts(flops={"conv": 1000.0}, bytes={"pooling": 500.0}, ops={"conv": 1})
    raised = _at_least_observed(slow, counts, {"conv": 2.0, "pooling": 1.0, "python": 0.0}, 4.0)
    assert raised.flops["float32"] == 500.0 and raised.memory_bandwidth == 500.0
    assert "raised" in raised.notes
    # the whole step, timed without the profiler, can be faster than its profiled groups
    whole = _at_least_observed(slow, counts, {"conv": 20.0, "pooling": 10.0}, 0.5)
    assert whole.flops["float32"] == 2000.0 and whole.memory_bandwidth == 1000.0
    fast = _hardware()
    assert _at_least_observed(fast, counts, {"conv": 2.0, "pooling": 1.0}, 4.0) is fast


def test_suggestions_share_one_baseline_in_alternating_rounds():
    from dlperf.probe.profile import _rounds, _Variant

    calls: list[str] = []

    def fails():
        calls.append("c")
        if calls.count("c") > 2:  # after its warm-up: fails mid-run
            raise RuntimeError("ran out")

    variants = [_Variant("a", "do a", lambda: calls.append("a")), _Variant("b", "do b", lambda: calls.append("b")),
                _Variant("c", "do c", fails)]
    base, contention = _rounds(lambda: calls.append("base"), variants, steps=4, warmup=1)
    assert len(base) == 4 and isinstance(contention.contended, bool)
    timed = calls[calls.index("base"):]
    rounds, current = [], []
    for name in timed:
        if name == "base" and current:
            rounds.append(current)
            current = []
        current.append(name)
    rounds.append(current)
    assert len(rounds) == 5  # the untimed warm-up call, then one round per timed baseline sample
    for r in rounds[1:]:
        assert r[0] == "base" and {"a", "b"} <= set(r[1:])  # every live variant once per round, after the baseline
    assert [r[1] for r in rounds[1:3]] != [rounds[1][1]] * 2  # the order rotates
    assert len(variants[0].samples) == len(variants[1].samples) == 4
    assert variants[2].step is None and "ran out" in variants[2].note


def test_thread_suggestions_cover_fewer_and_more():
    from dlperf.probe.profile import _thread_counts

    assert _thread_counts(4, 8) == [1, 2, 8]
    assert _thread_counts(2, 2) == [1]
    assert _thread_counts(1, 1) == []
    assert _thread_counts(1, 4) == [4]

from __future__ import annotations

import json

import pytest
import torch

from dlperf.bench import report
from dlperf.bench.modes import eager_step, register_mode
from dlperf.bench.reference import TABLE7, paper_figure
from dlperf.bench.runner import BenchConfig, default_threads, run_bench
from dlperf.cli import main
from dlperf.devices import cpu
from dlperf.errors import UsageError
from dlperf.models import get_spec
from dlperf.timing import Timing, time_steps


def test_timing_statistics():
    t = Timing.from_samples([0.4, 0.1, 0.2, 0.3, 0.5])
    assert t.median_s == pytest.approx(0.3)
    assert (t.q1_s, t.q3_s) == pytest.approx((0.2, 0.4))
    assert t.min_s == 0.1 and t.max_s == 0.5
    assert t.noisy  # IQR 0.2 is 67% of the median
    assert not Timing.from_samples([1.0, 1.01, 0.99, 1.0]).noisy


def test_time_steps_runs_warmup_then_timed_steps_and_synchronizes_each():
    calls = []
    t = time_steps(lambda: calls.append("step"), warmup=2, steps=3,
                   synchronize=lambda: calls.append("sync"))
    assert calls.count("step") == 5 and len(t.samples) == 3 and len(t.warmup_samples) == 2
    # each warm-up step is waited for (its time is the compile time), every timed step is bracketed
    assert calls == ["step", "sync"] * 2 + ["sync"] + ["sync", "step", "sync"] * 3


def test_time_steps_stops_early_on_a_time_budget():
    import time

    t = time_steps(lambda: time.sleep(0.02), warmup=0, steps=50, max_seconds=0.05, min_steps=3)
    assert 3 <= len(t.samples) < 10


def test_paper_reference_table_is_complete_and_picks_the_best_tool():
    assert set(TABLE7) == {"fcn-s", "alexnet-s", "resnet-50", "fcn-r", "alexnet-r", "resnet-56", "lstm"}
    assert all(len(v) == 13 for rows in TABLE7.values() for v in rows.values())
    fig = paper_figure("resnet-56", "cpu", 1)
    assert fig.torch_s == 5.758 and fig.best_framework == "Torch"
    fig = paper_figure("lstm", "cpu", 4)
    assert (fig.best_s, fig.best_framework) == (0.090, "CNTK")
    gpu = paper_figure("alexnet-s", "gpu", None)
    assert gpu.column == "GTX 1080" and (gpu.torch_s, gpu.best_s, gpu.best_framework) == (0.023, 0.014, "MXNet")
    assert paper_figure("lenet", "cpu", 1) is None
    assert paper_figure("fcn-r", "cpu", 3) is None  # the desktop had no 3-thread column


def test_default_threads_are_powers_of_two_up_to_the_cores():
    assert default_threads(2) == [1, 2]
    assert default_threads(6) == [1, 2, 4, 6]
    assert default_threads(1) == [1]


def test_quick_config_covers_the_whole_cpu_table_at_paper_batch_sizes():
    cfg = BenchConfig.quick(devices=[cpu()], threads=[1, 2])
    cells = list(cfg.cells())
    assert len(cells) == 14
    assert cfg.batch_size is None  # never smaller batches unless asked


@pytest.mark.parametrize("kwargs, message", [
    ({"networks": ["vgg"]}, "unknown network 'vgg'"),
    ({"mode": "fast"}, "unknown mode 'fast'; valid choices: eager, compile, hybrid"),
    ({"threads": [0]}, "thread counts must be integers >= 1"),
    ({"devices": [cpu(), cpu()]}, "listed twice"),
    ({"batch_size": 0}, "batch size must be >= 1"),
])
def test_bad_config_gives_one_clear_error(kwargs, message):
    with pytest.raises(UsageError, match=message):
        BenchConfig(**kwargs)


def _small_config(**kw):
    base = dict(networks=["mlp", "alexnet-r"], devices=[cpu()], threads=[1, 2], batch_size=8,
                warmup=1, steps=3)
    base.update(kw)
    return BenchConfig(**base)


def test_run_bench_times_every_cell_with_threads_really_set():
    seen_threads = []

    def recording_step(model, loss_fn, optimizer, x, y):
        inner = eager_step(model, loss_fn, optimizer)

        def step(a, b):
            seen_threads.append(torch.get_num_threads())
            return inner(a, b)

        return step

    register_mode("recording", recording_step, replace=True)
    before = torch.get_num_threads()
    result = run_bench(_small_config(mode="recording"))
    assert torch.get_num_threads() == before
    assert [(c.network, c.threads) for c in result.cells] == [
        ("mlp", 1), ("mlp", 2), ("alexnet-r", 1), ("alexnet-r", 2)]
    assert all(c.timing and len(c.timing.samples) == 3 and c.error is None for c in result.cells)
    assert seen_threads == [1] * 4 + [2] * 4 + [1] * 4 + [2] * 4
    alex = result.cells[2]
    assert alex.flops_per_step > 0 and alex.achieved_flops > 0
    assert alex.paper.torch_s == 5.352


def test_a_failing_cell_keeps_its_reason_and_the_rest_completes():
    def failing_for_mlp(model, loss_fn, optimizer, x, y):
        if x.shape[-1] == 512:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 TB")
        return eager_step(model, loss_fn, optimizer)

    register_mode("flaky", failing_for_mlp, replace=True)
    result = run_bench(_small_config(mode="flaky", threads=[1]))
    mlp, alex = result.cells
    assert mlp.timing is None and mlp.error == "out of memory"
    assert alex.timing is not None and alex.error is None
    header, rows = report.table_grid(result)
    assert "- (out of memory)" in rows[0]


def test_training_step_matches_a_hand_written_loop():
    """The benchmarked step is a real training step: same parameters as plain PyTorch after 2 steps."""
    spec = get_spec("lenet")
    torch.manual_seed(0)
    a = spec.build()
    b = spec.build()
    b.load_state_dict(a.state_dict())
    x, y = spec.input.make_batch(16, generator=torch.Generator().manual_seed(0))
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    step = eager_step(a, spec.loss, opt_a)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    for _ in range(2):
        step(x, y)
        opt_b.zero_grad()
        torch.nn.functional.cross_entropy(b(x), y).backward()
        opt_b.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)


@pytest.fixture(scope="module")
def small_result():
    return run_bench(_small_config(threads=[1]))


def test_reports_render_every_format(small_result, tmp_path):
    md = report.render_markdown(small_result)
    assert md.startswith("| network | batch |") and "alexnet-r" in md and "Torch 2016" in md
    rows = report.render_csv(small_result).splitlines()
    assert rows[0].startswith("network,device,threads") and len(rows) == 3
    doc = json.loads(report.render_json(small_result))
    assert doc["schema"] == "dlperf.bench/1" and len(doc["cells"]) == 2
    cell = doc["cells"][1]
    for key in ("network", "device", "threads", "batch_size", "median_s", "spread", "samples"):
        assert key in cell
    report.render_plot(small_result, str(tmp_path / "scaling.png"))
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_bench_json_last_line(capsys):
    rc = main(["bench", "--networks", "mlp", "--threads", "1", "--steps", "2", "--warmup", "1", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    doc = json.loads(out[-1])
    assert [c["network"] for c in doc["cells"]] == ["mlp"]
    assert any("Shi et al" in line for line in out)


def test_cli_bench_csv_and_markdown_files(tmp_path, capsys):
    rc = main(["bench", "--networks", "mlp", "--threads", "1", "--steps", "1", "--warmup", "1",
               "--csv", str(tmp_path / "t.csv"), "--markdown", str(tmp_path / "t.md")])
    assert rc == 0
    assert (tmp_path / "t.csv").read_text().startswith("network,")
    assert "| mlp |" in (tmp_path / "t.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["bench", "--networks", "vgg"], "unknown network 'vgg'; valid choices: fcn-s"),
    (["bench", "--devices", "tpu"], "device 'tpu' is not valid"),
    (["bench", "--mode", "jit"], "unknown mode 'jit'"),
    (["bench", "--threads", "two"], "expected comma-separated integers"),
])
def test_cli_bad_input_exits_2_with_one_line(argv, message, capsys):
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse type errors exit from the parser
        rc = exc.code
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_cli_refuses_an_unwritable_output_before_running(tmp_path, capsys, monkeypatch):
    import dlperf.bench.runner as runner

    def must_not_run(*a, **k):
        raise AssertionError("the sweep ran although its output could not be written")

    monkeypatch.setattr(runner, "run_bench", must_not_run)
    assert main(["bench", "--networks", "mlp", "--csv", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", "--networks", "mlp", "--json", str(blocker / "out.json")]) == 2
    assert "cannot write --json" in capsys.readouterr().err


def test_atomic_writes_keep_the_usual_file_mode(tmp_path):
    import os

    from dlperf._io import atomic_write_text

    path = atomic_write_text(tmp_path / "a.txt", "x")
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
    assert path.read_text() == "x" and not list(tmp_path.glob(".a.txt.*"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without GPUs")
def test_cli_gpu_on_a_machine_without_one(capsys):
    assert main(["bench", "--devices", "gpu(0)"]) == 2
    assert "gpu(0) was requested but this machine has 0 GPUs" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_cells_run_and_compare_with_the_gtx_1080():
    from dlperf.devices import gpu

    result = run_bench(BenchConfig(networks=["alexnet-r"], devices=[gpu(0)], warmup=1, steps=2))
    (cell,) = result.cells
    assert cell.error is None and cell.threads is None and cell.batch_size == 1024
    assert cell.paper.column == "GTX 1080"


_COMPILE_SCRIPT = """
import json
from dlperf.bench.runner import BenchConfig, run_bench
config = BenchConfig(networks=["mlp"], devices=["cpu"], threads=[1], batch_size=8, mode="compile",
                     warmup=2, steps=2)
(cell,) = run_bench(config).cells
print(json.dumps({"error": cell.error, "timed": cell.timing is not None, "mode": cell.mode}))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compile_mode_times_a_real_compiled_step():
    # In a child process: inductor's compile workers are threads that outlive the call by design.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"error": None, "timed": True, "mode": "compile"}


def _interrupting_mode(after_cells: int):
    """A step mode that behaves like Ctrl-C in the middle of cell ``after_cells + 1``."""
    built = {"n": 0}

    def mode(model, loss_fn, optimizer, x, y):
        built["n"] += 1
        inner = eager_step(model, loss_fn, optimizer)
        if built["n"] <= after_cells:
            return inner
        calls = {"n": 0}

        def step(a, b):
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt
            return inner(a, b)

        return step

    return mode


def test_interrupted_sweep_keeps_the_finished_cells():
    register_mode("interrupt-after-2", _interrupting_mode(2), replace=True)
    before = torch.get_num_threads()
    result = run_bench(_small_config(mode="interrupt-after-2"))
    assert torch.get_num_threads() == before
    assert result.interrupted and result.planned == 4
    assert [(c.network, c.threads) for c in result.cells] == [("mlp", 1), ("mlp", 2)]
    assert all(c.timing is not None for c in result.cells)
    doc = json.loads(report.render_json(result))
    assert doc["interrupted"] is True and doc["cells_planned"] == 4 and len(doc["cells"]) == 2
    md = report.render_markdown(result)
    assert "INTERRUPTED: 2 of 4 cells finished" in md
    assert "alexnet-r" not in md  # a network that never ran has no empty rows
    assert len(report.render_csv(result).splitlines()) == 3


def test_a_complete_sweep_is_not_marked_interrupted(small_result):
    assert not small_result.interrupted
    assert json.loads(report.render_json(small_result))["interrupted"] is False
    assert "INTERRUPTED" not in report.render_markdown(small_result)


def test_cli_interrupted_sweep_writes_every_output_and_exits_130(tmp_path, capsys):
    register_mode("interrupt-after-1", _interrupting_mode(1), replace=True)
    files = {flag: tmp_path / f"out.{flag}" for flag in ("json", "csv", "markdown")}
    argv = ["bench", "--networks", "mlp", "--threads", "1,2", "--steps", "2", "--warmup", "1",
            "--mode", "interrupt-after-1"]
    for flag, path in files.items():
        argv += [f"--{flag}", str(path)]
    argv += ["--plot", str(tmp_path / "plot.png")]
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 130
    assert "interrupted after 1 of 2 cells" in captured.err
    assert "INTERRUPTED: 1 of 2 cells finished" in captured.out  # the note under the terminal table
    doc = json.loads(files["json"].read_text())
    assert doc["interrupted"] is True and [c["threads"] for c in doc["cells"]] == [1]
    assert len(files["csv"].read_text().splitlines()) == 2
    assert "INTERRUPTED" in files["markdown"].read_text()
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def _slow_first_call_mode(first_call_s: float):
    """A mode whose first step pays a one-off cost, like a compiler, and names its backend."""

    def mode(model, loss_fn, optimizer, x, y):
        inner = eager_step(model, loss_fn, optimizer)
        calls = {"n": 0}

        def step(a, b):
            calls["n"] += 1
            if calls["n"] == 1:
                import time

                time.sleep(first_call_s)
            return inner(a, b)

        step.backend = "sleepy"
        return step

    return mode


def test_compile_time_and_backend_are_reported_outside_eager_mode():
    register_mode("sleepy", _slow_first_call_mode(0.3), replace=True)
    result = run_bench(_small_config(networks=["mlp"], threads=[1], mode="sleepy", steps=3))
    (cell,) = result.cells
    assert cell.backend == "sleepy"
    assert 0.3 <= cell.compile_s < 0.3 + 0.5  # the first call's extra cost, not a steady step
    doc = json.loads(report.render_json(result))["cells"][0]
    assert doc["backend"] == "sleepy" and doc["compile_s"] == pytest.approx(cell.compile_s)
    header, rows = report.table_grid(result)
    labels = [r[2] for r in rows]
    assert labels[-2:] == ["compile (s)", "backend"] and rows[-1][3] == "sleepy"
    assert rows[-2][3].startswith("0.")
    assert ",sleepy," in report.render_csv(result)


def test_eager_mode_has_no_compile_rows(small_result):
    assert all(c.compile_s is None and c.backend is None for c in small_result.cells)
    assert [r[2] for r in report.table_grid(small_result)[1]][:5] == list(report.ROW_LABELS)
    assert "compile (s)" not in report.render_markdown(small_result)


def test_hybrid_mode_reports_the_backend_it_chose():
    result = run_bench(_small_config(networks=["mlp"], threads=[1], mode="hybrid", steps=2))
    (cell,) = result.cells
    assert cell.error is None and cell.compile_s is not None and cell.compile_s >= 0
    assert cell.backend and cell.backend != "capture"


def _cell(threads, median, contention=None):
    from dlperf.timing import ContentionSignals, Timing, judge_contention

    verdict = None
    if contention:
        verdict = judge_contention(ContentionSignals(wall_s=1, cpu_s=1, threads=threads, cores=2, run_s=1,
                                                     wait_s=1, others_mean=1, others_max=1))
    from dlperf.bench.result import CellResult

    return CellResult("alexnet-r", cpu(), threads, 16, "eager",
                      timing=Timing.from_samples([median] * 3, contention=verdict))


def _result(cells):
    from dlperf.bench.result import BenchResult

    return BenchResult(_small_config(networks=["alexnet-r"]), cells, {"cpu": "x", "cores": 2, "gpus": [],
                                                                       "torch": "t", "date": "d"}, 1.0)


def test_contended_cells_are_marked_in_every_output():
    result = _result([_cell(1, 0.010), _cell(2, 0.040, contention=True)])
    md = report.render_markdown(result)
    assert "| 0.010 | 0.040! |" in md
    assert "! alexnet-r, cpu(0) 2 threads: threads waited for a CPU 50% of the time" in md
    doc = json.loads(report.render_json(result))
    assert doc["contended"] is True
    assert [(c["contended"], c["contention"] is not None) for c in doc["cells"]] == [(False, False), (True, True)]
    rows = report.render_csv(result).splitlines()
    assert "contended,contention" in rows[0] and ",False,," in rows[1] and ",True,threads waited" in rows[2]


def test_a_quiet_run_has_no_marks():
    result = _result([_cell(1, 0.010), _cell(2, 0.006)])
    md = report.render_markdown(result)
    assert "!" not in md and "warning" not in md
    assert json.loads(report.render_json(result))["contended"] is False


def test_more_threads_slower_than_fewer_is_called_out():
    result = _result([_cell(1, 0.010), _cell(2, 0.040, contention=True)])
    (line,) = result.thread_warnings()
    assert line.startswith("alexnet-r on cpu(0): 2 threads took 4.0x as long as 1") and "contended" in line
    assert "warning: alexnet-r on cpu(0): 2 threads took 4.0x" in report.render_markdown(result)
    assert json.loads(report.render_json(result))["thread_warnings"] == [line]
    # within the timer's noise, or faster: nothing to say
    assert _result([_cell(1, 0.010), _cell(2, 0.0105)]).thread_warnings() == []


def test_progress_lines_give_the_time_left(capsys):
    assert main(["bench", "--networks", "mlp", "--threads", "1,2", "--steps", "2", "--warmup", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    lines = [e for e in err if e.startswith("dlperf bench: cell ")]
    assert lines[0] == "dlperf bench: cell 1/2: mlp on cpu(0), 1 thr"
    assert lines[1].startswith("dlperf bench: cell 2/2: mlp on cpu(0), 2 thr (about ") and lines[1].endswith(" left)")


def test_format_duration():
    from dlperf.bench.sweep import format_duration

    assert [format_duration(s) for s in (0, 59.4, 61, 3599, 3600, 86399)] == \
        ["0s", "59s", "1m 01s", "59m 59s", "1h 00m", "23h 59m"]

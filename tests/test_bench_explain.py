"""``dlperf bench --explain``: every cell's floor from the cost model, beside its measured time."""

from __future__ import annotations

import csv
import io
import json

import pytest

from dlperf.bench import explain, report
from dlperf.bench.explain import FloorModel
from dlperf.bench.runner import BenchConfig, count_step_flops, run_bench
from dlperf.cli import main
from dlperf.devices import cpu
from dlperf.probe.cost import Hardware, allreduce_time

SEED_HW = Hardware.from_seed("cpu-4core")


def fixed_hardware(threads: int):
    return SEED_HW, f"seed cpu-4core ({threads} threads)"


def test_floor_is_the_largest_named_component_and_counts_are_taken_once(monkeypatch):
    import dlperf.probe.cost as cost

    calls = []
    real = cost.count_step
    monkeypatch.setattr(cost, "count_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    floors = FloorModel(fixed_hardware)
    first = floors.floor("mlp", 8, 1)
    again = floors.floor("mlp", 8, 2)
    assert len(calls) == 1  # one count per (network, batch), whatever the thread count
    assert set(first.components) == {"compute", "memory", "dispatch"}
    assert first.floor_s > 0 and first.floor_s == max(first.components.values()) == again.floor_s
    # the compute term is the step's FLOPs at the hardware's peak; FLOPs checked against a plain count
    plain_flops = count_step_flops("mlp", 8)
    assert first.flops == pytest.approx(plain_flops, rel=0.02)
    assert first.components["compute"] == pytest.approx(first.flops / SEED_HW.peak_flops("float32"))
    floors.floor("mlp", 16, 1)
    assert len(calls) == 2


def test_a_cell_reports_floor_ratio_and_percent_of_peak():
    result = run_bench(BenchConfig(networks=["mlp"], devices=[cpu()], threads=[1], batch_size=8, steps=2,
                                   warmup=1, explain=True))
    d = result.to_dict()
    assert d["config"]["explain"] is True
    cell = d["cells"][0]
    assert cell["floor_s"] > 0 and set(cell["floor_components"]) >= {"compute", "memory", "dispatch"}
    assert cell["floor_s"] == pytest.approx(max(cell["floor_components"].values()))
    assert cell["measured_over_floor"] == pytest.approx(cell["median_s"] / cell["floor_s"])
    floor = result.cells[0].floor
    assert cell["pct_of_peak"] == pytest.approx(100 * floor.flops / cell["median_s"] / floor.peak_flops)
    assert cell["floor_source"].startswith(("probe cache (1 thread)", "estimated in-process (1 thread)"))


def test_without_a_probe_cache_the_floor_is_estimated_at_the_cells_thread_count(monkeypatch):
    import torch

    import dlperf.probe.cache as cache

    monkeypatch.setattr(cache, "load_probe", lambda *a, **k: None)
    seen = []
    real = explain._estimated_hardware
    monkeypatch.setattr(explain, "_estimated_hardware",
                        lambda t: seen.append(t) or real(t))
    before = torch.get_num_threads()
    hw, source = FloorModel.this_machine(1)
    assert seen == [1] and source == "estimated in-process (1 thread)" and hw.peak_flops() > 0
    assert torch.get_num_threads() == before


def test_explained_outputs_carry_the_floor_and_plain_ones_do_not():
    plain = run_bench(BenchConfig(networks=["mlp"], devices=[cpu()], threads=[1], batch_size=8, steps=2, warmup=1))
    assert "floor_s" not in plain.to_dict()["cells"][0] and "explain" not in plain.to_dict()["config"]
    assert next(csv.reader(io.StringIO(report.render_csv(plain)))) == list(report.CSV_FIELDS)
    assert "floor (s)" not in report.render_markdown(plain)

    explained = run_bench(BenchConfig(networks=["mlp"], devices=[cpu()], threads=[1], batch_size=8, steps=2,
                                      warmup=1, explain=True))
    rows = list(csv.DictReader(io.StringIO(report.render_csv(explained))))
    assert float(rows[0]["floor_s"]) > 0 and "compute=" in rows[0]["floor_components"]
    md = report.render_markdown(explained)
    assert "| floor (s) |" in md
    assert "x floor" in md and "% peak" in md and "floor figures:" in md


@pytest.mark.timeout(120)
def test_cli_explain_json(capsys):
    code = main(["bench", "--networks", "mlp", "--threads", "1", "--batch-size", "8", "--steps", "2",
                 "--warmup", "1", "--explain", "--json", "-"])
    assert code == 0
    out = capsys.readouterr().out
    cell = json.loads(out.strip().splitlines()[-1])["cells"][0]
    assert cell["floor_s"] > 0 and cell["floor_source"]
    assert "floor (s)" in out


def test_scaling_floor_adds_the_allreduce_of_the_trainers_algorithm():
    from dlperf.bench.scaling import row_floor

    floors = FloorModel(fixed_hardware)
    one = row_floor(floors, "resnet-56", 8, [cpu(0)], measured_s=1.0)
    two = row_floor(floors, "resnet-56", 8, [cpu(0), cpu(1)], measured_s=0.5)
    assert "allreduce:sharded" not in one["floor_components"]
    counts = floors.counts("resnet-56", 8)
    assert two["floor_components"]["allreduce:sharded"] == pytest.approx(
        allreduce_time("sharded", counts.param_bytes, 2, SEED_HW))
    assert two["floor_components"]["compute"] == pytest.approx(one["floor_components"]["compute"] / 2)
    assert two["measured_over_floor"] == pytest.approx(0.5 / two["floor_s"])
    assert "2 device(s), allreduce sharded" in two["floor_source"]


@pytest.mark.timeout(180)
def test_cli_scaling_explain_rows(capsys):
    code = main(["bench", "--scaling", "--networks", "resnet-56", "--devices", "cpu:0", "--batch-size", "4",
                 "--steps", "1", "--warmup", "0", "--explain", "--json", "-"])
    assert code == 0
    out = capsys.readouterr().out
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["explain"] is True
    row = doc["rows"][0]
    assert row["floor_s"] > 0 and row["measured_over_floor"] > 0 and row["floor_source"]
    assert "x floor" in out


def test_a_floor_above_the_measured_time_is_flagged_as_the_cost_models_error_naming_the_component():
    from dlperf.bench.explain import CellFloor, explain_footnotes, fmt_floor

    floor = CellFloor(0.0123, {"compute": 0.0123, "memory": 0.002}, "probe cache (2 threads)", 1e9, 1e11)
    said = floor.overshoot(0.0059)
    assert said is not None and "12.30 ms is above the measured 5.90 ms" in said
    assert "its compute component (12.30 ms) overshot" in said and "probe cache" in said
    assert fmt_floor(floor, 0.0059).endswith("!") and not fmt_floor(floor, 0.02).endswith("!")
    assert floor.overshoot(0.02) is None and floor.to_dict(0.0059)["floor_error"] == said
    assert f"! lenet: {said}" in explain_footnotes(["probe cache (2 threads)"], [f"lenet: {said}"])


def test_a_choice_made_on_contended_rounds_is_not_printed_as_a_gain():
    from dlperf.bench.auto import AutoChoice, _pick

    medians = {"eager": 0.010, "hybrid": 0.0007}
    per_round = {"eager": [0.010, 0.011, 0.010], "hybrid": [0.0007, 0.0008, 0.0007]}
    best, gain, _, contended = _pick(medians, per_round, contended=[True, True, True])
    assert best == "hybrid" and contended
    reason = AutoChoice(best, gain, medians, contended=contended).reason
    assert "chosen on contended rounds, for this run only" in reason and "no measured gain" in reason
    assert "x over eager" not in reason.split("(")[0]
    quiet = AutoChoice(*_pick(medians, per_round, contended=[False, True, False])[:2], medians).reason
    assert quiet.startswith("hybrid: 14.29x over eager")

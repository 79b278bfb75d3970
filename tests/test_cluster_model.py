"""bench_cluster's analysis on measurements made up from known links: the fits give the links back, every
prediction equals its cell and auto picks the best (no root, no processes: the arithmetic alone)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from dlperf.probe.cost import Link
from dlperf.probe.projection import STRATEGIES, HostCPU, Layout, layout_time

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_cluster_under_test", ROOT / "benchmarks" / "bench_cluster.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _measurements(bench, links: dict[str, Link], reduce_s: float, models: dict[str, int]) -> dict:
    hosts = [0, 0, 1, 1]
    cpu = HostCPU(1, reduce_s)  # 2 cores shared by 2 emulated hosts
    samples: dict[str, list[float]] = {}
    fits = {"pair": ("ring", Layout((0, 1))), "world": ("ring", Layout(tuple(hosts))),
            "sharded": ("sharded", Layout(tuple(hosts))), "intra": ("ring", Layout((0, 0))),
            "rpc": ("ps-1", bench._layout("ps-1", hosts)), "rpc2": ("ps-2", bench._layout("ps-2", hosts)),
            "hier": ("hierarchical", Layout(tuple(hosts)))}
    for name, (strategy, layout) in fits.items():
        link = links["network" if name == "world" else name]
        for n in bench.FIT_SIZES:
            samples[f"fit-{name}|{n}"] = [layout_time(strategy, n, layout, link, link)] * 3
    samples[f"reduce|{16 << 20}"] = [reduce_s * (16 << 20)] * 3
    for n in (64 << 10, 8 << 20):
        samples[f"allreduce|{n}"] = [layout_time("ring", n, Layout((0, 1)), links["pair"], links["intra"])] * 3
    for model, n in models.items():
        for s in ("ring", "sharded", "hierarchical", "ps-1", "ps-2"):
            rpc = links["rpc2"] if s == "ps-2" else links["rpc"]
            net, intra = (rpc, rpc) if s.startswith("ps-") else \
                (links["sharded"], links["intra"]) if s == "sharded" else \
                (links["pair"], links["intra"]) if s == "hierarchical" else (links["network"], links["intra"])
            samples[f"{s}|{model}"] = [layout_time(s, n, bench._layout(s, hosts), net, intra, cpu)] * 3
    return {"hosts": hosts, "kind": "hierarchical", "fit_sizes": list(bench.FIT_SIZES), "samples": samples,
            "contended": dict.fromkeys(samples, False)}


def test_links_made_up_are_fitted_back_and_every_cell_is_predicted(bench, monkeypatch):
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    links = {"pair": Link(150e-6, 0.12e9), "network": Link(600e-6, 0.6e9), "sharded": Link(2e-3, 0.3e9),
             "intra": Link(100e-6, 3e9), "rpc": Link(1e-3, 0.5e9), "rpc2": Link(1.5e-3, 0.4e9),
             "hier": Link(300e-6, 0.2e9)}
    models = {"lenet": 516272, "resnet18": 44703272}
    got = _measurements(bench, links, 80e-12, models)
    fitted = bench.measured_links(got)
    for name, link in links.items():
        assert fitted[name].alpha_s == pytest.approx(link.alpha_s, rel=1e-6), name
        assert fitted[name].bandwidth == pytest.approx(link.bandwidth, rel=1e-6), name
    assert bench.reduce_s_per_byte(got) == pytest.approx(80e-12)
    cells, choices = bench.analyse(10.0, got, models)
    assert len(cells) == 2 + 2 * 5 and max(c["error"] for c in cells) < 1e-6
    for choice in choices:
        assert choice["auto"] == choice["best"] and choice["within_10pct"]
    assert {c["cell"] for c in cells} == {"allreduce", *STRATEGIES} - {"naive"}
    # beside hierarchical's composed prediction, the same formula priced on the fit of the whole exchange
    for c in (c for c in cells if c["cell"] == "hierarchical"):
        own = layout_time("hierarchical", c["bytes"], Layout((0, 0, 1, 1)), links["hier"], links["hier"],
                          HostCPU(1, 80e-12))
        assert c["own_fit_s"] == pytest.approx(own, rel=1e-6)
        assert c["own_fit_error"] == pytest.approx(abs(own - c["measured_s"]) / c["measured_s"], rel=1e-6)


def test_each_host_counts_the_cores_of_its_smallest_share_or_a_turn_on_shared_ones(bench):
    assert bench._cores_per_host(None) is None
    assert bench._cores_per_host([[0], [1]]) == 1
    assert bench._cores_per_host([[0, 1], [2]]) == 1  # 3 cores over 2 hosts: the smaller share prices both
    assert bench._cores_per_host([[0], [1], [0]]) == pytest.approx(2 / 3)  # 3 hosts taking turns on 2 cores


def test_every_cell_records_the_links_around_its_size_that_priced_it(bench, monkeypatch):
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    links = {"pair": Link(150e-6, 0.12e9), "network": Link(600e-6, 0.6e9), "sharded": Link(2e-3, 0.3e9),
             "intra": Link(100e-6, 3e9), "rpc": Link(1e-3, 0.5e9), "rpc2": Link(1.5e-3, 0.4e9),
             "hier": Link(300e-6, 0.2e9)}
    got = _measurements(bench, links, 80e-12, {"lenet": 516272})
    cells, _ = bench.analyse(10.0, got, {"lenet": 516272})
    transport = {"allreduce": "pair", "hierarchical": "pair", "ps-1": "rpc", "ps-2": "rpc2", "sharded": "sharded",
                 "ring": "network"}
    for c in cells:
        want = links[transport[c["cell"]]]
        assert Link(*c["network_link"]).time(c["bytes"]) == pytest.approx(want.time(c["bytes"]), rel=1e-6), c


def test_a_recorded_run_is_priced_again_as_it_was_printed(bench, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(bench, "gradient_bytes", {"lenet": 516272, "resnet18": 44703272}.__getitem__)
    links = {"pair": Link(150e-6, 0.12e9), "network": Link(600e-6, 0.6e9), "sharded": Link(2e-3, 0.3e9),
             "intra": Link(100e-6, 3e9), "rpc": Link(1e-3, 0.5e9), "rpc2": Link(1.5e-3, 0.4e9),
             "hier": Link(300e-6, 0.2e9)}
    got = _measurements(bench, links, 80e-12, {"lenet": 516272, "resnet18": 44703272})
    run = tmp_path / "run.out"
    run.write_text("a table for people\n" + json.dumps({"measurements": {"10.0": got}, "link_down_exit_s": 12.5,
                                                          "elapsed_s": 3.0}) + "\n")
    assert bench.main(["--from-json", str(run)]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    cells, choices = bench.analyse(10.0, got, {"lenet": 516272, "resnet18": 44703272})
    assert out["cells"] == cells and out["choices"] == choices and out["link_down_exit_s"] == 12.5
    assert out["model_error_max"] < 1e-6 and out["auto_within_10pct"] == 1.0


@pytest.mark.parametrize("text", ["", "not json\n", '{"measurements": {}}\n', '{"measurements": {"x": {}}}\n'])
def test_a_file_that_is_not_a_recorded_run_gets_one_line_and_exit_2(bench, tmp_path, capsys, text):
    run = tmp_path / "run.out"
    run.write_text(text)
    assert bench.main(["--from-json", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(run) in err[0] and "bench_cluster run" in err[0], err


def _spoil(doc: dict, what: str) -> str:
    """A recorded run with one figure made wrong as a hostile or damaged file could make it."""
    got = doc["measurements"]["10.0"]
    if what == "loadavg text":
        doc["loadavg_before"] = "abc"
    elif what == "loadavg null":
        doc["loadavg_after"] = None
    elif what == "exit text":
        doc["link_down_exit_s"] = "x"
    elif what == "errors number":
        doc["link_down_errors"] = 5
    elif what == "pairs list":
        doc["slow_link_pair_ms"] = [1]
    elif what == "zero sample":
        got["samples"]["ring|lenet"] = [0.0]
    elif what == "no hosts":
        got["hosts"] = []
    elif what == "rate twice":
        doc["measurements"]["10"] = got
    elif what == "empty samples":
        got["samples"]["fit-pair|4096"] = []
    text = json.dumps(doc)
    if what == "nan sample":
        text = text.replace(str(got["samples"]["ring|lenet"][0]), "NaN", 1)
    return text + "\n"


@pytest.mark.parametrize("what", ["loadavg text", "loadavg null", "exit text", "errors number", "pairs list",
                                  "zero sample", "no hosts", "rate twice", "empty samples", "nan sample"])
def test_a_damaged_recorded_run_gets_one_line_and_exit_2(bench, monkeypatch, tmp_path, capsys, what):
    monkeypatch.setattr(bench, "gradient_bytes", {"lenet": 516272, "resnet18": 44703272}.__getitem__)
    links = {"pair": Link(150e-6, 0.12e9), "network": Link(600e-6, 0.6e9), "sharded": Link(2e-3, 0.3e9),
             "intra": Link(100e-6, 3e9), "rpc": Link(1e-3, 0.5e9), "rpc2": Link(1.5e-3, 0.4e9),
             "hier": Link(300e-6, 0.2e9)}
    got = _measurements(bench, links, 80e-12, {"lenet": 516272, "resnet18": 44703272})
    doc = {"measurements": {"10.0": got}, "loadavg_before": [1.0, 1.0, 1.0], "loadavg_after": [1.0, 1.0, 1.0],
           "link_down_exit_s": 12.0, "link_down_errors": ["a", "b"], "slow_link_pair_ms": {"slow": {"0-1": 1.0}}}
    run = tmp_path / "run.out"
    run.write_text(_spoil(doc, what))
    assert bench.main(["--from-json", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(run) in err[0], err


def test_a_missing_recorded_run_gets_one_line_and_exit_2(bench, tmp_path, capsys):
    assert bench.main(["--from-json", str(tmp_path / "nothing.out")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "nothing.out" in line and "No such file" in line


def test_a_fifo_given_as_a_recorded_run_is_refused_not_waited_on(bench, tmp_path, capsys):
    fifo = tmp_path / "run.out"
    os.mkfifo(fifo)
    assert bench.main(["--from-json", str(fifo)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1

"""``dlperf.bench.run``: the sweep from Python, shown as the CLI's table, HTML, rows or a DataFrame."""

from __future__ import annotations

import io
import sys

import pytest

import dlperf.bench as bench
from dlperf.bench import report
from dlperf.errors import UsageError


@pytest.fixture(scope="module")
def tiny():
    return bench.run(networks="mlp", devices="cpu", threads=1, batch_size=8, steps=2, warmup=1)


def test_run_returns_the_runners_result_with_the_asked_config(tiny):
    from dlperf.bench.result import BenchResult

    assert isinstance(tiny, BenchResult)
    c = tiny.config
    assert (c.networks, [str(d) for d in c.devices], c.threads, c.batch_size, c.steps, c.warmup, c.mode) == \
        (["mlp"], ["cpu(0)"], [1], 8, 2, 1, "eager")
    assert len(tiny.cells) == 1 and tiny.cells[0].timing is not None


def test_str_is_the_terminal_table(tiny):
    from rich.console import Console

    text = str(tiny)
    buf = io.StringIO()
    report.render_terminal(tiny, Console(file=buf, width=200, color_system=None))
    assert text == buf.getvalue()
    assert "dlperf (s)" in text and "mlp" in text and "Machine:" in text


def test_rich_renders_the_table_and_notes(tiny):
    from rich.console import Console

    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(tiny)
    out = console.file.getvalue()
    assert "dlperf (s)" in out and "Time per mini-batch (median" in out


def test_html_is_a_table_of_the_grid_with_values_escaped(tiny):
    cell = tiny.cells[0]
    saved = cell.timing, cell.error
    cell.timing, cell.error = None, "<script>alert(1)</script> & more"
    try:
        html = tiny._repr_html_()
    finally:
        cell.timing, cell.error = saved
    assert html.startswith("<table>") and "<script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in html
    header, rows = report.table_grid(tiny)
    assert html.count("<tr") == 1 + len(rows) and all(f"<th>{h}</th>" in html for h in header if h)


def test_rows_are_flat_dicts_with_the_csv_columns(tiny):
    rows = tiny.to_rows()
    assert len(rows) == 1 and list(rows[0]) == list(report.CSV_FIELDS)
    d = tiny.cells[0].to_dict()
    assert rows[0]["median_s"] == d["median_s"] and rows[0]["samples"] == 2 and rows[0]["network"] == "mlp"


def test_rows_carry_the_floor_when_explained():
    result = bench.run(networks=["mlp"], devices=["cpu"], threads=[1], batch_size=8, steps=2, warmup=1,
                       explain=True)
    row = result.to_rows()[0]
    assert row["floor_s"] > 0 and isinstance(row["floor_components"], dict) and row["floor_source"]


def test_to_pandas_without_pandas_names_the_install(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas now raises ImportError
    with pytest.raises(UsageError, match="pip install pandas"):
        tiny.to_pandas()


def test_to_pandas_gives_the_rows_as_a_frame(tiny):
    pd = pytest.importorskip("pandas")
    frame = tiny.to_pandas()
    assert isinstance(frame, pd.DataFrame) and list(frame.columns) == list(report.CSV_FIELDS)
    assert frame.loc[0, "median_s"] == tiny.to_rows()[0]["median_s"]


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"networks": 5}, "networks"),
    ({"networks": ""}, "networks"),
    ({"networks": "nope"}, "nope"),
    ({"devices": 3}, "devices"),
    ({"devices": "tpu"}, "tpu"),
    ({"threads": 0}, "threads"),
    ({"threads": [1, "2"]}, "threads"),
    ({"threads": True}, "threads"),
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": 2.5}, "batch_size"),
    ({"steps": 0}, "steps"),
    ({"warmup": -1}, "warmup"),
    ({"mode": "fast"}, "fast"),
    ({"mode": None}, "mode"),
    ({"explain": "yes"}, "explain"),
    ({"quick": 1}, "quick"),
])
def test_bad_arguments_raise_one_clear_usage_error_before_timing(kwargs, names, monkeypatch):
    import dlperf.bench.api as api

    monkeypatch.setattr(api, "run_bench", lambda config: pytest.fail("timed despite a bad argument"))
    with pytest.raises(UsageError, match=names):
        bench.run(**{"networks": "mlp", "devices": "cpu", "threads": 1, **kwargs})


def test_quick_uses_the_quick_config(monkeypatch):
    import dlperf.bench.api as api

    seen = []
    monkeypatch.setattr(api, "run_bench", seen.append)
    bench.run(networks="mlp", devices="cpu", threads=1, quick=True)
    bench.run(networks="mlp", devices="cpu", threads=1, quick=True, steps=3)
    assert (seen[0].steps, seen[0].warmup, seen[0].max_cell_seconds) == (5, 1, 12.0)
    assert seen[1].steps == 3


def test_unknown_attribute_of_the_package_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        bench.no_such_name  # noqa: B018

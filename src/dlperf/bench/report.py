"""Render a sweep like the paper's Table 7: a block of rows per network, a column per device and thread count.

In each network's block, today's time comes first, then the achieved FLOP/s, then the paper's
Torch figure and its best tool for the same column, and how many times faster today is than Torch.
Outside eager mode two more rows give the compile time and the backend that ran the step.
A time is followed by ``~`` when its steps disagreed and by ``!`` when the machine was busy while it
was measured (the footnotes say why); a line under the table calls out thread counts that were
slower than fewer threads.
"""

from __future__ import annotations

import csv
import io
import json
from typing import TYPE_CHECKING

from ..devices import Device
from .explain import explain_footnotes, fmt_floor, fmt_pct, fmt_ratio

if TYPE_CHECKING:  # the result imports this module for its notebook views
    from .result import BenchResult, CellResult

ROW_LABELS = ("dlperf (s)", "GFLOP/s", "Torch 2016 (s)", "best 2016 (s)", "vs Torch 2016")
COMPILE_ROW_LABELS = ("compile (s)", "backend")
EXPLAIN_ROW_LABELS = ("floor (s)", "x floor", "% peak")
AUTO_ROW_LABELS = ("auto choice", "vs eager")
NOISY_MARK = "~"
CONTENDED_MARK = "!"


def row_labels(result: BenchResult) -> tuple[str, ...]:
    """The rows of each network's block: compile time and backend only where something is compiled."""
    c = result.config
    return ROW_LABELS + (COMPILE_ROW_LABELS if c.mode != "eager" else ()) \
        + (EXPLAIN_ROW_LABELS if c.explain else ()) + (AUTO_ROW_LABELS if c.mode == "auto" else ())


def column_label(device: Device, threads: int | None) -> str:
    if threads is None:
        return str(device)
    return f"{device} {threads} thread{'s' if threads != 1 else ''}"


def _columns(result: BenchResult) -> list[tuple[Device, int | None]]:
    seen: dict[tuple[Device, int | None], None] = {}
    for c in result.cells:
        seen.setdefault((c.device, c.threads), None)
    return list(seen)


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x >= 0.01 else f"{x * 1e3:.2f}ms"


def _cell_rows(cell: CellResult | None, labels: tuple[str, ...]) -> list[str]:
    if cell is None:
        return [""] * len(labels)
    paper = cell.paper
    if cell.timing is None:
        ours = f"- ({cell.error})" if cell.error else "-"
    else:
        ours = _fmt_s(cell.timing.median_s) + (NOISY_MARK if cell.timing.noisy else "") \
            + (CONTENDED_MARK if cell.contended else "")
    gflops = f"{cell.achieved_flops / 1e9:.1f}" if cell.achieved_flops else "-"
    torch_s = _fmt_s(paper.torch_s) if paper else "n/a"
    best = f"{_fmt_s(paper.best_s)} {paper.best_framework}" if paper and paper.best_s else ("-" if paper else "n/a")
    ratio = cell.speedup_vs_paper_torch
    vs = f"{ratio:.1f}x faster" if ratio and ratio >= 1 else (f"{1 / ratio:.1f}x slower" if ratio else "-")
    by_label = dict(zip(ROW_LABELS, [ours, gflops, torch_s, best, vs]))
    by_label.update(zip(COMPILE_ROW_LABELS, [_fmt_s(cell.compile_s), cell.backend or "-"]))
    by_label.update(zip(EXPLAIN_ROW_LABELS, [fmt_floor(cell.floor, cell.timing.median_s if cell.timing else None),
                                             fmt_ratio(cell.measured_over_floor),
                                             fmt_pct(cell.pct_of_peak)]))
    gain = f"{cell.gain_over_eager:.2f}x" if cell.gain_over_eager else "-"
    by_label.update(zip(AUTO_ROW_LABELS, [cell.mode_chosen or "-", gain]))
    return [by_label[label] for label in labels]


def table_grid(result: BenchResult) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the Table-7 layout, as plain strings."""
    cols = _columns(result)
    by_key = {(c.network, c.device, c.threads): c for c in result.cells}
    header = ["network", "batch", ""] + [column_label(d, t) for d, t in cols]
    labels = row_labels(result)
    rows: list[list[str]] = []
    # an interrupted sweep lists only the networks it reached
    for net in [n for n in result.config.networks if any(c.network == n for c in result.cells)]:
        per_col = [_cell_rows(by_key.get((net, d, t)), labels) for d, t in cols]
        batches = sorted({c.batch_size for c in result.cells if c.network == net})
        for i, label in enumerate(labels):
            first = [net, "/".join(map(str, batches)), label] if i == 0 else ["", "", label]
            rows.append(first + [pc[i] for pc in per_col])
    return header, rows


def footnotes(result: BenchResult) -> list[str]:
    m = result.machine
    c = result.config
    gpus = ", ".join(m["gpus"]) or "none"
    notes = [f"INTERRUPTED: {len(result.cells)} of {result.planned} cells finished; the rest did not run."] \
        if result.interrupted else []
    notes += [
        f"Time per mini-batch (median of timed steps; forward, loss, backward, SGD update), mode {c.mode}.",
        f"Machine: {m['cpu']}, {m['cores']} cores; GPUs: {gpus}; torch {m['torch']}; {m['date']}.",
        "Paper: Shi et al. 2016, Table 7 (desktop i7-3820 for CPU columns, GTX 1080 for GPUs). "
        f"{NOISY_MARK} marks a noisy cell (interquartile range > 10% of median).",
    ]
    if c.mode != "eager":
        notes.append("compile (s): building the step and its first call, beyond a steady step; "
                     "backend: what ran it." + (" In auto mode it includes timing the candidates." if
                                                c.mode == "auto" else ""))
        notes += [f"  {cell.network}, {column_label(cell.device, cell.threads)}: eager, {cell.eager_reason}"
                  for cell in result.cells if cell.eager_reason]
    if c.explain:
        notes += explain_footnotes([cell.floor.source if cell.floor else cell.floor_note for cell in result.cells],
                                   [f"{cell.network} {column_label(cell.device, cell.threads)}: "
                                    f"{cell.floor.overshoot(cell.timing.median_s)}" for cell in result.cells
                                    if cell.floor and cell.timing and cell.floor.overshoot(cell.timing.median_s)])
    if c.mode == "auto":
        notes.append("auto choice: the fastest variant timed alternately against eager in the same cell "
                     "(eager is kept unless another beats it by more than 5% in every round); vs eager: its gain. Why:")
        notes += [f"  {cell.network}, {column_label(cell.device, cell.threads)}: {cell.auto_reason}"
                  for cell in result.cells if cell.auto_reason]
    return notes + contention_notes(result)


def contention_notes(result: BenchResult) -> list[str]:
    """Why each marked cell is not to be trusted; empty on a quiet run."""
    marked = [c for c in result.cells if c.contended]
    if not marked:
        return []
    notes = [f"{CONTENDED_MARK} marks a cell timed while other work competed for its CPUs; its time is "
             "not the step's cost. Rerun on a quiet machine:"]
    notes += [f"  {CONTENDED_MARK} {c.network}, {column_label(c.device, c.threads)}: {c.contention}" for c in marked]
    return notes


def warning_lines(result: BenchResult) -> list[str]:
    return [f"warning: {line}" for line in result.thread_warnings()]


TITLE = "Time per mini-batch (seconds), dlperf today beside Shi et al. 2016"


def _rich_table(result: BenchResult):
    from rich.table import Table

    header, rows = table_grid(result)
    table = Table(title=TITLE, show_lines=False, header_style="bold")
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i < 3 else "right", no_wrap=i < 3)
    n = len(row_labels(result))
    for i, row in enumerate(rows):
        table.add_row(*row, end_section=(i % n == n - 1))
    return table


def _styled_lines(result: BenchResult) -> list[tuple[str, str]]:
    lines = [(line, "yellow") for line in warning_lines(result)]
    return lines + [(line, "bold yellow" if line.lstrip().startswith(CONTENDED_MARK) else "dim")
                    for line in footnotes(result)]


def rich_renderable(result: BenchResult):
    """The table and its notes as one rich renderable (what ``rich.print(result)`` shows)."""
    from rich.console import Group
    from rich.text import Text

    return Group(_rich_table(result), *(Text(line, style=style) for line, style in _styled_lines(result)))


def render_terminal(result: BenchResult, console=None) -> None:
    """Print the table with rich (to stdout unless a console is given)."""
    import sys

    from rich.console import Console

    # Piped output has no terminal width; keep the table unwrapped for files and pagers.
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    console.print(_rich_table(result))
    for line, style in _styled_lines(result):
        console.print(line, style=style, highlight=False, markup=False)


def render_html(result: BenchResult) -> str:
    """The table as HTML for Jupyter; every value is escaped."""
    from html import escape

    header, rows = table_grid(result)
    n = len(row_labels(result))
    out = [f"<table><caption>{escape(TITLE)}</caption>",
           "<thead><tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr></thead><tbody>"]
    for i, row in enumerate(rows):
        style = ' style="border-bottom: 1px solid"' if i % n == n - 1 else ""
        out.append(f"<tr{style}>" + "".join(f"<td>{escape(v)}</td>" for v in row) + "</tr>")
    out.append("</tbody></table>")
    out += [f"<p><small>{escape(line)}</small></p>" for line, _ in _styled_lines(result)]
    return "\n".join(out)


def render_markdown(result: BenchResult) -> str:
    header, rows = table_grid(result)
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    out.append("")
    out += [f"{line}  " for line in warning_lines(result) + footnotes(result)]
    return "\n".join(out) + "\n"


CSV_FIELDS = ("network", "device", "threads", "batch_size", "mode", "median_s", "q1_s", "q3_s", "min_s",
              "max_s", "noisy", "contended", "contention", "samples", "achieved_gflops", "paper_torch_s",
              "paper_best_s", "paper_best_framework", "speedup_vs_paper_torch", "compile_s", "backend", "error")


EXPLAIN_CSV_FIELDS = ("floor_s", "floor_bottleneck", "floor_components", "measured_over_floor", "pct_of_peak",
                      "floor_source")
AUTO_CSV_FIELDS = ("mode_chosen", "gain_over_eager", "auto_reason")


def csv_fields(result: BenchResult) -> tuple[str, ...]:
    """The CSV columns: the floor's and auto mode's only when the sweep has them."""
    c = result.config
    return CSV_FIELDS + (EXPLAIN_CSV_FIELDS if c.explain else ()) + (AUTO_CSV_FIELDS if c.mode == "auto" else ())


def render_csv(result: BenchResult) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=csv_fields(result))
    w.writeheader()
    for cell in result.cells:
        row = flat_row(result, cell)
        if row.get("floor_components") is not None:
            row["floor_components"] = ";".join(f"{k}={v:.6g}" for k, v in row["floor_components"].items())
        w.writerow(row)
    return buf.getvalue()


def flat_row(result: BenchResult, cell: CellResult) -> dict:
    """One cell as a flat dict with the CSV's columns, in order."""
    d = cell.to_dict()
    spread = d["spread"] or {}
    paper = d["paper"] or {}
    row = {
        **{k: d[k] for k in EXPLAIN_CSV_FIELDS + AUTO_CSV_FIELDS if k in d},
        **{k: d[k] for k in ("network", "device", "threads", "batch_size", "mode", "median_s", "noisy",
                             "contended", "contention", "achieved_gflops", "speedup_vs_paper_torch",
                             "compile_s", "backend", "error")},
        **{k: spread.get(k) for k in ("q1_s", "q3_s", "min_s", "max_s")},
        "samples": len(d["samples"]),
        "paper_torch_s": paper.get("torch_s"),
        "paper_best_s": paper.get("best_s"),
        "paper_best_framework": paper.get("best_framework"),
    }
    return {k: row.get(k) for k in csv_fields(result)}


def render_json(result: BenchResult) -> str:
    """One line, so that ``| tail -1`` gives a parseable document."""
    return json.dumps(result.to_dict(), separators=(",", ":"))


def render_plot(result: BenchResult, path: str) -> None:
    """Thread scaling: time per mini-batch against CPU threads, one line per network (log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from ..errors import UsageError

        raise UsageError("plot=... needs matplotlib; install it with: pip install 'dlperf[plot]'") from None

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for net in result.config.networks:
        pts = sorted((c.threads, c.timing.median_s) for c in result.cells
                     if c.network == net and c.threads is not None and c.timing is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=net)
    threads = sorted({c.threads for c in result.cells if c.threads is not None})
    save_scaling_plot(fig, ax, path, xs=threads, xlabel="intra-op threads",
                      title=f"CPU thread scaling ({result.machine['cpu']})", title_size=9)


def save_scaling_plot(fig, ax, path: str, *, xs: list[int], xlabel: str, title: str, title_size: int) -> None:
    """The shared look of bench's scaling plots (log-log, powers of two on x), written atomically as PNG."""
    import matplotlib.pyplot as plt

    from .._io import atomic_write_bytes

    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("seconds per mini-batch")
    ax.set_title(title, fontsize=title_size)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    ax.grid(True, which="both", alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())

"""BENCHMARKS.md, rendered from one record per benchmark; and the way a benchmark's run becomes its record.

    python benchmarks/report.py                      # write BENCHMARKS.md from benchmarks/results/*.json
    python benchmarks/report.py --check              # exit 1 if BENCHMARKS.md is not what the records render
    python benchmarks/report.py run data_parallel    # run its reference command, save the record, write BENCHMARKS.md
    python benchmarks/report.py run data_parallel -- python benchmarks/bench_data_parallel.py --no-ddp

A record (``benchmarks/results/<name>.json``) is one run: the benchmark's JSON last line as ``figures``, with
the command, date, machine, load and whether the run was contended. Which figures the page shows, and
their targets, are declared here (:data:`BENCHMARKS`). A record that fails a check is refused in one line
naming the file and the field, exit status 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlperf._cliargs import one_line
from dlperf._io import FileAccessError, atomic_write_text, decode_json, read_bounded

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "BENCHMARKS.md"
MAX_RECORD_BYTES = 8 * 2**20
MAX_DEPTH = 8


@dataclass(frozen=True)
class Figure:
    """One figure shown in a benchmark's table: a path into ``figures`` (``a.b``, ``cells.0.x``) and its target."""

    path: str
    target: str | None = None


@dataclass(frozen=True)
class Table:
    """A figure that is a dict of rows or a list of rows, shown as a table of the given (header, path) columns."""

    path: str
    columns: tuple[tuple[str, str], ...]
    key: str | None = None
    """Header of the first column, which holds each row's key when the rows are a dict."""
    targets: dict[str, str] = field(default_factory=dict)
    """Targets of columns, by path: judged on every row, one line under the table."""


@dataclass(frozen=True)
class Benchmark:
    name: str
    title: str
    command: str
    """The reference command: what ``report.py run NAME`` runs and what the page says reproduces the figure."""
    figures: tuple[Figure, ...] = ()
    tables: tuple[Table, ...] = ()


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("table7", "Table 7: time per mini-batch, the paper's seven networks (`dlperf bench --quick`)",
              "dlperf bench --quick --json",
              tables=(Table("cells", (("network", "network"), ("batch", "batch_size"), ("threads", "threads"),
                                      ("dlperf s", "median_s"), ("noisy", "noisy"), ("GFLOP/s", "achieved_gflops"),
                                      ("Torch 2016 s", "paper.torch_s"), ("best 2016 s", "paper.best_s"),
                                      ("best 2016", "paper.best_framework"),
                                      ("vs Torch", "speedup_vs_paper_torch"))),)),
    Benchmark("table8", "Table 8: 1..k devices, global batch split (`dlperf bench --scaling --quick`)",
              "dlperf bench --scaling --quick --json",
              tables=(Table("rows", (("network", "network"), ("devices", "devices"), ("batch", "global_batch"),
                                     ("dlperf s", "median_s"), ("speedup", "speedup"),
                                     ("K80: Caffe", "paper_s.Caffe"), ("CNTK", "paper_s.CNTK"), ("TF", "paper_s.TF"),
                                     ("MXNet", "paper_s.MXNet"), ("Torch", "paper_s.Torch"))),)),
    Benchmark("mode_auto", "`dlperf bench --mode auto`: what dlperf can apply, against eager",
              "dlperf bench --networks lenet --threads 2 --batch-size 256 --mode auto --json",
              tables=(Table("cells", (("network", "network"), ("batch", "batch_size"), ("threads", "threads"),
                                      ("chosen", "mode_chosen"), ("median_s", "median_s"),
                                      ("gain_over_eager", "gain_over_eager"), ("contended", "contended")),
                            targets={"gain_over_eager": ">= 1.5"}),)),
    Benchmark("mode_hybrid", "`dlperf bench --mode hybrid`: the whole training step captured, against eager",
              "dlperf bench --quick --devices cpu --threads 1 --networks mlp,lenet,alexnet-r,resnet-56 --mode hybrid "
              "--json",
              tables=(Table("cells", (("network", "network"), ("batch", "batch_size"), ("backend", "backend"),
                                      ("median_s", "median_s"), ("contended", "contended"),
                                      ("eager median_s", "eager_median_s"), ("eager contended", "eager_contended"),
                                      ("vs eager", "speedup_vs_eager"))),)),
    Benchmark("harness_overhead", "Harness overhead: `dlperf bench`'s cell against a bare loop",
              "python benchmarks/bench_harness_overhead.py --rounds 5 --steps 10",
              figures=(Figure("harness_ms"), Figure("bare_ms"), Figure("overhead_pct", "<= 2"))),
    Benchmark("engine", "Asynchronous engine: cost per operation (d2l 12.2-12.3)",
              "python benchmarks/bench_engine.py --quick",
              figures=(Figure("torch_us_per_op"), Figure("async_us_per_op"), Figure("async_vs_torch", "<= 1.5"),
                       Figure("sync_vs_torch", "<= 4"), Figure("async_no_auto_bulk_vs_torch"),
                       Figure("async_batched_share_min"), Figure("frontend_fraction", "<= 0.002"),
                       Figure("parallel_ratio", "<= 1.15"))),
    Benchmark("book_ch12", "The book's chapter 12 examples, timed (`docs/from-the-book.md`)",
              "python benchmarks/bench_book_ch12.py --quick",
              figures=(Figure("1000 x (x+1), per op: torch eager"), Figure("1000 x (x+1), per op: engine async"),
                       Figure("1000 x (x+1), per op: engine sync"), Figure("1000 x (x+1), per op: naive engine"))),
    Benchmark("hybridize", "hybridize and the captured training step (d2l 12.1)",
              "python benchmarks/bench_hybridize.py --no-compile --samples 7 --train-samples 7 --train-steps 3",
              figures=(Figure("train_eager_b1_us"), Figure("train_step_b1_us"),
                       Figure("train_step_speedup_b1", ">= 4"), Figure("train_step_vs_floor_b1", "<= 3"),
                       Figure("train_step_speedup_b64", ">= 1.5"), Figure("lenet_train_step_speedup", ">= 0.98"),
                       Figure("resnet56_train_step_speedup", ">= 0.98"), Figure("capture_s", "<= 2"))),
    Benchmark("data_parallel",
              "Data parallelism in one process: the Trainer against plain loops and DDP (d2l 12.5-12.6)",
              "python benchmarks/bench_data_parallel.py",
              figures=(Figure("trainer_2dev_ms"), Figure("plain_2thread_channels_last_ms"),
                       Figure("speedup_vs_one", ">= 1.9"), Figure("ratio_vs_best_plain", "<= 1.0"),
                       Figure("ratio_vs_ddp", "<= 0.7"), Figure("ratio_vs_bare_replicas"),
                       Figure("small_ratio_vs_bare_replicas"), Figure("bucket_busbw_ratio", ">= 0.9"))),
    Benchmark("allreduce_model", "Allreduce: the cost model's ranking against measurement",
              "python benchmarks/bench_allreduce_model.py",
              figures=(Figure("best_agrees_cases"), Figure("order_agrees_cases"),
                       Figure("ranking_agrees", "== true"))),
    Benchmark("proc_allreduce", "Allreduce between the processes of one host: shared memory against gloo",
              "python benchmarks/bench_proc_allreduce.py",
              figures=(Figure("proc_allreduce_busbw_gbs", ">= 8"), Figure("gloo_busbw_gbs"),
                       Figure("copy_ceiling_gbs"), Figure("fraction_of_copy_ceiling"))),
    Benchmark("distributed", "The Trainer across 2 processes against DDP",
              "python benchmarks/bench_distributed.py",
              figures=(Figure("trainer_ms"), Figure("ddp_ms"), Figure("ratio_vs_ddp_procs", "<= 0.9"),
                       Figure("ratio_vs_ddp_procs_channels_last"))),
    Benchmark("kvstore_dist", "Parameter servers (`dist_sync`) against the single-process store (d2l 12.7)",
              "python benchmarks/bench_kvstore_dist.py",
              figures=(Figure("dist_sync_ms"), Figure("rpc_only_ms"), Figure("local_ms"),
                       Figure("dist_vs_local", "<= 2"))),
    Benchmark("kvstore_local",
              "The local KVStore's push+pull of 2 x 4 MB against MXNet 1.9.1's, interleaved in one process",
              "python benchmarks/bench_kvstore_dist.py --local --rounds 7",
              tables=(Table("runs", (("run", "run"), ("threads", "threads"), ("dlperf ms", "dlperf_ms"),
                                     ("torch by hand ms", "torch_ms"), ("MXNet ms", "mxnet_ms"),
                                     ("mxnet_over_dlperf", "mxnet_over_dlperf"), ("rounds' range", "rounds_range"),
                                     ("contended", "contended")),
                            targets={"mxnet_over_dlperf": ">= 2.5", "dlperf_ms": "<= 0.70"}),)),
    Benchmark("netns", "Two hosts in network namespaces: allreduce, LeNet against DDP, a killed worker",
              "python benchmarks/bench_netns.py",
              figures=(Figure("netns_lenet_trainer_ms"), Figure("netns_lenet_ddp_ms"), Figure("netns_ratio_vs_ddp"),
                       Figure("busbw_gbs.67108864"), Figure("fault_exit_s", "<= 15"))),
    Benchmark("cluster", "The cluster you don't have: shaped links, measured strategies against `dlperf scale`'s model",
              "python benchmarks/bench_cluster.py",
              figures=(Figure("model_error_median", "<= 0.15"), Figure("model_error_max", "<= 0.35"),
                       Figure("auto_within_10pct", ">= 0.9"), Figure("link_down_exit_s", "<= 15"),
                       Figure("slow_link_straggler", "== 2"), Figure("slow_link_weights_equal", "== true"))),
    Benchmark("plan", "Plans: the planner's choice against hand-written peers",
              "python benchmarks/bench_plan.py",
              figures=(Figure("trainer_overhead"), Figure("cached_planning_ms"), Figure("at_most_1"),
                       Figure("at_most_0_9")),
              tables=(Table("models", (("batch", "batch"), ("plan", "plan"), ("planned ms", "planned_ms"),
                                       ("best peer", "best_peer"),
                                       ("peer ms", "best_peer_ms"), ("plan_vs_best_peer", "plan_vs_best_peer"),
                                       ("planning_s", "planning_s"), ("contended", "contended")),
                            key="model", targets={"plan_vs_best_peer": "<= 1.0", "planning_s": "<= 30"}),)),
    Benchmark("plan_processes", "dlperf's Trainer as 2 processes against DDP, the same processes in turn",
              "python benchmarks/bench_plan_processes.py",
              tables=(Table("models", (("dlperf ms, each round", "dlperf_ms"), ("DDP ms, each round", "ddp_ms"),
                                       ("dlperf_over_ddp", "dlperf_over_ddp")), key="model"),)),
    Benchmark("trainer_step", "The Trainer's step under a plan, against the plain loop making the same choices",
              "python benchmarks/bench_trainer_step.py --rounds 5 --steps 4",
              tables=(Table("rows", (("plan", "plan"), ("Trainer ms", "trainer_ms"), ("plain ms", "plain_ms"),
                                     ("trainer_over_plain", "trainer_over_plain"), ("contended", "contended")),
                            key="row", targets={"trainer_over_plain": "<= 1.0"}),)),
    Benchmark("your_loop", "Your own loop under `dlperf.Loop`, against the same loop written plainly",
              "python benchmarks/bench_your_loop.py",
              tables=(Table("models", (("what", "what"), ("plain ms", "plain_ms"),
                                       ("best plain threads", "best_plain_threads"),
                                       ("wrapped ms (1 thread)", "wrapped_1t_ms"),
                                       ("own_loop_overhead", "own_loop_overhead"),
                                       ("overhead in CPU time", "own_loop_overhead_cpu"), ("auto ms", "auto_ms"),
                                       ("auto's plan", "auto_plan"),
                                       ("own_loop_auto_vs_plain", "own_loop_auto_vs_plain"),
                                       ("tuning steps", "tuning_steps"), ("tuning s", "tuning_s"),
                                       ("contended", "any_contended")),
                            key="model",
                            targets={"own_loop_overhead": "<= 1.03", "own_loop_auto_vs_plain": "<= 1.0"}),)),
    Benchmark("batches", "What a batch structure (a dict) costs the Trainer, against a tensor batch",
              "python benchmarks/bench_batches.py",
              figures=(Figure("trainer_tensor_ms"), Figure("trainer_dict_ms"), Figure("plain_dict_ms"),
                       Figure("dict_over_tensor", "<= 1.05"), Figure("split_tensor_us"), Figure("split_dict_us"))),
    Benchmark("probe", "Hardware probe: this machine beside d2l Tables 12.4.1-12.4.2 (`dlperf probe --quick`)",
              "dlperf probe --quick --json",
              tables=(Table("rows", (("what", "what"), ("this machine", "value"), ("unit", "unit"),
                                     ("d2l 12.4", "seed"), ("ratio", "ratio"))),)),
    Benchmark("probe_references", "The probe against reference tools (plain C STREAM and pointer chase, torch's Timer)",
              "python benchmarks/bench_probe.py",
              figures=(Figure("stream_triad_ratio", "0.9..1.1"), Figure("stream_triad_1t_ratio", "0.9..1.1"),
                       Figure("mm_peak_ratio", "0.9..1.1"), Figure("chase_ratio", "0.9..1.1"),
                       Figure("chase_l1_ratio", "0.9..1.1"))),
)
BY_NAME = {b.name: b for b in BENCHMARKS}

FIELDS: dict[str, tuple[type, ...]] = {
    "benchmark": (str,), "command": (str,), "date": (str,), "time": (str, type(None)), "machine": (str,),
    "load": (str, type(None)), "contended": (bool, type(None)), "commit": (str, type(None)), "runs": (int,),
    "source": (str,), "note": (str, type(None)), "figures": (dict,),
}
SOURCES = {"json": "from its JSON last line",
           "text": "as the page stated them before it was generated (no JSON line kept)"}
HEX = re.compile(r"[0-9a-f]{7,40}")
DAY = re.compile(r"\d{4}-\d{2}-\d{2}")
TARGET = re.compile(r"(<=|>=|==) (-?[0-9.]+|true|false)|(-?[0-9.]+)\.\.(-?[0-9.]+)")


class RecordError(ValueError):
    """A record that cannot be rendered; the message is one line naming the file, the field and the fix."""


def _fail(where: str, problem: str, name: str | None = None) -> RecordError:
    again = f"python benchmarks/report.py run {name}" if name in BY_NAME else "python benchmarks/report.py run NAME"
    return RecordError(f"{where}: {problem}; mend the record or record the benchmark again ({again})")


def _check_value(value: Any, where: str, fail: Callable[[str], RecordError], depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise fail(f"{where} nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            if one_line(key) != key:
                raise fail(f"{where} has a key with control characters ({one_line(key)[:40]!r})")
            _check_value(item, f"{where}.{key}", fail, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_value(item, f"{where}.{i}", fail, depth + 1)
    elif isinstance(value, str):
        if one_line(value) != value:
            raise fail(f"{where} holds control characters ({one_line(value)[:40]!r}), which would break the page")
    elif value is not None and not isinstance(value, (bool, int, float)):
        raise fail(f"{where} is a {type(value).__name__}, not a figure")


def _check_fields(record: dict[str, Any], fail: Callable[[str], RecordError]) -> None:
    missing = [k for k in FIELDS if k not in record]
    unknown = [k for k in record if k not in FIELDS]
    if missing or unknown:
        raise fail(f"lacks {', '.join(missing)}" if missing else f"has unknown fields {', '.join(unknown)}")
    for key, types in FIELDS.items():
        value = record[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            wanted = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise fail(f"{key} is {json.dumps(value)[:40]}, expected {wanted}")
        if isinstance(value, str) and (one_line(value) != value or len(value) > 600):
            raise fail(f"{key} is not one printable line of at most 600 characters")


def check_record(record: Any, where: str, stem: str | None = None) -> dict[str, Any]:
    """``record`` if it is a well-formed record (of the benchmark ``stem`` names, when given), else RecordError."""
    if not isinstance(record, dict):
        raise _fail(where, f"holds a JSON {type(record).__name__}, not an object", stem)
    name = stem if stem is not None else record.get("benchmark")

    def fail(problem: str) -> RecordError:
        return _fail(where, problem, name)

    _check_fields(record, fail)
    if record["benchmark"] not in BY_NAME:
        raise fail(f"benchmark {record['benchmark']!r} is none of {', '.join(BY_NAME)}")
    if stem is not None and record["benchmark"] != stem:
        raise fail(f"benchmark {record['benchmark']!r} is recorded in the file of {stem!r}")
    if not DAY.fullmatch(record["date"]):
        raise fail(f"date {record['date']!r} is not YYYY-MM-DD")
    try:
        datetime.date.fromisoformat(record["date"])
    except ValueError:
        raise fail(f"date {record['date']!r} is no day of the calendar") from None
    if record["commit"] is not None and not HEX.fullmatch(record["commit"]):
        raise fail(f"commit {record['commit']!r} is not 7-40 hex digits")
    if record["runs"] < 1:
        raise fail(f"runs is {record['runs']}, expected at least 1")
    if record["source"] not in SOURCES:
        raise fail(f"source {record['source']!r} is none of {', '.join(SOURCES)}")
    _check_value(record["figures"], "figures", fail)
    return record


def load_record(path: Path) -> dict[str, Any]:
    def fail(where: str, problem: str) -> RecordError:
        return _fail(where, problem, path.stem)

    try:
        data = read_bounded(path, MAX_RECORD_BYTES, fail, follow_links=False)
    except OSError as exc:
        raise fail(str(path), f"cannot be read ({exc.strerror or exc})") from None
    return check_record(decode_json(data, str(path), fail, allow_nan=False, unique_keys=True), str(path), path.stem)


def load_records(results: Path) -> dict[str, dict[str, Any]]:
    """Every record in ``results``, by benchmark name; a stray file or a damaged record is a RecordError."""
    try:
        paths = sorted(results.iterdir())
    except OSError as exc:
        raise RecordError(f"{results}: cannot be listed ({exc.strerror or exc})") from None
    records = {}
    for path in paths:
        if path.suffix != ".json" or path.stem not in BY_NAME:
            raise RecordError(f"{path}: is no benchmark's record (a record is NAME.json, NAME one of the benchmarks "
                              "benchmarks/report.py declares); move it elsewhere")
        records[path.stem] = load_record(path)
    return records


# --- rendering -------------------------------------------------------------------------------------

def lookup(figures: Any, path: str) -> Any:
    """The value at ``path`` (``a.b``, ``cells.0.x``, or a key that holds dots itself); None where it is missing."""
    if isinstance(figures, dict) and path in figures:
        return figures[path]
    value = figures
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def show(value: Any) -> str:
    """A figure as the page prints it: floats to 6 significant digits, lists and dicts inline; ``|`` escaped."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        text = f"{value:.6g}"
        return text if any(c in text for c in ".en") else text + ".0"
    if isinstance(value, list):
        return " / ".join(show(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {show(v)}" for k, v in value.items())
    return str(value).replace("|", "\\|")


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _meets(value: Any, target: str) -> bool | None:
    m = TARGET.fullmatch(target)
    if m is None or value is None or isinstance(value, str):
        return None
    if m.group(3) is not None:
        return not isinstance(value, bool) and float(m.group(3)) <= value <= float(m.group(4))
    op, wanted = m.group(1), m.group(2)
    if wanted in ("true", "false"):
        return op == "==" and value is (wanted == "true")
    if isinstance(value, bool):
        return None
    return {"<=": value <= float(wanted), ">=": value >= float(wanted), "==": value == float(wanted)}[op]


def verdict(value: Any, target: str) -> str:
    """``target`` with whether ``value`` meets it: "met", "missed", or per run or row "met in 2 of 3"."""
    judged = [j for j in (_meets(v, target) for v in _leaves(value)) if j is not None]
    if not judged:
        return target
    if len(judged) == 1:
        return f"{target}: {'met' if judged[0] else '**missed**'}"
    met = f"met in {sum(judged)} of {len(judged)}"
    return f"{target}: {met if all(judged) else '**' + met + '**'}"


def _rows(value: Any) -> list[tuple[str | None, Any]]:
    if isinstance(value, dict):
        return [(str(k), v) for k, v in value.items()]
    if isinstance(value, list):
        return [(None, v) for v in value]
    return []


def render_table(figures: dict[str, Any], table: Table) -> tuple[list[str], list[str]]:
    """The table's lines, and one verdict per targeted column."""
    rows = _rows(lookup(figures, table.path))
    if not rows:
        return [f"(`{table.path}`: not in this record)"], []
    head = ([table.key or "key"] if table.key else []) + [h for h, _ in table.columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, row in rows:
        cells = ([show(key)] if table.key else []) + [show(lookup(row, p)) for _, p in table.columns]
        lines.append("| " + " | ".join(cells) + " |")
    return lines, [f"`{p}` {verdict([lookup(r, p) for _, r in rows], t)}" for p, t in table.targets.items()]


def _meta(record: dict[str, Any], machine: str | None) -> str:
    when = record["date"] + (f" {record['time']} UTC" if record["time"] else "")
    contended = {True: "contended", False: "not contended", None: "contention not recorded"}[record["contended"]]
    parts = [when, *(f"commit {record['commit']}",) * (record["commit"] is not None),
             *(record["machine"],) * (record["machine"] != machine),
             (f"load {record['load']}, " if record["load"] else "load not recorded, ") + contended,
             f"{record['runs']} run{'s' * (record['runs'] > 1)}, figures {SOURCES[record['source']]}"]
    return "; ".join(parts) + "." + (f" {record['note']}" if record["note"] else "")


def render_benchmark(bench: Benchmark, record: dict[str, Any] | None, machine: str | None = None) -> list[str]:
    """The section of one benchmark: its command, when and where it ran, its figures against their targets."""
    lines = [f"## {bench.title}"]
    if record is None:
        return lines + [f"Not recorded yet: `python benchmarks/report.py run {bench.name}` runs `{bench.command}`.", ""]
    figures = record["figures"]
    body: list[str] = []
    judged: list[str] = []
    # figures with a target get a row each, for the verdict; the rest share one line, to keep the page short
    targeted = [fig for fig in bench.figures if fig.target]
    others = [fig for fig in bench.figures if not fig.target]
    if targeted:
        body += ["| figure | value | target |", "|---|---|---|"]
        for fig in targeted:
            value = lookup(figures, fig.path)
            body.append(f"| `{fig.path}` | {show(value)} | {verdict(value, fig.target)} |")
        body.append("")
    if others:
        body += ["; ".join(f"`{fig.path}` {show(lookup(figures, fig.path))}" for fig in others) + ".", ""]
    for table in bench.tables:
        rows, verdicts = render_table(figures, table)
        body += rows + [""]
        judged += verdicts
    targets = f" Targets: {'; '.join(judged)}." if judged else ""
    return lines + [f"`{record['command']}`  ", _meta(record, machine) + targets, "", *body]


HEADER = """\
# Benchmarks

The current figure of each benchmark, the command that reproduces it, and the machine, date and load of
the run. Generated by `python benchmarks/report.py` from one record per benchmark in
[benchmarks/results/](benchmarks/results/) (a test fails when page and records differ);
`python benchmarks/report.py run NAME` measures again and replaces the record (see
[docs/benchmarks.md](docs/benchmarks.md)). Earlier runs and their notes are in the history:
`git log -p BENCHMARKS.md benchmarks/results`. Peers are measured in the same run, in alternating rounds;
absolute times on a shared machine swing 2-3x, ratios much less. *Contended*: dlperf's timer saw other work
take the CPUs. No GPU has been measured yet.
"""


def render(records: dict[str, dict[str, Any]]) -> str:
    """BENCHMARKS.md for these records: the header, then each benchmark of :data:`BENCHMARKS` in order."""
    machines = [r["machine"] for r in records.values()]
    common = max(set(machines), key=machines.count) if machines else None
    lines = [HEADER + (f"\nMachine, where a section names no other: {common}.\n" if common else "")]
    for bench in BENCHMARKS:
        lines += render_benchmark(bench, records.get(bench.name), common)
    return "\n".join(lines).rstrip("\n") + "\n"


# --- recording a run -------------------------------------------------------------------------------

def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as null and control characters escaped: what a record may hold."""
    if isinstance(value, dict):
        return {one_line(str(k)): _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return one_line(value) if isinstance(value, str) else value


def _contended(figures: dict[str, Any]) -> bool | None:
    flag = figures.get("contended")
    if flag is None:
        return None
    return bool(flag)  # some benchmarks list the contended cells instead of a flag: any is contended


def machine() -> str:
    from dlperf.bench.runner import machine_info
    from dlperf.machine import host_memory

    info = machine_info()
    total, _ = host_memory()
    memory = f", {total / 2**30:.0f} GiB" if total else ""
    gpus = ", ".join(info["gpus"]) or "no GPU"
    return f"{info['cpu']}, {info['cores']} cores{memory}, {gpus}, Python {info['python']}, torch {info['torch']}"


def _commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    head = done.stdout.strip()
    return head if done.returncode == 0 and HEX.fullmatch(head) else None


def _argv(command: Sequence[str]) -> list[str]:
    """The command with ``python`` as this interpreter and ``dlperf`` as this environment's CLI."""
    first, rest = command[0], list(command[1:])
    if first in ("python", "python3"):
        return [sys.executable, *rest]
    if first == "dlperf":
        return [sys.executable, "-m", "dlperf.cli", *rest]
    return [first, *rest]


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def record_run(name: str, command: Sequence[str] | None, results: Path) -> dict[str, Any]:
    """Run ``name``'s command (its reference command when None), relay its output, and save its record."""
    bench = BY_NAME[name]
    words = list(command) if command else shlex.split(bench.command)
    shown = shlex.join(words)
    loads = [_load()]
    started = datetime.datetime.now(datetime.timezone.utc)
    proc = subprocess.Popen(_argv(words), cwd=ROOT, stdout=subprocess.PIPE, text=True, errors="replace")
    last = ""
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.strip():
                last = line
    except KeyboardInterrupt:
        proc.wait()  # the benchmark got the same Ctrl-C and keeps what it finished
        raise
    status = proc.wait()
    loads.append(_load())
    ended = datetime.datetime.now(datetime.timezone.utc)
    if status != 0:
        raise RecordError(f"`{shown}` exited with status {status}; no record written")

    def fail(where: str, problem: str) -> RecordError:
        return RecordError(f"{where} {problem}; no record written")

    figures = decode_json(last.encode(), f"`{shown}`: its last line is", fail)
    if not isinstance(figures, dict):
        raise RecordError(f"`{shown}`: its last line is not a JSON object; no record written")
    figures = _finite(figures)
    known = [x for x in loads if x is not None]
    record = {
        "benchmark": name, "command": one_line(shown), "date": started.strftime("%Y-%m-%d"),
        "time": f"{started:%H:%M}-{ended:%H:%M}", "machine": one_line(machine()),
        "load": f"{min(known):.2f}-{max(known):.2f}" if known else None, "contended": _contended(figures),
        "commit": _commit(), "runs": 1, "source": "json", "note": None, "figures": figures,
    }
    check_record(record, f"the record of `{shown}`", name)
    atomic_write_text(results / f"{name}.json", json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return record


# --- command line ----------------------------------------------------------------------------------

def _render_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="benchmarks/report.py", description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="the records' directory")
    ap.add_argument("--out", type=Path, default=PAGE, help="the page to write (or --check)")
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is not what the records render")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    command: list[str] | None = None
    if args_in[:1] == ["run"]:
        if "--" in args_in:
            at = args_in.index("--")
            args_in, command = args_in[:at], args_in[at + 1:] or None
        ap = _render_parser()
        ap.add_argument("run", choices=["run"])
        ap.add_argument("name", choices=list(BY_NAME), metavar="NAME", help=", ".join(BY_NAME))
    else:
        ap = _render_parser()
    args = ap.parse_args(args_in)
    try:
        if command is not None or getattr(args, "name", None):
            record_run(args.name, command, args.results)
        text = render(load_records(args.results))
        if args.check:
            current = args.out.read_text(encoding="utf-8") if args.out.is_file() else None
            if current != text:
                print(f"report.py: {args.out} is not what the records render; run python benchmarks/report.py",
                      file=sys.stderr)
                return 1
            return 0
        atomic_write_text(args.out, text)
    except (RecordError, FileAccessError) as exc:
        print(f"report.py: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("report.py: interrupted; no record written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

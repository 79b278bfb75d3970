"""Table 8 of Shi et al. (2016): time per mini-batch on 1, 2, 4 devices, global batch fixed.

The global mini-batch stays the same however many devices share it (4096 for FCN-R, 1024 for
AlexNet-R, 128 for ResNet-56), so perfect scaling halves the time per mini-batch with each doubling of
devices. dlperf's :class:`~dlperf.parallel.Trainer` is timed on 1..k devices with the shared timing
protocol, and the paper's figures (Tesla K80 GK210 GPUs) are printed beside it.

The outputs are the Table-7 sweep's: a rich table, ``--csv``, ``--markdown``, ``--json`` and a
``--plot`` of time against devices. A row timed while other work competed for the CPUs is marked
``!`` (see :mod:`dlperf.timing`). Ctrl-C stops the sweep: the row it interrupts is dropped, the
finished rows go to every output and the exit status is 130.

>>> sorted(PAPER_TABLE8) == sorted(GLOBAL_BATCH)
True
"""

from __future__ import annotations

import csv
import io
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..devices import Device, cpu, cpu_count, gpu, num_gpus
from ..timing import doubling_up_to, time_steps
from .sweep import Outputs

__all__ = ["PAPER_TABLE8", "GLOBAL_BATCH", "PAPER_DEVICE_COUNTS", "ScalingResult", "ScalingConfig", "run_scaling",
           "measure_scaling", "device_counts"]

log = logging.getLogger(__name__)

PAPER_DEVICE_COUNTS = (1, 2, 4)
# Seconds per mini-batch on 1, 2 and 4 GK210 GPUs (Table 8).
PAPER_TABLE8: dict[str, dict[str, tuple[float, float, float]]] = {
    "fcn-r": {"Caffe": (0.239, 0.131, 0.094), "CNTK": (0.181, 0.111, 0.072), "TF": (0.208, 0.144, 0.121),
              "MXNet": (0.184, 0.104, 0.086), "Torch": (0.165, 0.110, 0.112)},
    "alexnet-r": {"Caffe": (0.137, 0.085, 0.047), "CNTK": (0.108, 0.062, 0.037), "TF": (0.385, 0.332, 0.321),
                  "MXNet": (0.122, 0.070, 0.041), "Torch": (0.141, 0.077, 0.046)},
    "resnet-56": {"Caffe": (0.378, 0.254, 0.177), "CNTK": (0.562, 0.351, 0.170), "TF": (0.523, 0.291, 0.197),
                  "MXNet": (0.270, 0.167, 0.101), "Torch": (0.301, 0.182, 0.096)},
}
GLOBAL_BATCH = {"fcn-r": 4096, "alexnet-r": 1024, "resnet-56": 128}
_FRAMEWORKS = ("Caffe", "CNTK", "TF", "MXNet", "Torch")


def default_devices() -> list[Device]:
    """All GPUs when there are at least two, else one logical CPU device per core."""
    n = num_gpus()
    if n >= 2:
        return [gpu(i) for i in range(n)]
    return [cpu(i) for i in range(max(1, cpu_count()))]


def device_counts(k: int) -> list[int]:
    """1, 2, 4, ... up to ``k``, and ``k`` itself.

    >>> device_counts(6)
    [1, 2, 4, 6]
    """
    return doubling_up_to(k)


def _paper(network: str, n: int) -> dict[str, float]:
    if n not in PAPER_DEVICE_COUNTS:
        return {}
    i = PAPER_DEVICE_COUNTS.index(n)
    return {fw: times[i] for fw, times in PAPER_TABLE8[network].items()}


def measure_scaling(network: str, devices: Sequence[Device], *, steps: int, warmup: int,
                    global_batch: int | None = None, seed: int = 0,
                    on_row_start: Callable[[str, int], None] | None = None,
                    on_row: Callable[[dict[str, Any]], None] | None = None,
                    on_step: Callable[[], None] | None = None, floors: Any = None) -> list[dict[str, Any]]:
    """Time one training step of ``network`` on the first 1, 2, 4, ... of ``devices``.

    ``on_row`` gets each row as soon as it is measured, so a caller keeps the finished rows when a
    later one is interrupted. With ``floors`` (a :class:`~dlperf.bench.explain.FloorModel`) each row
    also carries the cost model's floor, the gradient allreduce on k devices included.
    """
    from ..models import get_spec
    from ..parallel import Trainer
    from ..parallel.allreduce.lanes import thread_budget

    spec = get_spec(network)
    batch = global_batch or GLOBAL_BATCH[network]
    torch.manual_seed(seed)
    model = spec.build()
    X, y = spec.input.make_batch(batch, generator=torch.Generator().manual_seed(seed))
    if any(d.is_gpu for d in devices) and torch.cuda.is_available():
        X, y = X.pin_memory(), y.pin_memory()  # lets the per-device copies run asynchronously
    rows, base = [], None
    for n in device_counts(len(devices)):
        devs = list(devices[:n])
        if on_row_start:
            on_row_start(network, n)
        with Trainer(model, devs, "sgd", {"lr": 0.01, "momentum": 0.9}, loss=spec.loss) as trainer:
            def sync(devs=devs) -> None:
                for d in devs:
                    d.synchronize()

            timing = time_steps(lambda: trainer.train_step(X, y), warmup=warmup, steps=steps, synchronize=sync,
                                on_step=on_step, threads=sum(thread_budget(devs)))
        base = base or timing.median_s
        rows.append({"network": network, "devices": n, "device_list": [str(d) for d in devs],
                     "global_batch": batch, "median_s": timing.median_s, "q1_s": timing.q1_s,
                     "q3_s": timing.q3_s, "noisy": timing.noisy, "contended": timing.contended,
                     "contention": timing.contention.reason if timing.contention else None,
                     "samples": len(timing.samples), "speedup": base / timing.median_s,
                     "paper_s": _paper(network, n)})
        if floors is not None:
            rows[-1].update(row_floor(floors, network, batch, devs, timing.median_s))
        if on_row:
            on_row(rows[-1])
    return rows


def row_floor(floors: Any, network: str, batch: int, devs: Sequence[Device], measured_s: float) -> dict[str, Any]:
    """A row's floor fields: each device does 1/k of the step, then the gradients are allreduced
    with the Trainer's algorithm; each logical CPU device is priced at its share of the cores."""
    from ..parallel.allreduce import DEFAULT_ALGORITHM
    from ..parallel.allreduce.lanes import thread_budget
    from .runner import describe_failure

    empty = {"floor_s": None, "floor_components": None, "floor_bottleneck": None, "measured_over_floor": None,
             "pct_of_peak": None}
    if any(d.is_gpu for d in devs):
        return {**empty, "floor_source": "no floor: the probe measures the CPU, not GPUs"}
    try:
        floor = floors.floor(network, batch, thread_budget(devs)[0], devices=len(devs),
                             allreduce=DEFAULT_ALGORITHM if len(devs) > 1 else None)
    except Exception as exc:  # noqa: BLE001 - a row without a floor keeps its measured time
        return {**empty, "floor_source": f"no floor: {describe_failure(exc)}"}
    out = floor.to_dict(measured_s)
    out["floor_source"] += f", {len(devs)} device(s)" + (f", allreduce {DEFAULT_ALGORITHM}" if len(devs) > 1 else "")
    return out


@dataclass
class ScalingResult:
    """The rows of a Table-8 sweep, finished or interrupted."""

    networks: list[str]
    devices: list[Device]
    steps: int
    warmup: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    interrupted: bool = False
    seconds: float = 0.0
    machine: dict = field(default_factory=dict)
    explain: bool = False

    @property
    def planned(self) -> int:
        return len(self.networks) * len(device_counts(len(self.devices)))

    @property
    def contended(self) -> bool:
        return any(r.get("contended") for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "dlperf.scaling/1", "table": 8, "devices": [str(d) for d in self.devices],
                "steps": self.steps, "warmup": self.warmup, "interrupted": self.interrupted,
                "rows_planned": self.planned, "contended": self.contended, "machine": self.machine,
                "seconds": self.seconds, "rows": self.rows, **({"explain": True} if self.explain else {})}


# --- outputs: the same set as the Table-7 sweep's -------------------------------------------------

NOISY_MARK, CONTENDED_MARK = "~", "!"
CSV_FIELDS = ("network", "devices", "global_batch", "median_s", "q1_s", "q3_s", "noisy", "contended",
              "contention", "samples", "speedup", *(f"paper_{fw}_s" for fw in _FRAMEWORKS))


def title(result: ScalingResult) -> str:
    kind = "GPU" if result.devices and result.devices[0].is_gpu else "logical CPU device"
    return (f"Table 8: time per mini-batch (s), global batch fixed and split across {kind}s; "
            "paper: Tesla K80 (GK210) GPUs")


EXPLAIN_HEADER = ("floor (s)", "x floor", "% peak")
EXPLAIN_CSV_FIELDS = ("floor_s", "floor_bottleneck", "floor_components", "measured_over_floor", "pct_of_peak",
                      "floor_source")


def _explain_cells(r: dict[str, Any]) -> list[str]:
    from .explain import fmt_pct, fmt_ratio

    floor = r.get("floor_s")
    text = "-" if floor is None else (f"{floor:.3f}" if floor >= 0.01 else f"{floor * 1e3:.2f}ms")
    if floor is not None:
        text += f" {r['floor_bottleneck']}"
    return [text, fmt_ratio(r.get("measured_over_floor")), fmt_pct(r.get("pct_of_peak"))]


def table_grid(result: ScalingResult) -> tuple[list[str], list[list[str]]]:
    header = ["network", "devices", "batch", "dlperf (s)", "IQR (s)", "speedup", *_FRAMEWORKS]
    if result.explain:
        header[6:6] = EXPLAIN_HEADER
    rows = []
    for r in result.rows:
        marks = (NOISY_MARK if r["noisy"] else "") + (CONTENDED_MARK if r.get("contended") else "")
        paper = [f"{r['paper_s'][fw]:.3f}" if r["paper_s"] else "-" for fw in _FRAMEWORKS]
        explained = _explain_cells(r) if result.explain else []
        rows.append([r["network"], str(r["devices"]), str(r["global_batch"]), f"{r['median_s']:.3f}{marks}",
                     f"{r['q3_s'] - r['q1_s']:.3f}", f"{r['speedup']:.2f}x", *explained, *paper])
    return header, rows


def footnotes(result: ScalingResult) -> list[str]:
    notes = [f"INTERRUPTED: {len(result.rows)} of {result.planned} rows finished; the rest did not run."] \
        if result.interrupted else []
    m = result.machine
    if m:
        notes.append(f"Machine: {m.get('cpu')}, {m.get('cores')} cores; torch {m.get('torch')}; {m.get('date')}.")
    notes.append(f"{NOISY_MARK} marks a noisy row (interquartile range > 10% of median).")
    if result.explain:
        from .explain import explain_footnotes

        notes += explain_footnotes([r.get("floor_source") for r in result.rows])
    marked = [r for r in result.rows if r.get("contended")]
    if marked:
        notes.append(f"{CONTENDED_MARK} marks a row timed while other work competed for its CPUs; its time is "
                     "not the step's cost. Rerun on a quiet machine:")
        notes += [f"  {CONTENDED_MARK} {r['network']}, {r['devices']} devices: {r['contention']}" for r in marked]
    return notes


def render_terminal(result: ScalingResult, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 200)
    console.print(title(result), highlight=False, markup=False, soft_wrap=True)
    header, rows = table_grid(result)
    table = Table(show_lines=False, header_style="bold")
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
    for i, row in enumerate(rows):
        last_of_network = i + 1 == len(rows) or result.rows[i + 1]["network"] != result.rows[i]["network"]
        table.add_row(*row, end_section=last_of_network)
    console.print(table)
    for line in footnotes(result):
        console.print(line, style="bold yellow" if line.lstrip().startswith(CONTENDED_MARK) else "dim",
                      highlight=False, markup=False)


def render_markdown(result: ScalingResult) -> str:
    header, rows = table_grid(result)
    out = [title(result), "", "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    out.append("")
    out += [f"{line}  " for line in footnotes(result)]
    return "\n".join(out) + "\n"


def render_csv(result: ScalingResult) -> str:
    buf = io.StringIO()
    fields = CSV_FIELDS + (EXPLAIN_CSV_FIELDS if result.explain else ())
    w = csv.DictWriter(buf, fieldnames=fields)
    w.writeheader()
    for r in result.rows:
        extra = {k: r.get(k) for k in EXPLAIN_CSV_FIELDS} if result.explain else {}
        components = extra.get("floor_components")
        if components:
            extra["floor_components"] = ";".join(f"{k}={v:.6g}" for k, v in components.items())
        w.writerow({**{k: r.get(k) for k in CSV_FIELDS if not k.startswith("paper_")},
                    **{f"paper_{fw}_s": r["paper_s"].get(fw) for fw in _FRAMEWORKS}, **extra})
    return buf.getvalue()


def render_json(result: ScalingResult) -> str:
    """One line, so that ``| tail -1`` gives a parseable document."""
    return json.dumps(result.to_dict(), separators=(",", ":"))


def render_plot(result: ScalingResult, path: str) -> None:
    """Time per mini-batch against devices, one line per network, with perfect scaling dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import save_scaling_plot

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for net in result.networks:
        pts = [(r["devices"], r["median_s"]) for r in result.rows if r["network"] == net]
        if not pts:
            continue
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=net)
        ax.plot([p[0] for p in pts], [pts[0][1] / p[0] for p in pts], linestyle=":", color=line.get_color())
    counts = sorted({r["devices"] for r in result.rows}) or [1]
    save_scaling_plot(fig, ax, path, xs=counts, xlabel="devices (global batch split across them; dotted: perfect "
                      "scaling)", title=title(result), title_size=8)


@dataclass
class ScalingConfig:
    """What Table 8 measures: networks, the devices that share each global batch, and how long to time."""

    networks: list[str] = field(default_factory=lambda: list(GLOBAL_BATCH))
    """Table 8's networks to time (default: all three)."""
    devices: list[Device] = field(default_factory=default_devices)
    """Devices 1..k of each row (default: every GPU, else two CPU devices)."""
    steps: int | None = None
    """Timed steps per row (default 10, quick 3)."""
    warmup: int | None = None
    """Untimed steps per row (default 2, quick 1)."""
    quick: bool = False
    """Fewer steps by default: the whole table in minutes."""
    batch_size: int | None = None
    """One global batch for every network instead of the paper's."""
    global_batch: dict[str, int] = field(default_factory=dict)
    """A global batch per network, overriding the paper's for those named."""
    explain: bool = False
    """Price every row on the cost model too: its floor and measured / floor."""
    outputs: Outputs = field(default_factory=Outputs)
    """Files (or stdout) the result goes to besides the terminal table."""

    def __post_init__(self) -> None:
        from ..errors import UsageError
        from ..parallel import check_devices

        self.networks = list(self.networks or GLOBAL_BATCH)
        for n in self.networks:
            if n not in GLOBAL_BATCH:
                raise UsageError(f"Table 8 has no network {n!r}; valid choices: {', '.join(GLOBAL_BATCH)}")
        self.devices = check_devices(self.devices or default_devices())
        for name, low in (("steps", 1), ("warmup", 0)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise UsageError(f"{name.replace('-', '_')}={value}: expected >= {low}")
        n_devices = len(self.devices)
        if self.batch_size is not None and self.batch_size < max(1, n_devices):
            raise UsageError(f"batch_size={self.batch_size}: expected at least the {n_devices} devices (each device "
                             "needs one example per step)")
        self.steps = self.steps if self.steps is not None else (3 if self.quick else 10)
        self.warmup = self.warmup if self.warmup is not None else (1 if self.quick else 2)
        self.global_batch = dict(self.global_batch or {})


# --- the command ------------------------------------------------------------------------------------


def _measure_all(result: ScalingResult, batches: dict[str, int]) -> None:
    """Fill ``result.rows``, network by network; Ctrl-C keeps the rows finished so far."""
    from .explain import FloorModel
    from .sweep import SweepProgress

    floors = FloorModel() if result.explain else None

    with SweepProgress("row", result.planned, result.warmup + result.steps) as progress:
        for net in result.networks:
            finished: list[dict[str, Any]] = []

            def row_done(row: dict[str, Any], finished: list = finished) -> None:
                finished.append(row)
                progress.finish(f"{row['network']} on {row['devices']} devices", row["contention"])

            try:
                rows = measure_scaling(net, result.devices, steps=result.steps, warmup=result.warmup,
                                       global_batch=batches.get(net), on_row=row_done, on_step=progress.step,
                                       floors=floors,
                                       on_row_start=lambda n, k: progress.start(f"{n} on {k} devices"))
            except KeyboardInterrupt:
                result.rows += finished
                result.interrupted = True
                return
            result.rows += rows


def run_scaling(config: ScalingConfig) -> int:
    """Run Table 8 (``dlperf bench --scaling``) and write its outputs; 130 when Ctrl-C cut it short.

    See the module docstring for the protocol.
    """
    from .runner import machine_info
    from .sweep import check_batch_memory, check_outputs, emit_outputs

    check_batch_memory(config.networks, config.batch_size)
    check_outputs(config.outputs)  # fail now, not after minutes of timing
    batches = dict(config.global_batch)
    if config.batch_size is not None:  # one global batch for every network (quick checks)
        batches = {net: config.batch_size for net in config.networks}
    assert config.steps is not None and config.warmup is not None  # ScalingConfig.__post_init__ fills both in
    result = ScalingResult(config.networks, list(config.devices), config.steps, config.warmup, explain=config.explain)
    t0 = time.perf_counter()
    _measure_all(result, batches)
    result.seconds, result.machine = time.perf_counter() - t0, machine_info()
    emit_outputs(result, config.outputs, sys.modules[__name__])
    if result.contended:
        log.warning("dlperf bench: %d row(s) were timed on a busy machine and are marked %s; rerun them when the "
                    "machine is quiet.", sum(bool(r["contended"]) for r in result.rows), CONTENDED_MARK)
    if result.interrupted:
        log.warning("dlperf bench: interrupted after %d of %d rows; the outputs hold the finished ones",
                    len(result.rows), result.planned)
        return 130
    return 0

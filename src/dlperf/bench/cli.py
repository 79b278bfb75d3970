"""``dlperf bench``: time one training step per network, device and thread count (Shi et al. Table 7)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .. import _cliargs as va
from ..errors import UsageError
from ..models import model_names
from .modes import mode_names

MAX_BATCH = 2**20
MAX_STEPS = 100_000
MAX_THREADS = 1024


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="time one training step per network, device and thread count",
                       description=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="fewer timed steps (same batch sizes): the whole CPU table in minutes")
    p.add_argument("--networks", type=va.csv_list("--networks", model_names(), what="network"), default=None,
                   help=f"comma-separated, default the paper's seven; choices: {', '.join(model_names())}")
    p.add_argument("--devices", type=va.device_list("--devices"), default=None,
                   help="comma-separated, e.g. cpu,gpu(0),cuda:1 (default: the CPU and every GPU)")
    p.add_argument("--threads", type=va.int_list(1, MAX_THREADS, "--threads"), default=None,
                   help="intra-op thread counts for CPU cells, e.g. 1,2,4 (default: 1, 2, 4, ... cores)")
    p.add_argument("--batch-size", type=va.int_in(1, MAX_BATCH, "--batch-size"), default=None,
                   help="override every network's batch size")
    p.add_argument("--steps", type=va.int_in(1, MAX_STEPS, "--steps"), default=None,
                   help="timed steps per cell (default 10, quick 5)")
    p.add_argument("--warmup", type=va.int_in(0, MAX_STEPS, "--warmup"), default=None,
                   help="untimed steps per cell (default 2, quick 1; at least 1 except with --scaling)")
    p.add_argument("--mode", type=va.choice("mode", mode_names()), default="eager",
                   help=f"how the step runs: {', '.join(mode_names())}")
    p.add_argument("--explain", action="store_true",
                   help="add each cell's floor from the cost model (dlperf.probe.cost), measured/floor and "
                        "%% of peak FLOP/s")
    p.add_argument("--scaling", action="store_true",
                   help="Table 8 instead: time per mini-batch on 1..k devices, global batch split")
    fmt = p.add_argument_group("output")
    fmt.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                     type=va.output_path("--json", allow_stdout=True),
                     help="also print one JSON document as the last stdout line (or write it to FILE)")
    fmt.add_argument("--csv", nargs="?", const="-", default=None, metavar="FILE",
                     type=va.output_path("--csv", allow_stdout=True),
                     help="one row per cell as CSV, to stdout instead of the table, or to FILE")
    fmt.add_argument("--markdown", nargs="?", const="-", default=None, metavar="FILE",
                     type=va.output_path("--markdown", allow_stdout=True),
                     help="the table as Markdown, to stdout instead of the terminal table, or to FILE")
    fmt.add_argument("--plot", default=None, metavar="FILE.png", type=va.output_path("--plot"),
                     help="thread-scaling plot (needs matplotlib)")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace):
    from .runner import BenchConfig

    overrides = {"mode": args.mode, "explain": bool(getattr(args, "explain", False))}
    if args.networks is not None:
        overrides["networks"] = args.networks
    if args.devices is not None:
        overrides["devices"] = args.devices
    if args.threads is not None:
        overrides["threads"] = args.threads
    if args.batch_size is not None:
        overrides["batch_size"] = args.batch_size
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.warmup is not None:
        overrides["warmup"] = args.warmup
    return BenchConfig.quick(**overrides) if args.quick else BenchConfig(**overrides)


def run(args: argparse.Namespace) -> int:
    _check_distinct_outputs(args)
    if args.scaling:
        from .scaling import main_scaling

        return main_scaling(args)
    config = build_config(args)
    check_outputs(args)
    check_batch_memory(config.networks, config.batch_size)
    _warn_oversubscribed(config.threads if args.threads is not None else [])
    result = _run_with_progress(config)
    _emit(result, args)
    if result.interrupted:
        # the finished cells are in every output; 130 tells a script the sweep is incomplete
        print(f"dlperf bench: interrupted after {len(result.cells)} of {result.planned} cells; "
              "the outputs hold the finished ones", file=sys.stderr, flush=True)
        return 130
    return 0


def check_batch_memory(networks: list[str], batch: int | None, flag: str = "--batch-size") -> None:
    """Refuse a batch whose training step would not fit in the memory available now, before building anything."""
    if batch is None:
        return
    from ..models import get_spec

    need = {n: va.batch_bytes(get_spec(n), batch, training=True) for n in networks}
    worst = max(need, key=need.__getitem__)
    va.require_memory(need[worst], f"{flag} {batch} (a training step of {worst})", f"give a smaller {flag}")


def _warn_oversubscribed(threads: list[int]) -> None:
    from ..devices import cpu_count

    over = [t for t in threads if t > cpu_count()]
    if over:
        va.warn("bench", f"--threads {','.join(map(str, over))} is more than the {cpu_count()} cores this "
                         "process may use; those cells time oversubscribed threads")


def _check_distinct_outputs(args: argparse.Namespace) -> None:
    """Two outputs to one file would leave only the last one written."""
    seen: dict[str, str] = {}
    for flag in ("json", "csv", "markdown", "plot"):
        target = getattr(args, flag, None)
        if target and target != "-":
            key = str(Path(target).resolve())
            if key in seen:
                raise UsageError(f"--{seen[key]} and --{flag} both write {target!r}; give each its own file")
            seen[key] = flag


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse unwritable output paths and a missing matplotlib before the sweep, not after it."""
    import errno

    from .._io import check_writable

    for flag in ("json", "csv", "markdown", "plot"):
        target = getattr(args, flag, None)
        if isinstance(target, str) and target != "-":
            try:
                check_writable(target)
            except OSError as exc:
                hint = "; give a path in a writable directory" if exc.errno in (errno.EACCES, errno.EROFS) else ""
                raise UsageError(f"cannot write --{flag} {target}: {exc.strerror or exc}{hint}") from None
    if getattr(args, "plot", None):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib; install it with: pip install 'dlperf[plot]'") from None


def format_duration(seconds: float) -> str:
    """A short human duration: ``45s``, ``3m 05s``, ``2h 03m``.

    >>> format_duration(185), format_duration(7380), format_duration(4.2)
    ('3m 05s', '2h 03m', '4s')
    """
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


class SweepProgress:
    """A sweep's progress on stderr, with the time left estimated from the items finished so far.

    On a terminal it is a live bar; in a log (stderr not a terminal) one line per item as it starts,
    ``dlperf bench: cell 2/4: ...``, which scripts and tests watch to know an item finished. An item
    timed on a busy machine gets a line saying so as soon as it ends.
    """

    def __init__(self, what: str, total: int, steps_per_item: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.what, self.total, self.per_item = what, total, steps_per_item
        self.console = Console(stderr=True)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.completed}/{task.total} steps"), TimeElapsedColumn(),
                                 TextColumn("{task.fields[left]}"), console=self.console, transient=True)
        self.started = self.done = 0
        self._t0 = time.perf_counter()

    def __enter__(self) -> SweepProgress:
        self.progress.__enter__()
        self.task = self.progress.add_task("starting", total=self.total * self.per_item, left="")
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def time_left(self) -> str:
        """``about 3m 05s left`` once an item finished: the mean time per finished item times those left."""
        if not self.done:
            return ""
        per_item = (time.perf_counter() - self._t0) / self.done
        return f"about {format_duration(per_item * (self.total - self.done))} left"

    def start(self, description: str) -> None:
        # Re-align the bar when an item stopped early (time budget) or failed.
        left = self.time_left()
        self.progress.update(self.task, completed=self.started * self.per_item, description=description, left=left)
        self.started += 1
        if not self.console.is_terminal:  # no live bar in a log: one line per item instead
            self.console.print(f"dlperf bench: {self.what} {self.started}/{self.total}: {description}"
                               + (f" ({left})" if left else ""), highlight=False, markup=False, soft_wrap=True)

    def step(self) -> None:
        self.progress.advance(self.task)

    def finish(self, description: str, contention: str | None = None) -> None:
        self.done += 1
        self.progress.update(self.task, left=self.time_left())
        if contention:
            self.console.print(f"dlperf bench: {description} was timed on a busy machine ({contention})",
                               style="yellow", highlight=False, markup=False, soft_wrap=True)


def cell_description(net: str, dev, threads: int | None) -> str:
    return f"{net} on {dev}" + (f", {threads} thr" if threads else "")


def _run_with_progress(config):
    from .runner import run_bench

    with SweepProgress("cell", sum(1 for _ in config.cells()), config.warmup + config.steps) as progress:
        def on_cell_done(cell):
            progress.finish(cell_description(cell.network, cell.device, cell.threads), cell.contention)

        return run_bench(config, on_cell_start=lambda *cell: progress.start(cell_description(*cell)),
                         on_step=progress.step, on_cell_done=on_cell_done)


def emit_outputs(result, args: argparse.Namespace, renderer) -> None:
    """Write ``result`` in every format asked for; ``renderer`` is a module with ``render_<format>`` functions.

    CSV or Markdown to stdout replaces the terminal table; JSON to stdout is the last line.
    """
    from .._io import atomic_write_text

    wrote_stdout_format = False
    for flag, render in (("csv", renderer.render_csv), ("markdown", renderer.render_markdown)):
        target = getattr(args, flag, None)
        if target == "-":
            sys.stdout.write(render(result))
            wrote_stdout_format = True
        elif target:
            atomic_write_text(target, render(result))
    if not wrote_stdout_format:
        renderer.render_terminal(result)
    if getattr(args, "plot", None):
        renderer.render_plot(result, args.plot)
    target = getattr(args, "json", None)
    if target is True or target == "-":
        sys.stdout.flush()
        print(renderer.render_json(result), flush=True)
    elif target:
        atomic_write_text(target, renderer.render_json(result) + "\n")


def _emit(result, args: argparse.Namespace) -> None:
    from . import report

    emit_outputs(result, args, report)
    failed = [c for c in result.cells if c.error]
    if failed:
        print(f"{len(failed)} cell(s) failed; the reason is in the table.", file=sys.stderr)
    if result.contended:
        marked = sum(c.contended for c in result.cells)
        print(f"dlperf bench: {marked} cell(s) were timed on a busy machine and are marked "
              f"{report.CONTENDED_MARK}; rerun them when the machine is quiet.", file=sys.stderr)

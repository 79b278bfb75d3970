"""What every benchmark sweep shares: its output files, a memory check before building, and live progress.

``dlperf bench`` and ``dlperf bench --scaling`` both take these; so does any caller of the library that
wants the same files and progress lines.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .._cliargs import batch_bytes, require_memory
from ..errors import UsageError

__all__ = ["Outputs", "check_outputs", "emit_outputs", "check_batch_memory", "SweepProgress", "format_duration",
           "cell_description"]

OUTPUT_FORMATS = ("json", "csv", "markdown", "plot")


@dataclass
class Outputs:
    """Where a sweep's result goes; ``"-"`` is stdout (not for the plot), None is not written."""

    json: str | None = None
    """One JSON document: the last stdout line for ``"-"``, else this file."""
    csv: str | None = None
    """One row per cell as CSV: to stdout instead of the table for ``"-"``, else this file."""
    markdown: str | None = None
    """The table as Markdown: to stdout instead of the terminal table for ``"-"``, else this file."""
    plot: str | None = None
    """A PNG plot written to this file (needs matplotlib)."""

    def __post_init__(self) -> None:
        # two outputs to one file would leave only the last one written
        seen: dict[str, str] = {}
        for flag in OUTPUT_FORMATS:
            target = getattr(self, flag)
            if target and target != "-":
                key = str(Path(target).resolve())
                if key in seen:
                    raise UsageError(f"--{seen[key]} and --{flag} both write {target!r}; give each its own file")
                seen[key] = flag


def check_outputs(outputs: Outputs) -> None:
    """Refuse unwritable output paths and a missing matplotlib before the sweep, not after it."""
    import errno

    from .._io import check_writable

    for flag in OUTPUT_FORMATS:
        target = getattr(outputs, flag)
        if isinstance(target, str) and target != "-":
            try:
                check_writable(target)
            except OSError as exc:
                hint = "; give a path in a writable directory" if exc.errno in (errno.EACCES, errno.EROFS) else ""
                raise UsageError(f"cannot write --{flag} {target}: {exc.strerror or exc}{hint}") from None
    if outputs.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("plot=... needs matplotlib; install it with: pip install 'dlperf[plot]'") from None


def emit_outputs(result, outputs: Outputs, renderer) -> None:
    """Write ``result`` in every format asked for; ``renderer`` is a module with ``render_<format>`` functions.

    CSV or Markdown to stdout replaces the terminal table; JSON to stdout is the last line.
    """
    from .._io import atomic_write_text

    wrote_stdout_format = False
    for flag, render in (("csv", renderer.render_csv), ("markdown", renderer.render_markdown)):
        target = getattr(outputs, flag)
        if target == "-":
            sys.stdout.write(render(result))
            wrote_stdout_format = True
        elif target:
            atomic_write_text(target, render(result))
    if not wrote_stdout_format:
        renderer.render_terminal(result)
    if outputs.plot:
        renderer.render_plot(result, outputs.plot)
    target = outputs.json
    if target == "-":
        sys.stdout.write(renderer.render_json(result) + "\n")  # asked for on stdout: the output, not a note
        sys.stdout.flush()
    elif target:
        atomic_write_text(target, renderer.render_json(result) + "\n")


def check_batch_memory(networks: list[str], batch: int | None, flag: str = "--batch-size") -> None:
    """Refuse a batch whose training step would not fit in the memory available now, before building anything."""
    if batch is None:
        return
    from ..models import get_spec

    need = {n: batch_bytes(get_spec(n), batch, training=True) for n in networks}
    worst = max(need, key=need.__getitem__)
    require_memory(need[worst], f"{flag} {batch} (a training step of {worst})", f"give a smaller {flag}")


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

"""What a Table-7 sweep produced: one :class:`CellResult` per (network, device, threads), and the whole run.

Kept apart from the runner that fills them and the report that renders them, so that each of those
depends on this module and not on the other. The notebook views (``str``, rich, HTML, rows, pandas)
render through :mod:`dlperf.bench.report`, imported when one is asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..devices import Device
from ..errors import UsageError
from ..timing import Timing
from .explain import CellFloor
from .reference import PaperFigure, paper_figure

if TYPE_CHECKING:
    from .runner import BenchConfig

__all__ = ["BenchResult", "CellResult", "SLOWER_TOLERANCE", "slower_with_more_threads"]


@dataclass
class CellResult:
    network: str
    device: Device
    threads: int | None
    batch_size: int
    mode: str
    timing: Timing | None = None
    flops_per_step: float | None = None
    error: str | None = None
    compile_s: float | None = None
    """Building the step plus its first call, beyond a steady step (compile and hybrid modes)."""
    backend: str | None = None
    """What ran the step: torch.compile's backend, or the hybrid backend(s) chosen."""
    eager_reason: str | None = None
    """With ``--mode hybrid``: why the step ran eagerly, in one line (None when a captured graph ran it)."""
    explained: bool = False
    """The sweep asked for floors (``--explain``): the cell's dict carries the floor fields."""
    floor: CellFloor | None = None
    floor_note: str | None = None
    """Why a cell asked to be explained has no floor (a GPU cell, a model the counter cannot run)."""
    mode_chosen: str | None = None
    """With ``--mode auto``: the variant that ran the timed steps, and by how much it beat eager."""
    gain_over_eager: float | None = None
    auto_reason: str | None = None
    plan: str | None = None
    """With ``--mode auto`` on a CPU cell: the planner's plan (``dlperf train --plan auto``'s) for the cell."""

    @property
    def contended(self) -> bool:
        return self.timing is not None and self.timing.contended

    @property
    def contention(self) -> str | None:
        """Why the cell's timing is not to be trusted, when it is contended."""
        return self.timing.contention.reason if self.timing and self.timing.contention else None

    @property
    def paper(self) -> PaperFigure | None:
        return paper_figure(self.network, self.device.kind, self.threads)

    @property
    def achieved_flops(self) -> float | None:
        if self.timing is None or not self.flops_per_step:
            return None
        return self.flops_per_step / self.timing.median_s

    @property
    def speedup_vs_paper_torch(self) -> float | None:
        p = self.paper
        if self.timing is None or p is None or p.torch_s is None:
            return None
        return p.torch_s / self.timing.median_s

    def to_dict(self) -> dict:
        p = self.paper
        t = self.timing
        return {
            "network": self.network,
            "device": str(self.device),
            "threads": self.threads,
            "batch_size": self.batch_size,
            "mode": self.mode,
            "median_s": t.median_s if t else None,
            "spread": {"q1_s": t.q1_s, "q3_s": t.q3_s, "iqr_s": t.iqr_s, "min_s": t.min_s, "max_s": t.max_s,
                       "rel": t.rel_spread} if t else None,
            "noisy": t.noisy if t else None,
            "contended": self.contended,
            "contention": self.contention,
            "contention_signals": t.contention.to_dict() if t and t.contention else None,
            "compile_s": self.compile_s,
            "backend": self.backend,
            "samples": list(t.samples) if t else [],
            "flops_per_step": self.flops_per_step,
            "achieved_gflops": self.achieved_flops / 1e9 if self.achieved_flops else None,
            "paper": {"column": p.column, "torch_s": p.torch_s, "best_s": p.best_s,
                      "best_framework": p.best_framework} if p else None,
            "speedup_vs_paper_torch": self.speedup_vs_paper_torch,
            "error": self.error,
            **self._extra_fields(),
        }

    @property
    def measured_over_floor(self) -> float | None:
        return self.floor.measured_over_floor(self.timing.median_s if self.timing else None) if self.floor else None

    @property
    def pct_of_peak(self) -> float | None:
        return self.floor.pct_of_peak(self.timing.median_s if self.timing else None) if self.floor else None

    def _extra_fields(self) -> dict:
        """Fields only an explained or auto sweep has, so that other sweeps' documents stay as they were."""
        extra: dict = {}
        if self.explained:
            extra.update(self.floor.to_dict(self.timing.median_s if self.timing else None) if self.floor else
                         {"floor_s": None, "floor_components": None, "floor_bottleneck": None,
                          "measured_over_floor": None, "pct_of_peak": None, "floor_source": self.floor_note})
        if self.mode == "hybrid":
            extra.update(eager_reason=self.eager_reason)
        if self.mode == "auto":
            extra.update(mode_chosen=self.mode_chosen, gain_over_eager=self.gain_over_eager,
                         auto_reason=self.auto_reason, plan=self.plan)
        return extra


@dataclass
class BenchResult:
    config: BenchConfig
    cells: list[CellResult]
    machine: dict
    seconds: float
    interrupted: bool = False
    """The sweep was stopped (Ctrl-C) before every cell ran; ``cells`` holds the finished ones."""

    @property
    def planned(self) -> int:
        """How many cells the configuration asks for."""
        return sum(1 for _ in self.config.cells())

    @property
    def contended(self) -> bool:
        return any(c.contended for c in self.cells)

    def thread_warnings(self) -> list[str]:
        """One line per network and device whose time grew with more threads."""
        return slower_with_more_threads(self.cells)

    def to_dict(self) -> dict:
        c = self.config
        return {
            "schema": "dlperf.bench/1",
            "interrupted": self.interrupted,
            "cells_planned": self.planned,
            "machine": self.machine,
            "config": {"networks": c.networks, "devices": [str(d) for d in c.devices], "threads": c.threads,
                       "batch_size": c.batch_size, "warmup": c.warmup, "steps": c.steps, "mode": c.mode,
                       "max_cell_seconds": c.max_cell_seconds, **({"explain": True} if c.explain else {})},
            "seconds": self.seconds,
            "contended": self.contended,
            "thread_warnings": self.thread_warnings(),
            "cells": [cell.to_dict() for cell in self.cells],
        }

    # --- for notebooks: the CLI's table as text, rich, HTML, rows and a DataFrame ---------------------

    def __str__(self) -> str:
        import io

        from rich.console import Console

        from . import report

        buf = io.StringIO()
        report.render_terminal(self, Console(file=buf, width=200, color_system=None, force_terminal=False))
        return buf.getvalue()

    def __rich__(self):
        from . import report

        return report.rich_renderable(self)

    def _repr_html_(self) -> str:
        from . import report

        return report.render_html(self)

    def to_rows(self) -> list[dict]:
        """One flat dict per cell, the CSV's columns (``floor_components`` stays a dict)."""
        from . import report

        return [report.flat_row(self, cell) for cell in self.cells]

    def to_pandas(self):
        """The rows as a pandas DataFrame; pandas is optional."""
        try:
            pd = importlib.import_module("pandas")  # optional, and without type stubs
        except ImportError:
            raise UsageError("to_pandas() needs pandas; install it with: pip install pandas "
                             "(or use to_rows(), a list of dicts)") from None
        from .report import csv_fields

        return pd.DataFrame(self.to_rows(), columns=list(csv_fields(self)))


SLOWER_TOLERANCE = 0.10
"""More threads must be this much slower than fewer before a sweep is called out (timer noise)."""


def slower_with_more_threads(cells: list[CellResult]) -> list[str]:
    """Lines naming each network and device where a thread count was slower than a smaller one."""
    lines = []
    groups: dict[tuple[str, Device], list[tuple[int, float, CellResult]]] = {}
    for c in cells:
        if c.threads is not None and c.timing is not None:
            groups.setdefault((c.network, c.device), []).append((c.threads, c.timing.median_s, c))
    for (net, dev), group in groups.items():
        group.sort(key=lambda g: g[0])
        for i, (threads, median_s, more) in enumerate(group):
            fewer = min(group[:i], key=lambda g: g[1], default=None)
            if fewer is None or median_s <= fewer[1] * (1 + SLOWER_TOLERANCE):
                continue
            fewer_threads, fewer_s, fewer_cell = fewer
            why = ("marked contended: other work took the cores" if more.contended or fewer_cell.contended
                   else "not contended: the ops may be too small to share, or the cores are shared")
            lines.append(f"{net} on {dev}: {threads} threads took {median_s / fewer_s:.1f}x as long as "
                         f"{fewer_threads} ({why})")
    return lines

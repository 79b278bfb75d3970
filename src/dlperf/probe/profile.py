"""Where a training step of any model spends its time, what it could take at least, and what would help.

:func:`profile` times SGD steps of a model (cross-entropy on random labels of the output's width
for a 2-D output, MSE otherwise), profiles up to three more with ``torch.profiler`` (keeping the least
disturbed), and sorts every operator's own time into groups (convolution, matmul, norm, elementwise,
pooling, loss, optimizer, layout copies, and the Python/dispatch time between operators). Each group
gets its FLOPs and bytes (counted on the meta device), a floor from the
:class:`~dlperf.probe.cost.Hardware` figures and a verdict: compute-, bandwidth- or overhead-bound.
Then it tries what dlperf can change and measures each: channels-last memory for convolutions, another
thread count, a larger batch when overhead dominates, and a hybridized graph. Every suggestion is timed
in the same alternating rounds as one shared baseline, so all of them face the same background load, and
a report timed on a busy machine says so (``!`` and the reason, as ``dlperf bench`` does).

The input is a batch as PyTorch users write it (:mod:`dlperf.batch`): a tensor, a tuple of positional
arguments (token ids and lengths), or a dict, of any dtypes; the output may be a tuple or dict too (each
floating tensor takes its own loss).

>>> import torch
>>> from torch import nn
>>> report = profile(nn.Sequential(nn.Linear(8, 4)), torch.randn(16, 8), steps=2, suggest=False)
>>> sorted(report.groups_by_name()) == sorted(GROUPS)
True
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from .._threads import intra_op_threads
from ..batch import Batch, batch_size, describe, map_tensors, tensors_of
from ..errors import UsageError
from ..timing import Contention, ContentionMonitor, Progress, Timing, best_of, time_steps
from .cost import (
    GROUPS,
    Hardware,
    Link,
    StepCounts,
    StepFloor,
    TrainingStep,
    classify_op,
    count_step,
    step_floor,
)

__all__ = ["profile", "ProfileReport", "GroupRow", "Suggestion", "PlanAdvice", "PlanAdvisor", "estimate_hardware",
           "VERDICTS", "GROUPS"]

VERDICTS = ("compute-bound", "bandwidth-bound", "overhead-bound")
# A step that spends more than this share of its time in overhead-bound groups is worth a larger batch.
OVERHEAD_SHARE = 0.3
# A suggestion must beat the baseline by this much to be recommended: timings on a busy machine wobble.
WORTHWHILE = 1.05
CONTENDED_MARK = "!"
"""What marks a timing taken while other work competed for the CPUs (``dlperf bench``'s mark)."""


@dataclass(frozen=True)
class GroupRow:
    group: str
    time_s: float
    share: float
    flops: float
    bytes: float
    ops: int
    floor_s: float
    verdict: str


@dataclass(frozen=True)
class Suggestion:
    """One change, timed: ``baseline_s`` and ``measured_s`` are seconds per ``unit`` without and with it,
    measured alternately."""

    name: str
    how: str
    baseline_s: float | None = None
    measured_s: float | None = None
    unit: str = "step"
    note: str = ""
    rejected: bool = False
    """Measured faster, yet the planner did not choose it (not faster in every round beyond the noise)."""

    @property
    def speedup(self) -> float | None:
        if self.baseline_s is None or not self.measured_s:
            return None
        return self.baseline_s / self.measured_s

    @property
    def recommended(self) -> bool:
        return self.speedup is not None and self.speedup >= WORTHWHILE and not self.rejected

    def to_dict(self) -> dict:
        return {"name": self.name, "how": self.how, "baseline_s": self.baseline_s, "measured_s": self.measured_s,
                "unit": self.unit, "speedup": self.speedup, "recommended": self.recommended, "note": self.note}

    def line(self) -> str:
        if self.baseline_s is None and self.measured_s is not None:  # a cached decision: its time, no baseline
            return f"{self.name:<14} {self.measured_s * 1e3:.3g} ms/{self.unit}: {self.how}; {self.note}"
        if self.speedup is None or self.baseline_s is None or self.measured_s is None:
            return f"{self.name:<14} not measured: {self.note}"
        verdict = "recommended" if self.recommended else "not chosen" if self.rejected else "no gain here"
        note = f"; {self.note}" if self.note else ""
        return (f"{self.name:<14} {self.baseline_s * 1e3:.3g} -> {self.measured_s * 1e3:.3g} ms/{self.unit}, "
                f"{self.speedup:.2f}x ({verdict}): {self.how}{note}")


@dataclass
class PlanAdvice:
    """The planner's answer for the profiled model, as suggestions (the chosen plan first).

    The planner lives above this package, so its caller (``dlperf profile``, :mod:`dlperf.bench.plans`)
    asks it and hands the answer in through :func:`profile`'s ``plans``."""

    plan: str | None
    """The chosen plan's short name (``1x2,channels-last,eager``), or None when the model could not be planned."""
    suggestions: list[Suggestion]
    cached: bool = False
    planning_s: float = 0.0


PlanAdvisor = Callable[[nn.Module, Batch, Any], PlanAdvice]
"""``plans(model, batch) -> PlanAdvice``: asked with torch's threads set as the profile runs them."""


@dataclass
class ProfileReport:
    model: str
    input_shape: tuple[int, ...]
    """The input's shape for one tensor; for a tuple or dict, ``(batch,)`` (``inputs`` names it all)."""
    threads: int
    step: Timing
    profiled_step_s: float
    groups: list[GroupRow]
    floor: StepFloor
    hardware: Hardware
    counts: StepCounts
    suggestions: list[Suggestion] = field(default_factory=list)
    inputs: str = ""
    """The batch's structure, dtypes and shapes (:func:`dlperf.batch.describe`)."""
    batch: int = 0
    suggestions_contention: Contention | None = None
    """The verdict on the window the suggestions were timed in."""
    plan: str | None = None
    """The planner's plan for this model and batch (when ``profile`` was given ``plans``)."""
    loss: str = ""
    """The loss the step minimises (:class:`dlperf.losses.TimedLoss`'s name)."""

    @property
    def contended(self) -> bool:
        """Whether the step or the suggestions were timed while other work competed for the CPUs."""
        return self.step.contended or bool(self.suggestions_contention and self.suggestions_contention.contended)

    def groups_by_name(self) -> dict[str, GroupRow]:
        return {g.group: g for g in self.groups}

    @property
    def examples_per_s(self) -> float:
        n = self.batch or (self.input_shape[0] if self.input_shape else 0)
        return n / self.step.median_s if self.step.median_s > 0 else 0.0

    def to_dict(self) -> dict:
        window = self.suggestions_contention
        return {"model": self.model, "input_shape": list(self.input_shape), "inputs": self.inputs,
                "batch_size": self.batch, "threads": self.threads, "contended": self.contended,
                "suggestions_contention": window.to_dict() if window else None,
                "step": self.step.to_dict(), "examples_per_s": self.examples_per_s,
                "profiled_step_s": self.profiled_step_s,
                "groups": [asdict(g) for g in self.groups], "floor": self.floor.to_dict(),
                "hardware": self.hardware.to_dict() | {"notes": self.hardware.notes},
                "suggestions": [s.to_dict() for s in self.suggestions], "plan": self.plan}

    def _contention_lines(self) -> list[str]:
        marked = [(what, c) for what, c in (("step", self.step.contention),
                                            ("suggestions", self.suggestions_contention)) if c and c.contended]
        if not marked:
            return []
        lines = [f"{CONTENDED_MARK} marks a time taken while other work competed for the CPUs; it is not the "
                 "step's cost. Rerun on a quiet machine:"]
        return lines + [f"  {CONTENDED_MARK} {what}: {c.reason}" for what, c in marked]

    def __str__(self) -> str:
        shape = self.inputs or "x".join(map(str, self.input_shape))
        mark = f" {CONTENDED_MARK}" if self.step.contended else ""
        noisy = " (noisy)" if self.step.noisy else ""
        lines = [f"{self.model}, input {shape}, {self.threads} thread(s), {len(self.step.samples)} timed steps"
                 + (f", loss {self.loss}" if self.loss else ""),
                 f"step {self.step.median_s * 1e3:.3f} ms median{mark}{noisy}, {self.examples_per_s:,.0f} "
                 f"examples/s; the profiled step took {self.profiled_step_s * 1e3:.3f} ms",
                 "",
                 f"{'group':<12}{'ms':>9}{'share':>7}{'MFLOP':>10}{'MB':>9}{'ops':>6}{'floor ms':>10}  verdict"]
        for g in self.groups:
            if not g.time_s and not g.ops:
                continue  # a group this model does not use
            lines.append(f"{g.group:<12}{g.time_s * 1e3:>9.3f}{g.share:>7.1%}{g.flops / 1e6:>10.1f}"
                         f"{g.bytes / 1e6:>9.2f}{g.ops:>6}{g.floor_s * 1e3:>10.3f}  {g.verdict}")
        total = sum(g.time_s for g in self.groups)
        lines.append(f"{'total':<12}{total * 1e3:>9.3f}{1:>7.0%}{self.counts.total_flops / 1e6:>10.1f}"
                     f"{self.counts.total_bytes / 1e6:>9.2f}{self.counts.total_ops:>6}")
        lines += ["", f"floor on {self.hardware.name}: {self.floor.no_overlap_s * 1e3:.3f} ms with no overlap, "
                      f"{self.floor.overlap_s * 1e3:.3f} ms with full overlap ({self.floor.bottleneck}); measured "
                      f"{self.step.median_s / max(self.floor.no_overlap_s, 1e-12):.1f}x the no-overlap floor"]
        if self.floor.overlap_s > self.step.median_s:  # the least time above the measured time: the model is off
            worst = max(self.floor.components, key=self.floor.components.__getitem__)
            lines.append(f"! cost-model error: the floor is above the measured step; its {worst} component "
                         f"({self.floor.components[worst] * 1e3:.3f} ms) overshot (figures: {self.hardware.name})")
        if self.suggestions:
            busy = self.suggestions_contention is not None and self.suggestions_contention.contended
            head = "suggestions (each timed against one baseline, in alternating rounds)"
            lines += ["", head + (f" {CONTENDED_MARK}:" if busy else ":")]
            lines += [f"  {s.line()}" for s in self.suggestions]
            if self.plan:
                lines.append(f"plan: {self.plan} (the planner's, as dlperf train --plan auto and dlperf bench "
                             "--mode auto choose)")
        notes = self._contention_lines()
        return "\n".join(lines + ([""] + notes if notes else []))


# --- this machine's figures, when none are given -------------------------------------------------------------

def estimate_hardware(repeats: int = 5) -> Hardware:
    """Rough figures for this machine at the current thread count, in well under a second.

    A stand-in for a full probe: the best of a few float32 matmuls, a 32 MiB copy, and a loop of tiny
    additions (the per-operator cost). Pass measured figures to :func:`profile` for a better floor.
    """
    a, b = torch.randn(768, 768), torch.randn(768, 768)
    src, dst = torch.empty(1 << 23), torch.empty(1 << 23)
    tiny = torch.zeros(1)

    def best(fn: Callable[[], object]) -> float:
        return max(best_of(fn, reps=repeats), 1e-9)

    flops = 2 * 768**3 / best(lambda: torch.mm(a, b))
    copy_bw = 2 * src.numel() * 4 / best(lambda: dst.copy_(src))  # read + write
    ops = 200
    dispatch = best(lambda: [torch.add(tiny, tiny) for _ in range(ops)]) / ops
    copy_link = Link(1e-7, copy_bw / 2)
    return Hardware(f"this machine ({torch.get_num_threads()} threads, estimated)", {"float32": flops}, copy_bw,
                    dispatch, {k: copy_link for k in ("copy", "host", "device", "network")},
                    notes="estimated in-process: matmul 768^2, 32 MiB copy, 200 tiny adds")


def _this_machine() -> Hardware:
    """The cached ``dlperf probe`` figures at the current thread count when there are some, else an estimate."""
    from .cache import load_probe

    result = load_probe(quiet=True)
    if result is not None:
        try:
            return Hardware.from_probe_result(result, threads=torch.get_num_threads())
        except UsageError:  # the cached run lacks a figure (an interrupted probe): estimate instead
            pass
    return estimate_hardware()


def _at_least_observed(hw: Hardware, counts: StepCounts, seconds: dict[str, float], step_s: float) -> Hardware:
    """``hw`` with its peak FLOP/s and bandwidth raised to any rate the step or a group of it reached.

    A quick estimate taken while another process holds the cores reads low, and a floor above the
    measured time would be nonsense: what the step itself achieved is a lower bound on the peak.
    """
    spans = {**seconds, "": step_s}
    flops = {**counts.flops, "": counts.total_flops}
    nbytes = {**counts.bytes, "": counts.total_bytes}
    flops_rate = max((flops.get(g, 0.0) / t for g, t in spans.items() if t > 0), default=0.0)
    bytes_rate = max((nbytes.get(g, 0.0) / t for g, t in spans.items() if t > 0), default=0.0)
    peak = hw.flops.get(counts.dtype, hw.flops.get("float32", 0.0))
    if flops_rate <= peak and bytes_rate <= hw.memory_bandwidth:
        return hw
    return replace(hw, flops={**hw.flops, counts.dtype: max(peak, flops_rate)},
                   memory_bandwidth=max(hw.memory_bandwidth, bytes_rate),
                   notes=hw.notes + "; raised to the rates the measured step reached")


# --- grouping the profiler's events --------------------------------------------------------------------------

_BACKWARD = re.compile(r"Backward\d*$")
_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


def _backward_group(node: str) -> str:
    """The group of an autograd node such as ``ConvolutionBackward0`` or ``torch::autograd::AccumulateGrad``."""
    base = node.rsplit("::", 1)[-1]
    base = _CAMEL.sub("_", _BACKWARD.sub("", base)).lower()
    return classify_op(base)


def _event_group(event) -> str:
    chain = []
    node = event
    while node is not None:
        chain.append(node.name)
        node = node.cpu_parent
    if any(name.startswith("Optimizer.") for name in chain):
        return "optimizer"
    for name in reversed(chain):  # the outermost operator decides: a copy inside addmm is matmul time
        if name.startswith("autograd::engine::evaluate_function: "):
            return _backward_group(name.split(": ", 1)[1])
        if name.startswith("aten::"):
            return classify_op(name)
    return "python"  # a user's record_function: Python time between operators


@contextlib.contextmanager
def _native_stderr_silenced():
    """File descriptor 2 pointed at /dev/null: the profiler's C++ side logs ``USDT ... profiler_start`` and
    ``profiler_stop`` there on every start and stop, which Python's own redirection cannot catch.

    Only the profiler's start and stop run inside; the user's step never does, so its warnings stay.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no fd 2 (a closed or replaced stderr): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _profiled_step(step: Callable[[], object], trace: str | os.PathLike | None,
                   tries: int = 1) -> tuple[dict[str, float], float]:
    """Own time per group of a step under torch.profiler, and the step's wall time; optionally the trace.

    Of ``tries`` profiled steps the fastest is kept: on a shared machine it is the one another
    process disturbed least, and its groups then add up to a step like the timed ones.
    """
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    best: tuple[dict[str, float], float, object] | None = None
    for _ in range(max(tries, 1)):
        prof = torch_profile(activities=[ProfilerActivity.CPU])
        with _native_stderr_silenced():
            prof.start()
        try:
            t0 = time.perf_counter()
            step()
            wall = time.perf_counter() - t0
        finally:
            with _native_stderr_silenced():
                prof.stop()
        seconds = dict.fromkeys(GROUPS, 0.0)
        for event in prof.events():
            seconds[_event_group(event)] += event.self_cpu_time_total * 1e-6
        covered = sum(seconds.values())
        seconds["python"] += max(wall - covered, 0.0)
        if best is None or max(wall, covered) < best[1]:
            best = (seconds, max(wall, covered), prof)
    assert best is not None  # at least one try ran
    if trace is not None:
        _write_trace(best[2], trace)
    return best[0], best[1]


def _write_trace(prof, path: str | os.PathLike) -> None:
    from .._io import atomic_write_bytes

    # export_chrome_trace writes in place; a temporary file and the atomic writer keep a reader (or an
    # interruption) from ever seeing half a trace at the user's path
    with tempfile.TemporaryDirectory(prefix="dlperf-trace-") as tmp:
        scratch = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(scratch)
        with open(scratch, "rb") as f:
            atomic_write_bytes(path, f.read())


def _verdict(floors: dict[str, float]) -> tuple[float, str]:
    bound = max(floors, key=floors.__getitem__)
    if floors[bound] <= 0:
        return 0.0, "overhead-bound"
    return floors[bound], bound


def _group_rows(seconds: dict[str, float], counts: StepCounts, hw: Hardware) -> list[GroupRow]:
    total = sum(seconds.values()) or 1.0
    peak = hw.peak_flops(counts.dtype) if counts.dtype in hw.flops else hw.peak_flops("float32")
    rows = []
    for group in GROUPS:
        flops = counts.flops.get(group, 0.0)
        nbytes = counts.bytes.get(group, 0.0)
        ops = counts.ops.get(group, 0)
        floor, verdict = _verdict({"compute-bound": flops / peak, "bandwidth-bound": nbytes / hw.memory_bandwidth,
                                   "overhead-bound": ops * hw.dispatch_s})
        if group == "python":
            floor, verdict = 0.0, "overhead-bound"
        rows.append(GroupRow(group, seconds[group], seconds[group] / total, flops, nbytes, ops, floor, verdict))
    return rows


# --- timing and suggestions ---------------------------------------------------------------------------------

def _trainer(model: nn.Module, x: Batch, loss: Any = None) -> Callable[[], object]:
    step = TrainingStep(model, x, loss=loss)
    devices = {t.device for t in tensors_of(x)}
    cuda = next((d for d in devices if d.type == "cuda"), None)
    if cuda is None:
        return step

    def synced() -> object:  # GPU work is asynchronous: without the wait a timer sees only the launches
        out = step()
        torch.cuda.synchronize(cuda)
        return out

    synced.training_step = step  # type: ignore[attr-defined]
    return synced


@dataclass
class _Variant:
    """One change to try: its step, and how many examples a step of it does per baseline example."""

    name: str
    how: str
    step: Callable[[], object] | None = None
    scale: int = 1
    unit: str = "step"
    note: str = ""
    samples: list[float] = field(default_factory=list)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _rounds(baseline: Callable[[], object], variants: list[_Variant], steps: int,
            warmup: int = 2) -> tuple[list[float], Contention]:
    """Time the baseline and every variant once per round, for ``steps`` rounds; the baseline's samples.

    One baseline for all: each suggestion is compared with the same steps, taken between its own, so
    every ratio sees the same background load. A variant that fails drops out with its reason.
    """
    live = [v for v in variants if v.step is not None]
    progress = Progress("profile")
    for v in live:  # the first calls capture graphs, allocate, pick kernels
        progress.say(f"warming up {v.name}")
        try:
            for _ in range(warmup):
                v.step()  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 (a suggestion that cannot run is reported, not fatal)
            v.step, v.note = None, f"failed: {type(exc).__name__}: {exc}"
    baseline()
    monitor = ContentionMonitor(torch.get_num_threads())
    base: list[float] = []
    monitor.start()
    for r in range(max(steps, 3)):
        progress.say(f"timing the suggestions (round {r + 1} of {max(steps, 3)})")
        base.append(_timed(baseline))
        order = [v for v in variants if v.step is not None]
        # rotated each round: no variant always runs right after the baseline (warm caches) or last
        k = r % len(order) if order else 0
        for v in order[k:] + order[:k]:
            try:
                v.samples.append(_timed(v.step))  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001
                v.step, v.note = None, f"failed: {type(exc).__name__}: {exc}"
        monitor.sample()
    return base, monitor.stop()


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _with_threads(n: int, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with intra_op_threads(n):
            return fn()

    return run


def _thread_counts(current: int, cores: int) -> list[int]:
    """Thread counts worth trying beside ``current``: 1, half, all usable cores (never more)."""
    return sorted({n for n in (1, max(current // 2, 1), cores) if n != current and 1 <= n <= max(cores, 1)})


def _channels_last(model: nn.Module, x: Batch, loss: Any = None) -> _Variant | None:
    four_d = [t for t in tensors_of(x) if t.dim() == 4 and t.is_floating_point()]
    if not four_d or not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return None
    how = "model.to(memory_format=torch.channels_last) and the same for each input batch"
    try:
        cl_model = copy.deepcopy(model).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        cl_x = map_tensors(lambda t: t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t, x)
        return _Variant("channels-last", how, _trainer(cl_model, cl_x, loss))
    except Exception as exc:  # noqa: BLE001
        return _Variant("channels-last", how, note=f"failed: {type(exc).__name__}: {exc}")


def _larger_batch(model: nn.Module, x: Batch, loss: Any = None) -> _Variant:
    b = batch_size(x)
    how = f"batch {2 * b} instead of {b}: the fixed per-operator cost is shared by twice the examples"
    try:
        doubled = map_tensors(lambda t: torch.cat([t, t]) if t.dim() > 0 else t, x)
        return _Variant("larger batch", how, _trainer(copy.deepcopy(model), doubled, loss), scale=2, unit="example")
    except (RuntimeError, MemoryError) as exc:
        return _Variant("larger batch", how, note=f"failed: {type(exc).__name__}: {exc}", unit="example")


def _hybridized(model: nn.Module, x: Batch, loss: Any = None) -> _Variant:
    import warnings

    from ..hybrid import hybridize

    how = 'dlperf.hybrid.hybridize(model, backend="graph")'
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hybrid = hybridize(copy.deepcopy(model), backend="graph", strict=True)
            step = _trainer(hybrid, x, loss)
            step()  # the first call captures; a model capture refuses is a finding, not a failure
    except Exception as exc:  # noqa: BLE001
        return _Variant("hybridize", how, note=f"not applicable: {type(exc).__name__}: {exc}")
    return _Variant("hybridize", how, step)


def _suggestions(model: nn.Module, x: Batch, report: ProfileReport, steps: int,
                 plans: PlanAdvisor | None = None, loss: Any = None) -> tuple[list[Suggestion], Contention | None]:
    baseline = _trainer(model, x, loss)
    current, cores = torch.get_num_threads(), _usable_cores()
    planned: list[Suggestion] = []
    if plans is not None:  # layout and threads are the planner's: its candidates against its reference
        advice = plans(model, x, loss)
        report.plan, planned = advice.plan, list(advice.suggestions)
    variants = [] if plans is not None else [v for v in (_channels_last(model, x, loss),) if v is not None]
    for n in _thread_counts(current, cores) if plans is None else ():
        way = "more" if n > current else "fewer"
        variants.append(_Variant(f"threads {n}", f"--threads {n} (torch.set_num_threads({n})): {way} threads than "
                                                 f"the {current} now; this machine has {cores} usable cores",
                                 _with_threads(n, _trainer(copy.deepcopy(model), x, loss))))
    overhead = sum(g.time_s for g in report.groups if g.verdict == "overhead-bound")
    if overhead > OVERHEAD_SHARE * sum(g.time_s for g in report.groups):
        variants.append(_larger_batch(model, x, loss))
    variants.append(_hybridized(model, x, loss))
    base, contention = _rounds(baseline, variants, steps)
    base_s = Timing.from_samples(base).median_s
    out = []
    for v in variants:
        if v.step is None or not v.samples:
            out.append(Suggestion(v.name, v.how, unit=v.unit, note=v.note or "not measured"))
            continue
        measured = Timing.from_samples(v.samples).median_s
        examples = batch_size(x) if v.unit == "example" else 1
        out.append(Suggestion(v.name, v.how, base_s / examples, measured / (examples * v.scale), unit=v.unit))
    return planned + out, contention


# --- the entry point ----------------------------------------------------------------------------------------

def profile(model: nn.Module, example_input: Batch, *, steps: int = 5, warmup: int = 1,
            threads: int | None = None, hardware: Hardware | None = None, suggest: bool = True,
            trace: str | os.PathLike | None = None, name: str | None = None,
            plans: PlanAdvisor | None = None, loss: Any = None) -> ProfileReport:
    """Profile training steps of ``model`` on batches like ``example_input``; ``model`` itself is not changed.

    ``example_input`` is a tensor, a tuple (the model's positional arguments) or a dict, of any dtypes
    (:mod:`dlperf.batch`). ``threads`` sets torch's intra-op threads for the run (restored after);
    ``hardware`` gives the figures for the floors (default: :func:`estimate_hardware`); ``trace`` writes the
    profiled step's Chrome trace there; ``plans`` (:func:`dlperf.bench.plans.plan_advice`) replaces the
    layout and thread-count suggestions with the planner's candidates, its chosen plan first; ``loss`` is the
    step's (:class:`dlperf.losses.TimedLoss`: the model's own, else cross-entropy on class scores). Raises
    :class:`~dlperf.errors.UsageError` when the model cannot train on the input.
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"profile needs a torch.nn.Module, got {type(model).__name__}; build the model first")
    if not tensors_of(example_input):
        raise UsageError(f"profile needs an input batch of tensors, got {describe(example_input)}; give a tensor, "
                         "a tuple of tensors (the model's arguments) or a dict of tensors")
    batch_size(example_input, "input")  # one clear error for a batch without (or with mixed) batch sizes
    if not any(p.requires_grad for p in model.parameters()):
        raise UsageError(f"{name or type(model).__name__} has no trainable parameters, so it has no training step "
                         "to profile; give a model with parameters that require gradients")
    if steps < 1 or warmup < 0:
        raise UsageError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    with intra_op_threads(threads):
        return _profile(copy.deepcopy(model).train(), example_input, steps, warmup, hardware, suggest, trace,
                        name or type(model).__name__, plans, loss)


def _profile(model: nn.Module, x: Batch, steps: int, warmup: int, hardware: Hardware | None,
             suggest: bool, trace, name: str, plans: PlanAdvisor | None = None, loss: Any = None) -> ProfileReport:
    step = _trainer(model, x, loss)
    try:
        step()  # the first step also checks that the model trains on this input at all
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 (user code: any failure is reported as a usage error)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UsageError(f"the model failed on the input {describe(x)}: {type(exc).__name__}: {first}; give the "
                         "inputs the model expects (shapes batch first, dtypes, for token ids a range below the "
                         "embedding size, one tensor per positional argument)") from None
    timing = time_steps(step, warmup=max(warmup - 1, 0), steps=steps)
    seconds, profiled = _profiled_step(step, trace, tries=min(steps, 3))
    counts = count_step(model, x, loss=loss)
    hw = hardware or _at_least_observed(_this_machine(), counts, seconds, timing.median_s)
    floor = step_floor(counts, hw, measured_s=timing.median_s)
    shape = tuple(x.shape) if isinstance(x, torch.Tensor) else (batch_size(x),)
    report = ProfileReport(name, shape, torch.get_num_threads(), timing, profiled,
                           _group_rows(seconds, counts, hw), floor, hw, counts, inputs=describe(x),
                           batch=batch_size(x), loss=_loss_name(step))
    if suggest:
        report.suggestions, report.suggestions_contention = _suggestions(model, x, report, steps, plans, loss)
    return report


def _loss_name(step: Callable[[], object]) -> str:
    """The loss a profiled step minimised (a GPU step's wrapper keeps its TrainingStep as ``training_step``)."""
    inner = getattr(step, "training_step", step)
    return str(getattr(getattr(inner, "loss", None), "name", "") or "")

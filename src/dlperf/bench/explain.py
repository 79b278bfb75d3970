"""``dlperf bench --explain``: what each cell's step should cost, beside what it did cost (d2l 12.4).

The floor comes from :mod:`dlperf.probe.cost`: a step's FLOPs, bytes moved and operator calls are
counted once per (network, batch) on the meta device, and each is priced on this machine's figures at
the cell's thread count: the ``dlperf probe`` cache when there is one with that thread count, else a
sub-second in-process estimate. The floor is the largest component (compute, memory or dispatch,
plus the gradient allreduce for a multi-device step): the least the step could take were the others
hidden behind it. A floor priced on estimates can exceed a noisy measured time; it is a guide, not a
bound checked here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import UsageError

if TYPE_CHECKING:  # the probe loads on first use: a sweep without --explain never needs it
    from ..probe.cost import Hardware, StepCounts

__all__ = ["CellFloor", "FloorModel"]


@dataclass(frozen=True)
class CellFloor:
    """One cell's floor, its components and what priced them."""

    floor_s: float
    components: dict[str, float]
    source: str
    """``probe cache (N threads)`` or ``estimated in-process (N threads)``."""
    flops: float
    peak_flops: float

    @property
    def bottleneck(self) -> str:
        return max(self.components, key=self.components.__getitem__)

    def measured_over_floor(self, measured_s: float | None) -> float | None:
        return measured_s / self.floor_s if measured_s and self.floor_s > 0 else None

    def pct_of_peak(self, measured_s: float | None) -> float | None:
        if not measured_s or not self.peak_flops or not self.flops:
            return None
        return 100.0 * self.flops / measured_s / self.peak_flops

    def overshoot(self, measured_s: float | None) -> str | None:
        """Where the floor lies above the measured time, the cost model is wrong, not the step faster than possible:
        one line naming the component that overshot (its figure above the measurement), else None."""
        if not measured_s or self.floor_s <= measured_s:
            return None
        over = {k: v for k, v in self.components.items() if v > measured_s}
        name = max(over or self.components, key=(over or self.components).__getitem__)
        return (f"cost-model error: the floor {self.floor_s * 1e3:.2f} ms is above the measured "
                f"{measured_s * 1e3:.2f} ms; its {name} component ({self.components[name] * 1e3:.2f} ms) overshot "
                f"({self.source})")

    def to_dict(self, measured_s: float | None) -> dict:
        return {"floor_s": self.floor_s, "floor_components": dict(self.components),
                "floor_bottleneck": self.bottleneck, "measured_over_floor": self.measured_over_floor(measured_s),
                "pct_of_peak": self.pct_of_peak(measured_s), "floor_source": self.source,
                "floor_error": self.overshoot(measured_s)}


def _probe_hardware(threads: int) -> Hardware | None:
    """The cached probe's figures at ``threads``, or None when there is no cache or it lacks that count."""
    from ..probe.cache import load_probe
    from ..probe.cost import Hardware

    result = load_probe()
    if result is None:
        return None
    try:
        return Hardware.from_probe_result(result, threads=threads)
    except UsageError:  # no torch.mm row at this thread count (or an interrupted probe)
        return None


def _estimated_hardware(threads: int) -> Hardware:
    from .._threads import intra_op_threads
    from ..probe.profile import estimate_hardware

    with intra_op_threads(threads):
        return estimate_hardware()


class FloorModel:
    """Counts per (network, batch) and hardware per thread count, each measured once per sweep.

    ``hardware_for`` may be replaced (tests price on fixed figures); it returns ``(Hardware, source)``.
    """

    def __init__(self, hardware_for: Callable[[int], tuple[Hardware, str]] | None = None) -> None:
        self._counts: dict[tuple[str, int], StepCounts] = {}
        self._hardware: dict[int, tuple[Hardware, str]] = {}
        self._hardware_for = hardware_for or self.this_machine

    @staticmethod
    def this_machine(threads: int) -> tuple[Hardware, str]:
        hw = _probe_hardware(threads)
        if hw is not None:
            return hw, f"probe cache ({threads} thread{'s' if threads != 1 else ''})"
        return _estimated_hardware(threads), f"estimated in-process ({threads} thread{'s' if threads != 1 else ''})"

    def counts(self, network: str, batch: int) -> StepCounts:
        key = (network, batch)
        if key not in self._counts:
            from ..models import get_spec
            from ..probe.cost import count_step

            spec = get_spec(network)
            x, _ = spec.input.make_batch(batch, torch.device("meta"))
            # counted under the meta device too: a tensor the forward makes itself (torch.arange for a
            # mask, in many user models) must land beside the meta activations
            with torch.device("meta"):
                model = spec.build()
                self._counts[key] = count_step(model, x)
        return self._counts[key]

    def hardware(self, threads: int) -> tuple[Hardware, str]:
        if threads not in self._hardware:
            self._hardware[threads] = self._hardware_for(threads)
        return self._hardware[threads]

    def floor(self, network: str, batch: int, threads: int, *, devices: int = 1,
              allreduce: str | None = None) -> CellFloor:
        """The floor of one step of ``network`` at ``batch`` (the global batch, split over ``devices``)."""
        from ..probe.cost import step_floor

        counts = self.counts(network, batch)
        hw, source = self.hardware(threads)
        floor = step_floor(counts, hw, devices=devices, allreduce=allreduce)
        # the peak of the whole step: every device's, since the FLOPs are the whole batch's
        peak = hw.peak_flops(counts.dtype) * devices
        return CellFloor(floor.overlap_s, dict(floor.components), source, counts.total_flops, peak)


def fmt_ratio(x: float | None) -> str:
    return f"{x:.1f}x" if x is not None else "-"


def fmt_pct(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}%" if x >= 0.1 else f"{x:.2g}%"


def fmt_floor(cell_floor: CellFloor | None, measured_s: float | None = None) -> str:
    if cell_floor is None:
        return "-"
    s = cell_floor.floor_s
    text = f"{s:.3f}" if s >= 0.01 else f"{s * 1e3:.2f}ms"
    # a floor above the measured step is the cost model's error, flagged (footnote names the component)
    return f"{text} {cell_floor.bottleneck}" + ("!" if cell_floor.overshoot(measured_s) else "")


def explain_footnotes(sources: Sequence[str | None], errors: Sequence[str | None] = ()) -> list[str]:
    """How the floor rows were priced, once per distinct source; each floor that lies above its measurement."""
    notes = ["floor: the cost model's least time for the step (dlperf.probe.cost; its largest component among "
             "compute, memory, dispatch and any allreduce, named beside it); x floor: measured / floor; "
             "% peak: FLOP/s achieved as a share of the measured peak. A floor priced on estimates can "
             "exceed a noisy time."]
    seen = list(dict.fromkeys(s for s in sources if s))
    if seen:
        notes.append("floor figures: " + "; ".join(seen) + ".")
    notes += [f"! {e}" for e in dict.fromkeys(e for e in errors if e)]
    return notes

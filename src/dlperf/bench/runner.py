"""Run the Table-7 sweep: every network on every device and thread count, one training step timed.

Each (network, device, threads) is a *cell*. A cell that fails (out of memory, a compile error, an
absent kernel) records its reason and the sweep goes on, as the paper's "-" entries do. Ctrl-C stops
the sweep: the cell it interrupts is dropped, the finished ones are kept and the result says so.

Every cell carries the timer's contention verdict (:mod:`dlperf.timing`): a cell timed while other
work competed for its CPUs is marked, and so is the whole run. A thread sweep in which more threads
were slower than fewer is called out too: on a quiet machine that points at the network (too little
work per op to share), on a busy one at the machine.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from .._threads import intra_op_threads
from ..devices import Device, cpu, cpu_count, num_gpus, require_available, to_device
from ..errors import UsageError, unknown_choice
from ..machine import cpu_model
from ..models import get_spec, model_names
from ..timing import doubling_up_to, time_steps
from .explain import FloorModel
from .modes import get_mode, mode_names
from .result import BenchResult, CellResult, slower_with_more_threads

__all__ = ["BenchConfig", "BenchResult", "CellResult", "count_step_flops", "default_devices", "default_threads",
           "describe_failure", "explain_cell", "machine_info", "run_bench", "run_cell", "slower_with_more_threads",
           "step_backend"]


def default_threads(cores: int | None = None) -> list[int]:
    """1, 2, 4, ... up to the core count, plus the core count itself if it is not a power of two."""
    return doubling_up_to(cores or cpu_count())


def default_devices() -> list[Device]:
    return [cpu(), *(Device("gpu", i) for i in range(num_gpus()))]


@dataclass
class BenchConfig:
    """What to measure and how long to measure it."""

    networks: list[str] = field(default_factory=lambda: model_names(paper_only=True))
    """Networks to time, by zoo name (default: the paper's seven)."""
    devices: list[Device] = field(default_factory=default_devices)
    """Devices to time on (default: the CPU and every GPU)."""
    threads: list[int] = field(default_factory=default_threads)
    """Intra-op thread counts for CPU cells (GPU cells use one setting)."""
    batch_size: int | None = None
    """Override every network's batch size (default: the paper's, per device kind)."""
    warmup: int = 2
    """Untimed steps first (allocator, caches, compilation)."""
    steps: int = 10
    """Timed steps per cell."""
    max_cell_seconds: float | None = None
    """Stop timing a cell early after this many seconds (at least 3 steps are always taken)."""
    mode: str = "eager"
    """How the step runs: eager, compile (torch.compile), hybrid (the step captured by dlperf.hybrid) or auto."""
    seed: int = 0
    """Seed for weights and synthetic batches."""
    explain: bool = False
    """Price every cell's step on the cost model too: its floor, measured / floor, % of peak FLOP/s."""

    def __post_init__(self) -> None:
        self.networks = [get_spec(n).name for n in self.networks]  # raises on unknown names
        self.devices = [require_available(to_device(d)) for d in self.devices]
        if len(set(self.devices)) != len(self.devices):
            raise UsageError(f"a device is listed twice in {[str(d) for d in self.devices]}; list each once")
        if not self.threads or any(t < 1 for t in self.threads):
            raise UsageError(f"thread counts must be integers >= 1, got {self.threads}")
        if self.batch_size is not None and self.batch_size < 1:
            raise UsageError(f"batch size must be >= 1, got {self.batch_size}")
        if self.steps < 1 or self.warmup < 1:
            raise UsageError(f"steps={self.steps} warmup={self.warmup}: expected steps >= 1 and warmup >= 1")
        if self.mode not in mode_names():
            raise unknown_choice("mode", self.mode, mode_names())

    @classmethod
    def quick(cls, **overrides) -> BenchConfig:
        """The sweep in minutes: fewer timed steps, the same batch sizes."""
        base: dict[str, Any] = dict(warmup=1, steps=5, max_cell_seconds=12.0)
        base.update(overrides)
        return cls(**base)

    def cells(self) -> Iterator[tuple[str, Device, int | None]]:
        for net in self.networks:
            for dev in self.devices:
                if dev.is_gpu:
                    yield net, dev, None
                else:
                    for t in self.threads:
                        yield net, dev, t


def register_user_networks(networks: list[str], inputs=None, loss=None) -> list[str]:
    """Register each ``module:factory`` in ``networks`` as a bench network fed by ``inputs`` and timed with
    ``loss`` (:class:`dlperf.models.inputs.StructuredLoss`); the names.

    ``inputs`` is what ``--input`` gives (:data:`dlperf.probe.user_inputs.InputSource`: tensor specs,
    or a function returning the batch). A zoo name passes through. The factory is imported and called here,
    once, because the user named it; a network given without inputs, or inputs without one, is refused.
    """
    from ..models.spec import user_network
    from ..probe.targets import build_model
    from ..probe.user_inputs import batch_maker

    users = [n for n in networks if ":" in n]
    if inputs and not users:
        raise UsageError("inputs= describes the batch of a network given as MODULE:FACTORY, and none is; drop "
                         "inputs= (zoo networks make their own batches) or name your model's factory in networks=")
    if users and not inputs:
        raise UsageError(f"network {users[0]} needs its batch: give inputs= with a batch-first shape and dtype per "
                         "model argument (64x3x32x32, 64x32:int64) or a function returning the batch "
                         "(mypkg.data:make_batch)")
    if not users:
        return networks
    if not callable(inputs) and not isinstance(inputs, str):
        from .._cliargs import require_memory
        from ..probe.user_inputs import input_bytes

        # the batch, its resized copy and the step's activations, before any of it is allocated
        require_memory(4 * input_bytes(inputs), "--input " + " --input ".join(s.text() for s in inputs),
                       "give a smaller --input")
    make = inputs if callable(inputs) else batch_maker(inputs)
    for name in users:
        user_network(name, functools.partial(build_model, name), make, loss=loss)
    return networks


@contextlib.contextmanager
def user_networks(networks: list[str], inputs=None, loss=None) -> Iterator[list[str]]:
    """:func:`register_user_networks` for the length of one sweep: the zoo is left as it was found, so a
    library caller's later ``model_names()`` lists the zoo alone."""
    from ..models.spec import unregister

    try:
        yield register_user_networks(networks, inputs, loss)
    finally:
        for name in networks:
            if ":" in name:
                unregister(name)


def machine_info() -> dict:
    """What the numbers were measured on."""
    info = {
        "cpu": cpu_model(),
        "cores": cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(num_gpus())],
        "date": time.strftime("%Y-%m-%d"),
    }
    return info


def count_step_flops(network: str, batch_size: int) -> float | None:
    """FLOPs of one forward+backward, counted on the meta device so no real work is done."""
    spec = get_spec(network)
    try:
        with torch.device("meta"):
            model = spec.build()
        x, y = spec.input.make_batch(batch_size, "meta")
        with FlopCounterMode(display=False) as counter:
            spec.loss(model(x), y).backward()
        return float(counter.get_total_flops()) or None
    except Exception:  # a model the counter cannot trace simply reports no FLOP/s
        return None


def describe_failure(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text.lower() \
            or "can't allocate memory" in text.lower():
        return "out of memory"
    return f"{type(exc).__name__}: {text[:160]}"


# torch.compile's documented default backend, which compiled_step does not override
_MODE_BACKENDS = {"compile": "inductor"}


def step_backend(step: Callable, mode: str) -> str | None:
    """What runs a built step: the backend(s) replaying a captured training step or a hybridized model,
    or the mode's compiler backend."""
    runs_on = getattr(step, "runs_on", None)  # a captured training step (dlperf.hybrid.TrainStep)
    if runs_on is not None:
        return runs_on
    hybrid = getattr(step, "hybrid_module", None)
    if hybrid is not None:
        chosen = sorted({choice.backend for choice in hybrid.choices.values()})
        return ",".join(chosen) if chosen else hybrid.state
    return getattr(step, "backend", None) or _MODE_BACKENDS.get(mode)


def _time_cell(cell: CellResult, config: BenchConfig, on_step: Callable[[], None] | None) -> None:
    """Build the cell's model and step, time it, and record the result on ``cell``."""
    spec, dev = get_spec(cell.network), cell.device
    torch.manual_seed(config.seed)
    model = spec.build().to(dev.torch_device)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(config.seed)
    x, y = spec.input.make_batch(cell.batch_size, dev.torch_device, generator=gen)
    built = time.perf_counter()
    step = get_mode(config.mode)(model, spec.loss, optimizer, x, y)
    build_s = time.perf_counter() - built
    # a GPU cell keeps one host thread busy launching kernels
    try:
        cell.timing = time_steps(lambda: step(x, y), warmup=config.warmup, steps=config.steps,
                                 synchronize=dev.synchronize, on_step=on_step,
                                 max_seconds=config.max_cell_seconds, threads=cell.threads or 1)
    finally:
        getattr(step, "close", lambda: None)()  # an auto cell's Trainer plan has device workers to stop
    if config.mode != "eager":
        overhead = cell.timing.first_call_overhead_s
        cell.compile_s = build_s + (overhead or 0.0)
        cell.backend = step_backend(step, config.mode)
        cell.eager_reason = getattr(step, "eager_reason", None)
    cell.mode_chosen = getattr(step, "mode_chosen", None)
    cell.gain_over_eager = getattr(step, "gain_over_eager", None)
    cell.auto_reason = getattr(step, "auto_reason", None)
    cell.plan = getattr(step, "plan", None)


def run_cell(net: str, dev: Device, threads: int | None, config: BenchConfig,
             flops: float | None, on_step: Callable[[], None] | None = None) -> CellResult:
    spec = get_spec(net)
    batch = config.batch_size or spec.batch_size_for(dev.kind)
    cell = CellResult(net, dev, threads, batch, config.mode, flops_per_step=flops)
    try:
        with intra_op_threads(threads):
            _time_cell(cell, config, on_step)
    except Exception as exc:  # noqa: BLE001 - one cell's failure must not lose the others
        cell.error = describe_failure(exc)
    finally:
        # The model, optimizer and batch went with _time_cell's frame; collect them before the next cell
        # allocates its own (fcn-s alone is ~1.4 GB with grads).
        gc.collect()
        if dev.is_gpu:
            torch.cuda.empty_cache()
    return cell


def explain_cell(cell: CellResult, floors: FloorModel) -> None:
    """Attach the cost model's floor to a timed cell; a cell it cannot price says why instead."""
    cell.explained = True
    if cell.device.is_gpu:
        cell.floor_note = "no floor: the probe measures the CPU, not GPUs"
        return
    try:
        cell.floor = floors.floor(cell.network, cell.batch_size, cell.threads or torch.get_num_threads())
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - a model the counter cannot run keeps its measured time
        cell.floor_note = f"no floor: {describe_failure(exc)}"


def run_bench(config: BenchConfig, on_cell_start: Callable[[str, Device, int | None], None] | None = None,
              on_step: Callable[[], None] | None = None,
              on_cell_done: Callable[[CellResult], None] | None = None) -> BenchResult:
    """Time every cell of ``config``; callbacks let a caller show progress.

    A KeyboardInterrupt (Ctrl-C) ends the sweep early instead of losing it: the interrupted cell is
    dropped and the result, marked ``interrupted``, holds every cell that finished.
    """
    t0 = time.perf_counter()
    flops: dict[tuple[str, int], float | None] = {}
    floors = FloorModel() if config.explain else None
    cells = []
    interrupted = False
    try:
        for net, dev, threads in config.cells():
            if on_cell_start:
                on_cell_start(net, dev, threads)
            batch = config.batch_size or get_spec(net).batch_size_for(dev.kind)
            if (net, batch) not in flops:
                flops[(net, batch)] = count_step_flops(net, batch)
            cells.append(run_cell(net, dev, threads, config, flops[(net, batch)], on_step))
            if floors is not None:
                explain_cell(cells[-1], floors)
            if on_cell_done:
                on_cell_done(cells[-1])
    except KeyboardInterrupt:
        interrupted = True
    return BenchResult(config, cells, machine_info(), time.perf_counter() - t0, interrupted)

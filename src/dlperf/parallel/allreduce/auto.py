"""``auto``: pick the allreduce algorithm the cost model predicts fastest for this size and these links.

The choice ranks the registered algorithms that have a formula in :mod:`dlperf.probe.cost` (Thakur,
Rabenseifner & Gropp 2005's alpha-beta model) with the figures of the links in use:

* GPUs: the textbook formulas, with device-to-device and device-to-host copies timed now at two
  sizes (the probe times neither).
* logical CPU devices: every link is host memory. Its bandwidth is the probe's copy figure
  (``dlperf probe``) when this machine has a cache, else a host copy timed now at two sizes. Its
  latency is not a message on a wire but a hand-off of a task to a device worker thread and the wait
  for it, timed now, and the number of such steps is counted from the algorithm's own schedule: a
  phase with one task runs on the calling thread and hands nothing off. So at k = 2 ``naive`` (two
  one-task phases) has no hand-off at all, where the textbook charges it 2(k-1) messages. The
  operators each task dispatches (counted by running the schedule once on tiny tensors) add the
  probe's per-operator cost; the bandwidth terms stay the textbook's.

Link figures are measured once per process. Each new decision is logged on the
``dlperf.parallel.allreduce`` logger with its reason.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
import time
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...devices import Device, DeviceLike, to_device
from ...errors import UsageError
from .base import DEFAULT_ALGORITHM, AllreduceAlgorithm, Phase, algorithm_names, get_algorithm, register_algorithm

__all__ = ["AutoAllreduce", "choose_algorithm", "link_hardware", "handoff_steps", "operator_steps", "schedule_ops",
           "predict", "Prediction", "describe_bytes"]

log = logging.getLogger("dlperf.parallel.allreduce")

# Two copy sizes for fitting t(n) = alpha + n * beta: one that costs little more than the call itself,
# one large enough (beyond the caches of most CPUs) that the bandwidth term dominates.
_SMALL_BYTES = 4 * 1024
_LARGE_BYTES = 32 * 1024 * 1024
_SMALL_REPS, _LARGE_REPS = 50, 5
_HANDOFF_REPS = 200
_MIN_ALPHA_S = 1e-8  # a fit on a noisy machine can give a negative intercept; a link is never free
_TIE = 1e-9  # relative: predictions that agree to this are the same (ring and sharded on GPUs at k = 2)
_MAX_DECISIONS = 4096

_lock = threading.Lock()
_hardware: dict[tuple, tuple[object, str]] = {}
_decisions: dict[tuple, tuple[str, str]] = {}
_steps: dict[tuple[str, int], list[list[int]]] = {}


def describe_bytes(n: float) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value >= 10 or value == int(value) else f"{value:.1f} {unit}"
    return f"{int(n)} B"


def _median_copy_s(dst: torch.Tensor, src: torch.Tensor, reps: int, sync) -> float:
    dst.copy_(src)  # first touch: page faults and allocator work are not the link
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fit_link(src_device: torch.device, dst_device: torch.device, sync):
    """``Link(alpha, bandwidth)`` from the median time of one copy at two sizes."""
    from ...probe.cost import Link

    sizes, seconds = (_SMALL_BYTES, _LARGE_BYTES), []
    for nbytes, reps in zip(sizes, (_SMALL_REPS, _LARGE_REPS)):
        src = torch.ones(nbytes // 4, device=src_device)
        dst = torch.empty(nbytes // 4, device=dst_device, pin_memory=dst_device.type == "cpu"
                          and src_device.type == "cuda")
        seconds.append(_median_copy_s(dst, src, reps, sync))
        del src, dst
    beta = max((seconds[1] - seconds[0]) / (sizes[1] - sizes[0]), 1e-15)
    alpha = max(seconds[0] - sizes[0] * beta, _MIN_ALPHA_S)
    return Link(alpha, 1.0 / beta)


def _measure_handoff_s(k: int) -> float:
    """Median time to hand one empty task to each of ``k`` device workers and wait for all of them."""
    from ..workers import DeviceWorkers, wait_all

    def noop() -> None:
        return None

    with DeviceWorkers([Device("cpu", i) for i in range(k)], threads=[1] * k, name="dlperf-link") as workers:
        for _ in range(20):  # threads started and scheduled once before timing
            wait_all([workers.submit(i, noop) for i in range(k)])
        times = []
        for _ in range(_HANDOFF_REPS):
            t0 = time.perf_counter()
            wait_all([workers.submit(i, noop) for i in range(k)])
            times.append(time.perf_counter() - t0)
    return max(statistics.median(times), _MIN_ALPHA_S)


def _gpu_links(gpus: list[Device]):
    from ...probe.cost import Hardware

    first = gpus[0].torch_device

    def sync() -> None:
        for g in gpus:
            torch.cuda.synchronize(g.torch_device)

    host = _fit_link(first, torch.device("cpu"), sync)
    device = _fit_link(first, gpus[1].torch_device, sync) if len(gpus) > 1 else host
    links = {"copy": host, "host": host, "device": device, "network": host}
    what = "device-device and device-host copies timed now"
    return Hardware("links in use", {}, 2 * host.bandwidth, host.alpha_s, links, notes=what), what


def _host_links(k: int):
    """Host-memory links of ``k`` logical CPU devices: a worker hand-off, then a copy at the probe's rate."""
    from ...probe import load_probe
    from ...probe.cost import Hardware, Link

    copy, dispatch, where = None, None, "a host copy and an operator timed now"
    result = load_probe(quiet=True)
    if result is not None:
        try:
            probed = Hardware.from_probe_result(result)
            copy, dispatch = probed.link("copy"), probed.dispatch_s
            where = "the dlperf probe cache's copy rate and dispatch cost"
        except Exception:  # noqa: BLE001 (a cache without the copy figures: measure instead)
            copy = None
    if copy is None:
        copy = _fit_link(torch.device("cpu"), torch.device("cpu"), lambda: None)
        dispatch = _measure_dispatch_s()
    link = Link(_measure_handoff_s(k), copy.bandwidth)
    links = {"copy": link, "host": link, "device": link, "network": link}
    what = f"{where}, and a worker hand-off timed now"
    return Hardware("host memory", {}, 2 * link.bandwidth, dispatch, links, notes=what), what


def _measure_dispatch_s(calls: int = 2000) -> float:
    """Seconds per eager operator on a one-element tensor: Python binding, dispatcher, kernel."""
    x = torch.zeros(1)
    for _ in range(100):
        x.add_(1.0)
    t0 = time.perf_counter()
    for _ in range(calls):
        x.add_(1.0)
    return max((time.perf_counter() - t0) / calls, _MIN_ALPHA_S)


def link_hardware(devices: Sequence[DeviceLike]):
    """``(Hardware, where its link figures come from)`` for the devices in use; measured once per process."""
    devs = [to_device(d) for d in devices]
    gpus = sorted({d for d in devs if d.is_gpu})
    key = tuple(gpus) if gpus else ("cpu", len(devs))
    with _lock:
        if key not in _hardware:
            _hardware[key] = _gpu_links(gpus) if gpus else _host_links(max(len(devs), 1))
        return _hardware[key]


def _candidates() -> list[str]:
    from ...probe.cost import ALLREDUCE_FORMULAS

    return [n for n in algorithm_names() if n in ALLREDUCE_FORMULAS]


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def schedule_ops(name: str, k: int) -> list[list[int]]:
    """Operators each task of ``name``'s schedule dispatches, per phase, for ``k`` small tensors.

    The schedule runs once on k-element host tensors under a dispatch counter: the counts are those
    of the algorithm as written, slicing included, not of a formula.
    """
    key = (name, k)
    if key not in _steps:
        phases = get_algorithm(name).schedule([torch.zeros(k) for _ in range(k)])
        counts = []
        for phase in phases:
            row = []
            for task in (t for t in phase if t is not None):
                with _CountOps() as counter:
                    task()
                row.append(counter.ops)
            counts.append(row)
        _steps[key] = counts
    return _steps[key]


def handoff_steps(name: str, k: int) -> int:
    """Phases of ``name``'s schedule for ``k`` devices that hand work to more than one device worker.

    A phase with a single task runs on the calling thread (see ``run_schedule``), so it costs no hand-off.
    """
    return sum(1 for row in schedule_ops(name, k) if len(row) > 1)


def operator_steps(name: str, k: int, cores: int) -> float:
    """Operator dispatches on the critical path: per phase its longest task, or its tasks' total over the
    cores when there are more tasks than cores to run them."""
    return sum(max(max(row), sum(row) / max(cores, 1)) if len(row) > 1 else sum(row)
               for row in schedule_ops(name, k))


@dataclasses.dataclass(frozen=True)
class Prediction:
    algorithm: str
    seconds: float
    latency_s: float
    bandwidth_s: float
    formula: str  # the latency and bandwidth terms, in words


def predict(nbytes: float, k: int, hardware, *, shared_memory: bool, algorithms: Sequence[str] | None = None,
            cores: int | None = None) -> list[Prediction]:
    """The candidates' predicted times, fastest first (ties: the default first, then by name).

    Every candidate keeps its textbook bandwidth term. With ``shared_memory`` (logical CPU devices)
    its latency term is not the textbook's message count but what its schedule does: hand-off steps
    times the link's alpha, plus operator dispatches on the critical path (``cores`` running the
    tasks of a phase; default: this machine's) times the hardware's dispatch cost.
    """
    from ...devices import cpu_count
    from ...probe.cost import rank_allreduce

    cores = cores or cpu_count()

    out = []
    for c in rank_allreduce(float(nbytes), k, hardware, tuple(algorithms or _candidates())):
        formula = c.reason.split(":", 1)[0]
        latency = c.latency_s
        if shared_memory:
            steps, ops = handoff_steps(c.algorithm, k), operator_steps(c.algorithm, k, cores)
            latency = steps * hardware.link("host").alpha_s + ops * hardware.dispatch_s
            formula = f"{steps} hand-off{'s' if steps != 1 else ''} + {ops:.3g} ops + bandwidth of {formula}"
        out.append(Prediction(c.algorithm, latency + c.bandwidth_s, latency, c.bandwidth_s, formula))
    best = min(p.seconds for p in out)
    return sorted(out, key=lambda p: (p.seconds > best * (1 + _TIE), p.seconds,
                                      p.algorithm != DEFAULT_ALGORITHM, p.algorithm))


def _why(p: Prediction) -> str:
    bound = "latency" if p.latency_s > p.bandwidth_s else "bandwidth"
    return f"{p.algorithm} [{p.formula}] {p.seconds * 1e3:.3g} ms, {bound}-bound"


def choose_algorithm(nbytes: float, devices: Sequence[DeviceLike] | int, hardware=None) -> tuple[str, str]:
    """The registered algorithm the cost model predicts fastest, and a one-line reason naming the runner-up.

    ``devices`` are the devices in use (or the number of logical CPU devices); ``hardware`` a
    :class:`~dlperf.probe.cost.Hardware` to predict with instead of the measured links. Predictions
    that tie go to the project default, :data:`DEFAULT_ALGORITHM`.
    """
    if isinstance(devices, int) and not isinstance(devices, bool):
        devices = [Device("cpu", i) for i in range(devices)]
    devs = [to_device(d) for d in devices]
    k = len(devs)
    if k < 1 or isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not 0 <= nbytes < float("inf"):
        raise UsageError(f"choose_algorithm needs a finite nbytes >= 0 and at least one device, got "
                         f"nbytes={nbytes!r} and {k} devices")
    size = describe_bytes(nbytes)
    if k == 1:
        return DEFAULT_ALGORITHM, f"1 device, {size}: nothing to reduce"
    source = "the given hardware"
    if hardware is None:
        hardware, source = link_hardware(devs)
    shared = not any(d.is_gpu for d in devs)
    ranked = predict(nbytes, k, hardware, shared_memory=shared)
    pick, runner = ranked[0], ranked[1]
    if runner.seconds <= pick.seconds * (1 + _TIE):
        versus = f"ties with {_why(runner)}; {pick.algorithm} is the default"
    else:
        versus = f"next {_why(runner)}"
    kind = "logical CPU devices" if shared else "devices"
    reason = (f"{k} {kind}, {size}: {_why(pick)}; {versus}; alpha {hardware.link('host').alpha_s * 1e6:.3g} us "
              f"from {source}")
    return pick.algorithm, reason


class AutoAllreduce(AllreduceAlgorithm):
    name = "auto"
    summary = "the algorithm the alpha-beta cost model predicts fastest for this size on the measured links"

    def choose(self, flats: Sequence[torch.Tensor]) -> tuple[str, str]:
        nbytes = flats[0].numel() * flats[0].element_size()
        devices = [to_device(f.device) for f in flats]
        key = (nbytes, tuple(str(d) for d in devices))
        with _lock:
            known = _decisions.get(key)
        if known is not None:
            return known
        decision = choose_algorithm(nbytes, devices)
        with _lock:
            if len(_decisions) >= _MAX_DECISIONS:
                _decisions.clear()  # a bounded memo: sizes vary little in training, a lot only in sweeps
            _decisions[key] = decision
        log.info("allreduce: %s (%s)", *decision)
        return decision

    def schedule(self, flats: list[torch.Tensor]) -> list[Phase]:
        name, _ = self.choose(flats)
        return get_algorithm(name).schedule(flats)


register_algorithm(AutoAllreduce())

"""``auto``: pick the allreduce algorithm the cost model predicts fastest for this size and these links.

The choice ranks the registered algorithms that have a formula in :mod:`dlperf.probe.cost` (Thakur,
Rabenseifner & Gropp 2005's alpha-beta model) with the figures of the links in use:

* GPUs: the textbook formulas, with device-to-device and device-to-host copies timed now at two
  sizes (the probe times neither).
* logical CPU devices: every link is host memory, and the textbook's messages do not describe
  what the algorithms do there, so each is costed from its own schedule (:func:`schedule_costs`,
  counted by running it once on small tensors): its operators at the probe's per-operator cost, its
  memory traffic at the probe's copy rate (``dlperf probe``'s cache; without one, an operator and a
  host copy at two sizes are timed now), and for every phase that several device workers share, one
  hand-off to them, timed now. A phase with one task runs on the calling thread and hands nothing
  off, so at k = 2 ``naive`` has no latency beyond its two operators, where the textbook charges it
  2(k-1) messages; without device workers every task runs on the calling thread.

Link figures are measured once per process. Each new decision is logged on the
``dlperf.parallel.allreduce`` logger with its reason.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...devices import Device, DeviceLike, to_device
from ...errors import UsageError
from ...probe.cost import Link
from ...timing import best_of, median_of
from .base import DEFAULT_ALGORITHM, AllreduceAlgorithm, Phase, algorithm_names, get_algorithm, register_algorithm

__all__ = ["AutoAllreduce", "choose_algorithm", "link_hardware", "cache_figures", "handoff_steps", "schedule_costs",
           "TaskCost",
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
_hardware: dict[object, tuple] = {}
_decisions: dict[tuple, tuple[str, str]] = {}
_steps: dict[tuple[str, int], list] = {}


def describe_bytes(n: float) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value >= 10 or value == int(value) else f"{value:.1f} {unit}"
    return f"{int(n)} B"


def _median_copy_s(dst: torch.Tensor, src: torch.Tensor, reps: int, sync: Callable[[], None]) -> float:
    # the untimed first copy takes the first touch: page faults and allocator work are not the link
    return median_of(functools.partial(dst.copy_, src, non_blocking=True), reps=reps, synchronize=sync)


def _fit_link(src_device: torch.device, dst_device: torch.device, sync: Callable[[], None]) -> Link:
    """``Link(alpha, bandwidth)`` from the median time of one copy at two sizes."""
    sizes, seconds = (_SMALL_BYTES, _LARGE_BYTES), []
    for nbytes, reps in zip(sizes, (_SMALL_REPS, _LARGE_REPS)):
        src = torch.ones(nbytes // 4, device=src_device)
        dst = torch.empty(nbytes // 4, device=dst_device, pin_memory=dst_device.type == "cpu"
                          and src_device.type == "cuda")
        seconds.append(_median_copy_s(dst, src, reps, sync))
        del src, dst
    return Link.fit(sizes, seconds, min_alpha_s=_MIN_ALPHA_S)


def _measure_handoff_s(k: int) -> float:
    """Median time to push one empty operation to each of ``k`` device lanes of the engine and wait for all."""
    from ...engine import create_engine

    def noop() -> None:
        return None

    devices = [Device("cpu", i) for i in range(k)]
    with create_engine("threaded", cpu_threads=1) as eng:
        def round_trip() -> None:
            for op in [eng.push(noop, device=d) for d in devices]:
                op.wait()

        # the warm-up rounds start the threads and get them scheduled once before timing
        return max(median_of(round_trip, reps=_HANDOFF_REPS, warmup=20), _MIN_ALPHA_S)


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
    from ...probe.cost import Hardware

    figures: tuple[Link, float] | None = None
    where = "a host copy and an operator timed now"
    result = load_probe(quiet=True)
    if result is not None:
        try:
            probed = Hardware.from_probe_result(result)
            figures = probed.link("copy"), probed.dispatch_s
            where = "the dlperf probe cache's copy rate and dispatch cost"
        except Exception:  # noqa: BLE001 (a cache without the copy figures: measure instead)
            figures = None
    if figures is None:
        fitted = _fit_link(torch.device("cpu"), torch.device("cpu"), lambda: None)
        # a copy of n bytes reads n and writes n: the schedules' traffic counts both, as STREAM does
        figures = Link(fitted.alpha_s, 2 * fitted.bandwidth), _measure_dispatch_s()
    copy, dispatch = figures
    link = Link(_measure_handoff_s(k), copy.bandwidth)
    links = {"copy": link, "host": link, "device": link, "network": link}
    what = f"{where}, and a worker hand-off timed now"
    return Hardware("host memory", {}, link.bandwidth, dispatch, links, notes=what), what


def _in_cache_rate() -> tuple[int, float]:
    """(last-level cache bytes, traffic rate of a copy that stays in it): the probe's STREAM figure is
    memory's, and an allreduce of a few MB on two devices never leaves the cache."""
    from ...probe.hardware import cache_sizes

    llc = max(cache_sizes()[0].values())
    elems = max(llc // 16, 1024)  # source and destination together fill half the cache
    src, dst = torch.ones(elems), torch.empty(elems)
    seconds = _median_copy_s(dst, src, 20, lambda: None)
    return llc, 2 * elems * 4 / max(seconds, 1e-9)


def cache_figures() -> tuple[int, float]:
    """``(last-level cache bytes, in-cache traffic rate)`` of this host, measured once per process."""
    with _lock:
        if "cache" not in _hardware:
            _hardware["cache"] = _in_cache_rate()
        return _hardware["cache"]


def _measure_dispatch_s(calls: int = 2000) -> float:
    """Seconds per eager operator on a one-element tensor: Python binding, dispatcher, kernel."""
    x = torch.zeros(1)
    return max(best_of(functools.partial(x.add_, 1.0), reps=1, warmup=100, calls=calls), _MIN_ALPHA_S)


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


def _traffic(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_traffic(o) for o in obj)
    return 0


class _CountOps(TorchDispatchMode):
    """Operators dispatched, and the bytes they read and write (a view moves nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        returns = func._schema.returns
        if not (returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)):
            self.bytes += _traffic(args) + _traffic(list(kwargs.values())) + _traffic(out)
        return out


@dataclasses.dataclass(frozen=True)
class TaskCost:
    """One task of a schedule: operators it dispatches, and memory traffic per byte of each device's tensor."""

    ops: int
    traffic: float


_PROBE_ELEMENTS = 240  # per device: divisible by every k up to 6, so shards are equal and traffic exact


def schedule_costs(name: str, k: int) -> list[list[TaskCost]]:
    """Each task's :class:`TaskCost`, per phase, of ``name``'s schedule for ``k`` devices.

    The schedule runs once on small host tensors under a dispatch counter: the counts are those of
    the algorithm as written (slicing included), not of a formula. Traffic scales with the tensor;
    operator counts are those of a tensor below the 1 MiB blocks ``sharded`` cuts large ones into.
    """
    key = (name, k)
    if key not in _steps:
        n = _PROBE_ELEMENTS * k
        phases = get_algorithm(name).schedule([torch.zeros(n) for _ in range(k)])
        costs = []
        for phase in phases:
            row = []
            for task in (t for t in phase if t is not None):
                with _CountOps() as counter:
                    task()
                row.append(TaskCost(counter.ops, counter.bytes / (n * 4)))
            costs.append(row)
        _steps[key] = costs
    return _steps[key]


def handoff_steps(name: str, k: int) -> int:
    """Phases of ``name``'s schedule for ``k`` devices that hand work to more than one device worker.

    A phase with a single task runs on the calling thread (see ``run_schedule``), so it costs no hand-off.
    """
    return sum(1 for row in schedule_costs(name, k) if len(row) > 1)


def _phase_time(row: list[TaskCost], nbytes: float, hardware, cores: int, workers: bool,
                rate: float) -> tuple[float, float]:
    """(latency, transfer) seconds of one phase: its tasks run one after another on the calling thread
    without workers, else concurrently on the cores after one hand-off."""
    lat = [t.ops * hardware.dispatch_s for t in row]
    xfer = [t.traffic * nbytes / rate for t in row]
    if len(row) == 1 or not workers:
        return sum(lat), sum(xfer)
    share = max(1.0, len(row) / max(cores, 1))  # more tasks than cores: they take turns
    return hardware.link("host").alpha_s + max(max(lat), sum(lat) / len(row) * share), \
        max(max(xfer), sum(xfer) / len(row) * share)


@dataclasses.dataclass(frozen=True)
class Prediction:
    algorithm: str
    seconds: float
    latency_s: float
    bandwidth_s: float
    formula: str  # where the terms come from, in words


def _shared_memory_prediction(name: str, nbytes: float, k: int, hardware, cores: int, workers: bool,
                              rate: float) -> Prediction:
    latency = transfer = 0.0
    for row in schedule_costs(name, k):
        lat, xfer = _phase_time(row, nbytes, hardware, cores, workers, rate)
        latency, transfer = latency + lat, transfer + xfer
    rows = schedule_costs(name, k)
    ops = sum(t.ops for row in rows for t in row)
    traffic = sum(t.traffic for row in rows for t in row)
    steps = handoff_steps(name, k) if workers else 0
    what = (f"{steps} hand-off{'s' if steps != 1 else ''}, {ops} ops, {traffic:.3g}n bytes of traffic in all"
            + ("" if workers else ", all on the calling thread"))
    return Prediction(name, latency + transfer, latency, transfer, what)


def predict(nbytes: float, k: int, hardware, *, shared_memory: bool, algorithms: Sequence[str] | None = None,
            cores: int | None = None, workers: bool = True, cache: tuple[int, float] | None = None
            ) -> list[Prediction]:
    """The candidates' predicted times, fastest first (ties: the default first, then by name).

    Devices with their own memory (``shared_memory=False``) follow the textbook formulas. Logical CPU
    devices follow their schedules (:func:`schedule_costs`): each task costs its operators at the
    hardware's dispatch cost plus its memory traffic at the host link's rate; a phase of several
    tasks costs one hand-off (the link's alpha) and its longest task, or its tasks' total over the
    ``cores`` (default: this machine's) when there are more tasks than cores. Without device
    ``workers`` every task runs on the calling thread, one after another. ``cache``, ``(bytes, rate)``:
    when the k tensors fit in that many bytes, traffic moves at that rate instead.
    """
    from ...devices import cpu_count
    from ...probe.cost import rank_allreduce

    names = tuple(algorithms or _candidates())
    if shared_memory:
        cores = cores or cpu_count()
        rate = hardware.link("host").bandwidth
        if cache is not None and k * nbytes <= cache[0]:
            rate = max(rate, cache[1])
        out = [_shared_memory_prediction(n, float(nbytes), k, hardware, cores, workers, rate) for n in names]
    else:
        out = [Prediction(c.algorithm, c.seconds, c.latency_s, c.bandwidth_s, c.reason.split(":", 1)[0])
               for c in rank_allreduce(float(nbytes), k, hardware, names)]
    best = min(p.seconds for p in out)
    return sorted(out, key=lambda p: (p.seconds > best * (1 + _TIE), p.seconds,
                                      p.algorithm != DEFAULT_ALGORITHM, p.algorithm))


def _why(p: Prediction) -> str:
    bound = "latency" if p.latency_s > p.bandwidth_s else "bandwidth"
    return f"{p.algorithm} [{p.formula}] {p.seconds * 1e3:.3g} ms, {bound}-bound"


def choose_algorithm(nbytes: float, devices: Sequence[DeviceLike] | int, hardware=None, *,
                     workers: bool = True) -> tuple[str, str]:
    """The registered algorithm the cost model predicts fastest, and a one-line reason naming the runner-up.

    ``devices`` are the devices in use (or the number of logical CPU devices); ``hardware`` a
    :class:`~dlperf.probe.cost.Hardware` to predict with instead of the measured links; ``workers``
    whether the allreduce runs with device workers (``allreduce(..., workers=...)``) or all on the
    calling thread. Predictions that tie go to the project default, :data:`DEFAULT_ALGORITHM`.
    """
    if isinstance(devices, bool):
        raise UsageError(f"choose_algorithm needs devices or a number of devices, got {devices!r}")
    if isinstance(devices, int):
        devs = [Device("cpu", i) for i in range(devices)]
    else:
        devs = [to_device(d) for d in devices]
    k = len(devs)
    if k < 1 or isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not 0 <= nbytes < float("inf"):
        raise UsageError(f"choose_algorithm needs a finite nbytes >= 0 and at least one device, got "
                         f"nbytes={nbytes!r} and {k} devices")
    size = describe_bytes(nbytes)
    if k == 1:
        return DEFAULT_ALGORITHM, f"1 device, {size}: nothing to reduce"
    source, cache = "the given hardware", None
    shared = not any(d.is_gpu for d in devs)
    if hardware is None:
        hardware, source = link_hardware(devs)
        cache = cache_figures() if shared else None
    ranked = predict(nbytes, k, hardware, shared_memory=shared, workers=workers, cache=cache)
    pick, runner = ranked[0], ranked[1]
    if runner.seconds <= pick.seconds * (1 + _TIE):
        versus = f"ties with {_why(runner)}; {pick.algorithm} is the default"
    else:
        versus = f"next {_why(runner)}"
    kind = "logical CPU devices" if shared else "devices"
    if shared:
        in_cache = cache is not None and k * nbytes <= cache[0]
        rate = cache[1] if cache is not None and in_cache else hardware.link("host").bandwidth
        figures = (f"hand-off {hardware.link('host').alpha_s * 1e6:.3g} us, {hardware.dispatch_s * 1e6:.3g} us/op, "
                   f"{rate / 1e9:.3g} GB/s {'in cache, timed now' if in_cache else 'memory traffic'}")
    else:
        figures = (f"device link {hardware.link('device').alpha_s * 1e6:.3g} us + "
                   f"{hardware.link('device').bandwidth / 1e9:.3g} GB/s")
    reason = f"{k} {kind}, {size}: {_why(pick)}; {versus}; {figures} from {source}"
    return pick.algorithm, reason


class AutoAllreduce(AllreduceAlgorithm):
    name = "auto"
    summary = "the algorithm the alpha-beta cost model predicts fastest for this size on the measured links"

    def choose(self, flats: Sequence[torch.Tensor], workers: bool = True) -> tuple[str, str]:
        nbytes = flats[0].numel() * flats[0].element_size()
        devices = [to_device(f.device) for f in flats]
        key = (nbytes, tuple(str(d) for d in devices), workers)
        with _lock:
            known = _decisions.get(key)
        if known is not None:
            return known
        decision = choose_algorithm(nbytes, devices, workers=workers)
        with _lock:
            if len(_decisions) >= _MAX_DECISIONS:
                _decisions.clear()  # a bounded memo: sizes vary little in training, a lot only in sweeps
            _decisions[key] = decision
        log.info("allreduce: %s (%s)", *decision)
        return decision

    def schedule(self, flats: list[torch.Tensor], workers: bool = True) -> list[Phase]:
        """The chosen algorithm's schedule; ``workers``: whether device workers will run it (see ``allreduce``)."""
        name, _ = self.choose(flats, workers)
        return get_algorithm(name).schedule(flats)


register_algorithm(AutoAllreduce())

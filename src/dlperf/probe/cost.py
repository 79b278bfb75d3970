"""A cost model for a training step: how long it must take at least, and where that time goes (d2l 12.4, 12.7).

A step's compute (FLOPs over the peak), memory traffic (bytes over the bandwidth), dispatch (operators times the
per-operator cost) and communication (the gradient allreduce or a parameter-server push and pull) are priced on a
handful of hardware figures (:class:`Hardware`). Their sum is the floor when nothing overlaps, their maximum the
floor when everything does; how far a measured step lies above says what to fix (docs/design/measuring.md).

>>> hw = Hardware.from_seed("pcie-4gpu")
>>> round(allreduce_time("naive", 160e6, 4, hw) * 1e3)  # d2l 12.7.1: to one GPU and back
60
>>> round(allreduce_time("sharded", 160e6, 4, hw) * 1e3)  # split aggregation
15
>>> import torch
>>> from torch import nn
>>> counts = count_step(nn.Linear(512, 10), torch.randn(64, 512))
>>> counts.total_flops == 2 * (2 * 64 * 512 * 10)  # forward, and the weight gradient (the input needs none)
True
>>> sorted(step_floor(counts, hw, devices=4, allreduce="ring").components)  # data-parallel over 4 GPUs
['allreduce:ring', 'compute', 'dispatch', 'memory']
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from .._cliargs import short_repr as _short
from ..batch import Batch, call_model, map_tensors, tensors_of
from ..errors import UsageError
from ..losses import TimedLoss
from ..registry import Registry

__all__ = ["Link", "Hardware", "LINK_KINDS", "ALLREDUCE_FORMULAS", "AllreduceFormula", "PROJECT_ALGORITHMS",
           "allreduce_time", "rank_allreduce", "AllreduceChoice", "parameter_server_time", "StepCounts", "count_step",
           "StepFloor", "step_floor", "classify_op", "TrainingStep"]

LINK_KINDS = ("copy", "host", "device", "network")
"""``copy``: within host memory; ``host``: a device to host memory (PCIe); ``device``: device to device
(a PCIe switch or NVLink); ``network``: between machines."""


@dataclass(frozen=True)
class Link:
    """One kind of connection: a message of ``n`` bytes takes ``alpha_s + n / bandwidth`` seconds.

    The one link model: the cost model's links between devices, the measured links between processes
    (:mod:`dlperf.probe.links`), the GPU probe's copy rows and the allreduce choice all use it, and
    :meth:`fit` is how each of them turns measured times into one.

    >>> link = Link.fit([4096, 4 << 20], [20e-6 + 4096 / 9e9, 20e-6 + (4 << 20) / 9e9])
    >>> link.describe()
    '20 us + 9.00 GB/s'
    """

    alpha_s: float
    bandwidth: float  # bytes per second, one direction; inf: no measurable cost per byte

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / self.bandwidth

    def time(self, nbytes: float) -> float:
        return self.alpha_s + nbytes * self.beta

    def describe(self) -> str:
        return f"{self.alpha_s * 1e6:.0f} us + {self.bandwidth / 1e9:.2f} GB/s"

    @classmethod
    def fit(cls, sizes: Sequence[float], seconds: Sequence[float], *, min_alpha_s: float = 0.0) -> Link:
        """The least-squares line ``t = alpha + n / B`` through measured (bytes, seconds); through both
        points when there are two. A flat or falling line is noise on a link too fast to see at these
        sizes: all latency (the slowest time), no cost per byte. ``alpha`` is at least ``min_alpha_s``.
        """
        if len(sizes) != len(seconds) or len(set(sizes)) < 2:
            raise ValueError(f"a link fit needs times at two sizes or more, got sizes {list(sizes)}")
        k = len(sizes)
        mean_n, mean_t = sum(sizes) / k, sum(seconds) / k
        slope = (sum((n - mean_n) * (t - mean_t) for n, t in zip(sizes, seconds))
                 / sum((n - mean_n) ** 2 for n in sizes))
        if slope <= 0:
            return cls(max(max(seconds), min_alpha_s), math.inf)
        return cls(max(mean_t - slope * mean_n, min_alpha_s), 1.0 / slope)


@dataclass(frozen=True)
class Hardware:
    """The figures the cost model needs about one machine; every device of it is assumed alike.

    ``flops`` maps a dtype name (``"float32"``) to one device's peak FLOP/s; ``memory_bandwidth`` is one
    device's memory bandwidth in bytes/s; ``dispatch_s`` the fixed cost of issuing one operator;
    ``links`` maps each of :data:`LINK_KINDS` to a :class:`Link`.
    """

    name: str
    flops: Mapping[str, float]
    memory_bandwidth: float
    dispatch_s: float
    links: Mapping[str, Link]
    notes: str = ""

    def peak_flops(self, dtype: str | torch.dtype = "float32") -> float:
        key = str(dtype).removeprefix("torch.")
        if key not in self.flops:
            raise UsageError(f"hardware {self.name!r} has no FLOP/s figure for dtype {key!r}; "
                             f"it knows {', '.join(self.flops)}: use one of those or add the figure")
        return self.flops[key]

    def link(self, kind: str) -> Link:
        if kind not in self.links:
            raise UsageError(f"hardware {self.name!r} has no {kind!r} link; it knows {', '.join(self.links)}")
        return self.links[kind]

    @classmethod
    def from_seed(cls, preset: str = "pcie-4gpu") -> Hardware:
        """Hardware described in d2l 12.4 / 12.7, one of :data:`SEED_PRESETS`.

        * ``pcie-4gpu``: 12.7.1's 4-GPU server: every GPU and the CPU on a PCIe 3.0 x16 switch, 16 GB/s
          each, full bandwidth between any pair; 1 GB/s effective Ethernet.
        * ``v100-8gpu``: 12.7.2's P3.16xlarge / DGX: NVLink at 18 GB/s per link and direction, and a ring
          over 3 links' worth of it (the text's 3 x 18 GB/s); PCIe 16 GB/s to the host; 100 GbE, 10 GB/s.
        * ``cpu-4core``: 12.4.4's modest quad-core: 2 GHz, IPC 1, 256-bit AVX2 (8 float32 lanes);
          40 GB/s memory (the top of the 20-40 GB/s the text gives such a chip: a floor takes the best case).

        Latencies: PCIe 5 us (12.4.6), also used for NVLink, whose latency the text does not give;
        memory 100 ns per burst (12.4.2); network 250 us one-way (Table 12.4.1's datacenter round
        trip halved). Dispatch: 10 us, Table 12.4.2's kernel launch. The seed gives no
        GPU FLOP/s: V100's are its datasheet's (15.7 TFLOP/s float32, 125 float16 on Tensor Cores,
        900 GB/s HBM2), said so in ``notes``.
        """
        return _SEED_PRESETS.get(preset)()

    @classmethod
    def from_probe(cls, figures: Mapping) -> Hardware:
        """Hardware from measured figures, validated (a file may be hostile: a bad value names its key).

        Keys: ``name`` (str, optional); ``flops`` ({dtype name: FLOP/s}, at least one); ``memory_bandwidth``
        (bytes/s); ``dispatch_s`` (seconds per operator); ``links`` ({kind: {"alpha_s": s, "bandwidth":
        bytes/s}} for kinds among :data:`LINK_KINDS`; a missing kind falls back to ``copy``, and a missing
        ``copy`` to memory_bandwidth / 2 with 100 ns latency: a copy reads and writes every byte).
        Other keys are ignored, so a probe may record more than the model needs.
        """
        if not isinstance(figures, Mapping):
            raise UsageError(f"hardware figures must be a mapping, got {type(figures).__name__}; "
                             "give a dict such as {'flops': {'float32': 1e11}, 'memory_bandwidth': 2e10, ...}")
        name = figures.get("name", "probed")
        if not isinstance(name, str):
            raise UsageError(f"hardware 'name' must be a string, got {name!r}")
        raw_flops = figures.get("flops")
        if not isinstance(raw_flops, Mapping) or not raw_flops:
            raise UsageError(f"hardware 'flops' must map dtype names to FLOP/s, got {_short(raw_flops)}; "
                             "give e.g. {'float32': 1e11}")
        flops = {str(k).removeprefix("torch."): _positive(v, f"flops[{k!r}]") for k, v in raw_flops.items()}
        bandwidth = _positive(figures.get("memory_bandwidth"), "memory_bandwidth")
        dispatch = _positive(figures.get("dispatch_s"), "dispatch_s")
        raw_links = figures.get("links", {})
        if not isinstance(raw_links, Mapping):
            raise UsageError(f"hardware 'links' must map link kinds to {{alpha_s, bandwidth}}, got {_short(raw_links)}")
        links: dict[str, Link] = {}
        for kind, spec in raw_links.items():
            if kind not in LINK_KINDS:
                raise UsageError(f"unknown link kind {kind!r} in hardware 'links'; "
                                 f"valid choices: {', '.join(LINK_KINDS)}")
            if not isinstance(spec, Mapping):
                raise UsageError(f"hardware links[{kind!r}] must be {{'alpha_s': s, 'bandwidth': B/s}}, "
                                 f"got {_short(spec)}")
            links[kind] = Link(_positive(spec.get("alpha_s"), f"links[{kind!r}].alpha_s", zero_ok=True),
                               _positive(spec.get("bandwidth"), f"links[{kind!r}].bandwidth"))
        links.setdefault("copy", Link(1e-7, bandwidth / 2))
        for kind in LINK_KINDS:
            links.setdefault(kind, links["copy"])
        return cls(name, flops, bandwidth, dispatch, links, notes="measured")

    @classmethod
    def from_probe_result(cls, result, threads: int | None = None) -> Hardware:
        """Hardware from a ``dlperf probe`` run (:func:`dlperf.probe.run_probe` / ``load_probe``).

        FLOP/s per dtype are the torch.mm rows at ``threads`` (default: the most threads measured),
        memory bandwidth the best STREAM triad, dispatch the torch op row; the ``copy``, ``host`` and
        ``device`` links of logical CPU devices are a hand-off between cores plus a STREAM copy, and
        ``network`` is the loopback TCP round trip (halved) and 4 KB send rate: a floor for a link
        between processes of this host, not for a real network.
        """
        figs = {k: v for k, v in result.figures().items() if v is not None}
        flops: dict[str, float] = {}
        for key, value in figs.items():
            parts = key.split("_")
            if len(parts) == 3 and parts[0] == "mm" and parts[2].endswith("t"):
                t = int(parts[2][:-1])
                if threads is None or t == threads:
                    flops[parts[1]] = max(flops.get(parts[1], 0.0), value * 1e9)
        triads = [v for k, v in figs.items() if k.startswith("stream_triad_")]
        copies = [v for k, v in figs.items() if k.startswith("stream_copy_")]
        doc: dict = {"name": f"this machine ({result.machine.get('cpu', 'probed')})", "flops": flops,
                     "memory_bandwidth": max(triads) * 1e9 if triads else None,
                     "dispatch_s": figs["torch_dispatch"] * 1e-9 if "torch_dispatch" in figs else None,
                     "links": {}}
        handoff = figs.get("spin_handoff", figs.get("handoff"))
        if copies and handoff:
            copy = {"alpha_s": handoff * 1e-9, "bandwidth": max(copies) * 1e9}
            doc["links"].update(copy=copy, host=copy, device=copy)
        if "tcp_rtt" in figs and "tcp_send_4k" in figs:
            doc["links"]["network"] = {"alpha_s": figs["tcp_rtt"] * 0.5e-9,
                                       "bandwidth": 4096 / (figs["tcp_send_4k"] * 1e-9)}
        hw = cls.from_probe(doc)
        return dataclasses.replace(hw, notes="measured by dlperf probe" + (" (loopback network)" if
                                                                             "network" in doc["links"] else ""))

    def to_dict(self) -> dict:
        """The figures in :meth:`from_probe`'s format (a round trip gives equal figures)."""
        return {"name": self.name, "flops": dict(self.flops), "memory_bandwidth": self.memory_bandwidth,
                "dispatch_s": self.dispatch_s,
                "links": {k: {"alpha_s": v.alpha_s, "bandwidth": v.bandwidth} for k, v in self.links.items()}}


def _positive(value: object, key: str, *, zero_ok: bool = False) -> float:
    number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
        want = "a finite number >= 0" if zero_ok else "a finite number > 0"
        raise UsageError(f"hardware {key} is {_short(value)}; expected {want}: fix the figure or measure it again")
    return number


_GB = 1e9
_PCIE = Link(5e-6, 16 * _GB)


def _pcie_4gpu() -> Hardware:
    return Hardware("d2l 12.7.1 4-GPU PCIe server", {"float32": 15.7e12, "float16": 125e12}, 900 * _GB, 10e-6,
                    {"copy": Link(1e-7, 50 * _GB), "host": _PCIE, "device": _PCIE,
                     "network": Link(250e-6, 1 * _GB)},
                    notes="links from d2l 12.7.1; GPU FLOP/s and HBM bandwidth from the V100 datasheet")


def _v100_8gpu() -> Hardware:
    return Hardware("d2l 12.7.2 8-V100 NVLink server", {"float32": 15.7e12, "float16": 125e12}, 900 * _GB, 10e-6,
                    {"copy": Link(1e-7, 50 * _GB), "host": _PCIE, "device": Link(5e-6, 3 * 18 * _GB),
                     "network": Link(250e-6, 10 * _GB)},
                    notes="links from d2l 12.7.2; GPU FLOP/s and HBM bandwidth from the V100 datasheet")


def _cpu_4core() -> Hardware:
    flops32 = 4 * 2e9 * 8  # cores x clock x float32 lanes of a 256-bit vector, one instruction per clock
    copy_link = Link(1e-7, 20 * _GB)  # a copy reads and writes: half the 40 GB/s
    return Hardware("d2l 12.4.4 quad-core CPU", {"float32": flops32, "float64": flops32 / 2}, 40 * _GB, 10e-6,
                    {"copy": copy_link, "host": copy_link, "device": copy_link, "network": Link(250e-6, 1 * _GB)},
                    notes="d2l 12.4.2 / 12.4.4 figures")


_SEED_PRESETS: Registry[Callable[[], Hardware]] = Registry("seed hardware")
for _name, _preset in (("pcie-4gpu", _pcie_4gpu), ("v100-8gpu", _v100_8gpu), ("cpu-4core", _cpu_4core)):
    _SEED_PRESETS.register(_name, _preset)
SEED_PRESETS = tuple(_SEED_PRESETS)


# --- allreduce: Thakur, Rabenseifner & Gropp (2005), n bytes on each of k devices ----------------------------
# The reduction arithmetic (their gamma term) is left out: on every machine here it is far below the
# transfer, and d2l's worked example leaves it out too.

def _to_one_and_back(n: float, k: int, a: float, b: float) -> float:
    # the root's one link receives k-1 full copies, then sends k-1 back
    return 2 * (k - 1) * (a + n * b)


def _host(n: float, k: int, a: float, b: float) -> float:
    # all k devices send to the host and receive the sum over the host's one link
    return 2 * k * (a + n * b)


def _direct_rs_ag(n: float, k: int, a: float, b: float) -> float:
    # reduce-scatter then all-gather, every device exchanging its 1/k shard with all others at once;
    # each phase's k-1 messages are posted together, so one latency per phase, but they share the link
    return 2 * a + 2 * (k - 1) / k * n * b


def _ring(n: float, k: int, a: float, b: float) -> float:
    return 2 * (k - 1) * a + 2 * (k - 1) / k * n * b


def _recursive_doubling(n: float, k: int, a: float, b: float) -> float:
    return math.ceil(math.log2(k)) * (a + n * b)


def _rabenseifner(n: float, k: int, a: float, b: float) -> float:
    # recursive-halving reduce-scatter, recursive-doubling all-gather
    return 2 * math.ceil(math.log2(k)) * a + 2 * (k - 1) / k * n * b


def _binomial_tree(n: float, k: int, a: float, b: float) -> float:
    # binomial-tree reduce, then binomial-tree broadcast
    return 2 * math.ceil(math.log2(k)) * (a + n * b)


class AllreduceFormula(NamedTuple):
    """One algorithm's cost: ``time(n, k, alpha, beta)`` in seconds over the ``link`` kind, and ``text``."""

    time: Callable[[float, int, float, float], float]
    link: str
    text: str


ALLREDUCE_FORMULAS: Registry[AllreduceFormula] = Registry("allreduce algorithm")
"""Algorithm name -> its :class:`AllreduceFormula`. The first four are dlperf.parallel.allreduce's."""
for _name, _formula in (
    ("naive", AllreduceFormula(_to_one_and_back, "device",
                               "2(k-1)(a + n b): all to one device and back (its link serialises)")),
    ("cpu", AllreduceFormula(_host, "host", "2k(a + n b): every device to host memory and back over the host's link")),
    ("sharded", AllreduceFormula(_direct_rs_ag, "device", "2a + 2(k-1)/k n b: direct reduce-scatter + all-gather")),
    ("ring", AllreduceFormula(_ring, "device", "2(k-1)a + 2(k-1)/k n b: ring reduce-scatter + all-gather")),
    ("recursive-doubling", AllreduceFormula(_recursive_doubling, "device",
                                            "lg k (a + n b): pairwise exchange of the whole vector")),
    ("rabenseifner", AllreduceFormula(_rabenseifner, "device",
                                      "2 lg k a + 2(k-1)/k n b: recursive halving, then doubling")),
    ("tree", AllreduceFormula(_binomial_tree, "device", "2 lg k (a + n b): binomial-tree reduce, then broadcast")),
):
    ALLREDUCE_FORMULAS.register(_name, _formula)
PROJECT_ALGORITHMS = ("naive", "cpu", "sharded", "ring")


def allreduce_time(algorithm: str, nbytes: float, k: int, hardware: Hardware, link: str | None = None) -> float:
    """Seconds to allreduce ``nbytes`` on each of ``k`` devices with ``algorithm`` (0 for one device)."""
    formula, kind, _ = ALLREDUCE_FORMULAS.get(algorithm)
    if k < 1 or nbytes < 0:
        raise UsageError(f"need k >= 1 devices and nbytes >= 0, got k={k}, nbytes={nbytes}")
    if k == 1:
        return 0.0
    chosen = hardware.link(link or kind)
    return formula(nbytes, k, chosen.alpha_s, chosen.beta)


@dataclass(frozen=True)
class AllreduceChoice:
    algorithm: str
    seconds: float
    latency_s: float  # the alpha terms alone
    bandwidth_s: float  # the beta terms alone
    reason: str


def rank_allreduce(nbytes: float, k: int, hardware: Hardware,
                   algorithms: tuple[str, ...] = tuple(ALLREDUCE_FORMULAS)) -> list[AllreduceChoice]:
    """Algorithms fastest first, each with why: which term dominates and its formula."""
    out = []
    for name in algorithms:
        total = allreduce_time(name, nbytes, k, hardware)
        formula, kind, text = ALLREDUCE_FORMULAS.get(name)
        chosen = hardware.link(kind)
        latency = formula(0.0, k, chosen.alpha_s, chosen.beta) if k > 1 else 0.0
        bandwidth = total - latency
        bound = "latency" if latency > bandwidth else "bandwidth"
        reason = f"{text}; {bound}-bound on the {kind} link ({latency * 1e3:.3g} ms latency, " \
                 f"{bandwidth * 1e3:.3g} ms transfer)"
        out.append(AllreduceChoice(name, total, latency, bandwidth, reason))
    return sorted(out, key=lambda c: (c.seconds, c.algorithm))


def parameter_server_time(nbytes: float, workers: int, servers: int, hardware: Hardware,
                          link: str = "network") -> float:
    """Seconds for ``workers`` to push ``nbytes`` of gradients to ``servers`` shards and pull the result (12.7.3).

    Each server holds 1/S of the keys, so it receives ``workers`` messages of n/S bytes; each worker
    sends S messages that together are n bytes. The busier side sets the pace, once for the push and
    once for the pull: ``2 (max(m, S) a + max(m/S, 1) n b)``. With S = m the time no longer grows with m.
    """
    if workers < 1 or servers < 1:
        raise UsageError(f"need at least one worker and one server, got workers={workers}, servers={servers}")
    chosen = hardware.link(link)
    return 2 * (max(workers, servers) * chosen.alpha_s + max(workers / servers, 1.0) * nbytes * chosen.beta)


# --- counting a training step ------------------------------------------------------------------------------

_LAYOUT_OPS = frozenset({
    "copy_", "_to_copy", "to", "clone", "contiguous", "view", "_unsafe_view", "reshape", "_reshape_alias", "t",
    "transpose", "permute", "expand", "as_strided", "flatten", "unsqueeze", "squeeze", "select", "slice", "detach",
    "alias", "cat", "stack", "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones_like", "fill_",
    "zero_", "new_empty", "new_zeros", "new_empty_strided", "resize_", "set_", "lift_fresh", "split", "chunk",
    "unbind", "narrow", "numpy_T", "_copy_from", "_copy_from_and_resize", "mkldnn_reorder_conv2d_weight",
    "to_mkldnn", "repeat", "index_select", "unsafe_view", "reshape_alias", "accumulate_grad",
})
_MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "dot", "mv", "addmv", "einsum",
                         "_addmm_activation", "linear_backward", "mkldnn_linear"})
_LOSS_WORDS = ("nll_loss", "nllloss", "cross_entropy", "log_softmax", "mse_loss", "l1_loss", "smooth_l1",
               "binary_cross", "kl_div", "huber")
# softmax outside a loss is attention's (or a classifier head's), and counting it as loss misleads
_ATTENTION_WORDS = ("softmax", "attention", "scaled_dot_product")
GROUPS = ("conv", "matmul", "attention", "norm", "elementwise", "pooling", "loss", "optimizer", "layout", "python")
"""Operator groups, in report order; ``python`` is the time between operators (interpreter, dispatch)."""


def classify_op(name: str, phase: str = "") -> str:
    """The group of an ATen operator name (``aten::addmm`` or ``aten.addmm.default``) run in ``phase``."""
    if phase == "optimizer":
        return "optimizer"
    short = name.split("::", 1)[-1]
    if short.startswith("aten."):
        short = short.split(".")[1]
    if phase == "loss" or any(w in short for w in _LOSS_WORDS):
        return "loss"
    if any(w in short for w in _ATTENTION_WORDS):
        return "attention"
    if "conv" in short:
        return "conv"
    if "pool" in short:
        return "pooling"
    if "norm" in short and "_foreach" not in short:
        return "norm"
    if short in _MATMUL_OPS:
        return "matmul"
    if short in _LAYOUT_OPS:
        return "layout"
    return "elementwise"


@dataclass
class StepCounts:
    """What one training step does, per operator group: FLOPs, bytes read + written, operator calls."""

    flops: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, float] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)
    param_bytes: float = 0.0
    input_bytes: float = 0.0
    dtype: str = "float32"

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())


def _tensor_bytes(obj: object) -> float:
    if isinstance(obj, torch.Tensor):
        return float(obj.numel() * obj.element_size())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0.0


def _op_bytes(func, args, kwargs, out) -> float:
    """Bytes an operator reads and writes, ignoring caches; a view moves nothing."""
    returns = func._schema.returns
    if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return 0.0
    # an in-place or out= operator returns the tensor it wrote: counted once as read, once as written
    read = sum(_tensor_bytes(a) for a in args) + sum(_tensor_bytes(v) for v in kwargs.values())
    return read + _tensor_bytes(out)


class _Tally(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, counts: StepCounts):
        super().__init__()
        self.counts = counts
        self.phase = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        group = classify_op(str(func), self.phase)
        self.counts.ops[group] = self.counts.ops.get(group, 0) + 1
        self.counts.bytes[group] = self.counts.bytes.get(group, 0.0) + _op_bytes(func, args, kwargs, out)
        return out


class TrainingStep:
    """One SGD step of a model on a fixed batch, its loss by :class:`dlperf.losses.TimedLoss`: the model's own where it
    returns one, else ``loss`` (cross-entropy by default, only on class scores) against made-up targets.

    The targets are made once, from their own seeded generator, at the first call: the timed steps then
    draw no random numbers (and leave torch's global generator alone), so a counted step does exactly
    the work of a timed one. ``on_phase`` hears "forward", "loss", "backward", "optimizer", then "".
    """

    def __init__(self, model: nn.Module, x: Batch, *, lr: float = 1e-3, seed: int = 0, loss: Any = None,
                 on_phase: Callable[[str], object] = lambda phase: None):
        self.model, self.x, self.on_phase, self.seed, self.loss_option = model, x, on_phase, seed, loss
        self.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
        self.loss: TimedLoss | None = None

    def __call__(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        self.on_phase("forward")
        out = call_model(self.model, self.x)
        self.on_phase("loss")
        if self.loss is None:
            self.loss = TimedLoss(self.loss_option, out, generator=torch.Generator().manual_seed(self.seed))
        loss = self.loss(out)
        self.on_phase("backward")
        loss.backward()
        self.on_phase("optimizer")
        self.optimizer.step()
        self.on_phase("")
        return loss


def _count_on(model: nn.Module, x: Batch, loss: Any = None) -> StepCounts:
    from torch.utils.flop_counter import FlopCounterMode

    floating = [t for t in tensors_of(x) if t.is_floating_point()]
    counts = StepCounts(dtype=str(floating[0].dtype).removeprefix("torch.") if floating else "float32")
    counts.param_bytes = float(sum(p.numel() * p.element_size() for p in model.parameters()))
    counts.input_bytes = float(sum(t.numel() * t.element_size() for t in tensors_of(x)))
    tally = _Tally(counts)
    flop_phases: dict[str, dict] = {}
    counter = FlopCounterMode(display=False)

    def on_phase(phase: str) -> None:
        # FlopCounterMode only totals per operator, so it is read at each phase boundary to split by phase
        flop_phases[tally.phase] = {op: n - flop_phases.get("_seen", {}).get(op, 0)
                                    for op, n in counter.get_flop_counts().get("Global", {}).items()}
        flop_phases["_seen"] = dict(counter.get_flop_counts().get("Global", {}))
        tally.phase = phase

    with counter, tally:
        TrainingStep(model, x, lr=0.0, loss=loss, on_phase=on_phase)()
    for phase, per_op in flop_phases.items():
        if phase == "_seen":
            continue
        for op, n in per_op.items():
            if n:
                group = classify_op(str(op), phase)
                counts.flops[group] = counts.flops.get(group, 0.0) + float(n)
    return counts


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device; no weight is copied."""
    memo: dict[int, object] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo).to("meta")


def count_step(model: nn.Module, example_input: Batch, *, on_meta: bool = True, loss: Any = None) -> StepCounts:
    """FLOPs, bytes and operator calls of one training step of ``model`` on ``example_input``.

    With ``on_meta`` a copy of the model runs on the meta device (shapes only, no arithmetic, no
    memory); a model the meta device cannot run (data-dependent shapes, a custom kernel) is counted on
    a copy running for real. ``model`` itself is never changed.
    """
    if on_meta:
        try:
            return _count_on(_meta_copy(model), map_tensors(lambda t: t.to("meta"), example_input), loss)
        except UsageError:
            raise
        except Exception:  # noqa: BLE001 (the meta device is an optimisation: fall back to a real step)
            pass
    return _count_on(copy.deepcopy(model), map_tensors(torch.Tensor.clone, example_input), loss)


@dataclass(frozen=True)
class StepFloor:
    """The least time a training step can take, by component, on the given hardware."""

    components: dict[str, float]
    hardware: str
    devices: int
    measured_s: float | None = None

    @property
    def no_overlap_s(self) -> float:
        return sum(self.components.values())

    @property
    def overlap_s(self) -> float:
        return max(self.components.values(), default=0.0)

    @property
    def bottleneck(self) -> str:
        return max(self.components, key=self.components.__getitem__) if self.components else ""

    def to_dict(self) -> dict:
        return {"hardware": self.hardware, "devices": self.devices, "components_s": dict(self.components),
                "no_overlap_s": self.no_overlap_s, "overlap_s": self.overlap_s, "bottleneck": self.bottleneck,
                "measured_s": self.measured_s}

    def __str__(self) -> str:
        lines = [f"step floor on {self.hardware}, {self.devices} device(s)", f"  {'component':<20}{'ms':>10}"]
        lines += [f"  {name:<20}{sec * 1e3:>10.3f}" for name, sec in self.components.items()]
        lines.append(f"  {'no overlap':<20}{self.no_overlap_s * 1e3:>10.3f}   (sum)")
        lines.append(f"  {'full overlap':<20}{self.overlap_s * 1e3:>10.3f}   (max: {self.bottleneck})")
        if self.measured_s is not None:
            lines.append(f"  {'measured':<20}{self.measured_s * 1e3:>10.3f}   "
                         f"({self.measured_s / self.no_overlap_s:.1f}x the no-overlap floor)"
                         if self.no_overlap_s > 0 else f"  {'measured':<20}{self.measured_s * 1e3:>10.3f}")
        return "\n".join(lines)


def step_floor(counts: StepCounts, hardware: Hardware, *, devices: int = 1, allreduce: str | None = "sharded",
               servers: int | None = None, input_from_host: bool = False,
               measured_s: float | None = None) -> StepFloor:
    """The floor of a data-parallel step whose whole-batch counts are ``counts``, split over ``devices``.

    Each device does 1/k of the work; the gradients (as many bytes as the parameters) are then summed
    with ``allreduce`` over the device links, or, with ``servers``, pushed to and pulled from that many
    parameter servers over the network (one worker per device). With ``input_from_host`` the batch
    first crosses the host link (a GPU's PCIe): all k slices leave through the host's one link.
    """
    if devices < 1:
        raise UsageError(f"need devices >= 1, got {devices}")
    components = {
        "compute": counts.total_flops / devices / hardware.peak_flops(counts.dtype),
        "memory": counts.total_bytes / devices / hardware.memory_bandwidth,
        "dispatch": counts.total_ops * hardware.dispatch_s,
    }
    if input_from_host:
        host = hardware.link("host")
        components["input copy"] = devices * host.alpha_s + counts.input_bytes * host.beta
    if servers is not None:
        components["push/pull"] = parameter_server_time(counts.param_bytes, devices, servers, hardware)
    elif allreduce is not None and devices > 1:
        components[f"allreduce:{allreduce}"] = allreduce_time(allreduce, counts.param_bytes, devices, hardware)
    return StepFloor(components, hardware.name, devices, measured_s)

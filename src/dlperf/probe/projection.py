"""How a data-parallel step would scale across hosts: each gradient strategy priced on a cluster's links (d2l 12.7).

A :class:`Cluster` is ``hosts`` machines of ``devices_per_host`` devices, each device on an ``intra`` link and
each host on one ``network`` link; a message costs ``alpha + n / bandwidth`` (:class:`~dlperf.probe.cost.Link`),
and the busiest link sets a collective's pace. Each strategy (``naive``, ``ring``, ``sharded``, ``ps-1``,
``ps-2``, ``hierarchical``) is priced phase by phase; computation and communication do not overlap. The
formulas, and how they are checked on emulated hosts: docs/design/cluster-model.md. They reproduce d2l's worked
example:

>>> from dlperf.probe.cost import Link
>>> pcie = Link(0.0, 16e9)
>>> one = Cluster(hosts=1, devices_per_host=4, network=pcie, intra=pcie)
>>> [round(communication_time(s, 160e6, one) * 1e3) for s in ("naive", "ps-1", "sharded")]
[60, 80, 15]
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import UsageError
from ..registry import Registry
from .cost import Link

__all__ = ["Cluster", "Layout", "HostGroup", "HostGroups", "HostCPU", "STRATEGIES", "alpha_beta_fit", "cpu_time",
           "communication_time", "layout_time", "ring_time", "sharded_time", "naive_time", "push_pull_time",
           "hierarchical_time", "link_from_allreduce", "link_from_strategy", "straggler", "ScaleRow", "Projection",
           "project"]


@dataclass(frozen=True)
class HostCPU:
    """A host's processors as an exchange meets them: ``cores`` for its ranks (a fraction where emulated hosts
    share one machine) and the seconds one rank spends on each byte it reduces (measured while every rank
    works, so the load is in it).

    Ranks with a core each reduce side by side, and a link fit measured that way already holds their
    arithmetic; ranks that outnumber the cores take turns, so a host's reductions then last its ranks' sum
    over its cores: :func:`cpu_time` charges that excess.
    """

    cores: float
    reduce_s_per_byte: float

    def __post_init__(self) -> None:
        for name in ("cores", "reduce_s_per_byte"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                    value < 0 or (name == "cores" and value <= 0):
                raise UsageError(f"{name}={value!r}: expected a finite number {'> 0' if name == 'cores' else '>= 0'}")

    def describe(self) -> str:
        return f"{self.cores:g} cores, {self.reduce_s_per_byte * 1e12:.0f} ps/B reduced"


@dataclass(frozen=True)
class Cluster:
    """``hosts`` machines of ``devices_per_host`` devices; each host on a ``network`` link, each device on ``intra``."""

    hosts: int
    devices_per_host: int
    network: Link
    intra: Link
    cpu: HostCPU | None = None
    """Each host's processors (:func:`cpu_time`); None: the exchanges cost links only, as in d2l's example."""

    def __post_init__(self) -> None:
        for name in ("hosts", "devices_per_host"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name}={value!r}: expected a whole number >= 1")

    def layout(self) -> Layout:
        """Every device's host, in rank order (a host's devices together)."""
        return Layout(tuple(h for h in range(self.hosts) for _ in range(self.devices_per_host)))

    def host_groups(self, servers: int = 0) -> HostGroups:
        """:meth:`Layout.host_groups` of :meth:`layout` with ``servers`` parameter servers on hosts ``s mod
        hosts``, made without listing the ranks: the cost of a projection does not grow with the devices."""
        on_host = Counter(s % self.hosts for s in range(servers))
        kinds = Counter((self.devices_per_host, k, h == 0) for h, k in on_host.items())
        if 0 not in on_host:
            kinds[(self.devices_per_host, 0, True)] += 1
        kinds[(self.devices_per_host, 0, False)] += self.hosts - len(on_host | Counter({0: 1}))
        return HostGroups.of(kinds)


@dataclass(frozen=True)
class HostGroup:
    """``count`` hosts alike: each holds ``ranks`` ranks and ``servers`` parameter servers (``first``: the host
    of rank 0, always a group of its own)."""

    ranks: int
    servers: int
    count: int
    first: bool


@dataclass(frozen=True)
class HostGroups:
    """What the formulas need to know of a layout: its hosts, grouped by what each holds. Every formula runs over
    these groups, so its cost grows with the kinds of host, not with the hosts or ranks (a cluster of 1,024
    uniform hosts is two or three groups)."""

    groups: tuple[HostGroup, ...]

    @classmethod
    def of(cls, kinds: Counter) -> HostGroups:
        """From a Counter of (ranks, servers, first) -> hosts like that (zero counts dropped)."""
        return cls(tuple(HostGroup(r, k, c, f) for (r, k, f), c in sorted(kinds.items()) if c > 0))

    @property
    def world(self) -> int:
        return sum(g.ranks * g.count for g in self.groups)

    @property
    def servers(self) -> int:
        return sum(g.servers * g.count for g in self.groups)

    @property
    def hosts(self) -> int:
        """Hosts holding ranks."""
        return sum(g.count for g in self.groups if g.ranks)

    @property
    def most_ranks(self) -> int:
        return max((g.ranks for g in self.groups), default=0)

    @property
    def first_ranks(self) -> int:
        """Ranks on rank 0's host."""
        return next((g.ranks for g in self.groups if g.first), 0)


@dataclass(frozen=True)
class Layout:
    """Where the ranks are: ``hosts[r]`` is rank r's host; ``servers`` the host of each parameter server."""

    hosts: tuple[int, ...]
    servers: tuple[int, ...] = field(default=())

    @property
    def world(self) -> int:
        return len(self.hosts)

    def per_host(self) -> Counter:
        return Counter(self.hosts)

    def host_groups(self) -> HostGroups:
        """The hosts grouped by how many ranks and servers each holds (rank 0's host on its own)."""
        ranks, servers = Counter(self.hosts), Counter(self.servers)
        first = self.hosts[0] if self.hosts else None
        return HostGroups.of(Counter((ranks[h], servers[h], h == first) for h in ranks.keys() | servers.keys()))


def _groups(layout: Layout | HostGroups) -> HostGroups:
    return layout if isinstance(layout, HostGroups) else layout.host_groups()


def _ring(n: float, k: int, link: Link) -> float:
    return 0.0 if k < 2 else 2 * (k - 1) * link.alpha_s + 2 * (k - 1) / k * n * link.beta


def ring_time(n: float, layout: Layout | HostGroups, network: Link, intra: Link) -> float:
    """One ring through every rank: 2(p-1) steps of n/p bytes, each step as slow as its slowest hop."""
    shape = _groups(layout)
    slow = network if shape.hosts > 1 else intra
    return _ring(n, shape.world, slow)


def sharded_time(n: float, layout: Layout | HostGroups, network: Link, intra: Link) -> float:
    """Direct reduce-scatter + all-gather: two phases; each rank's link carries (p-1)/p n, a NIC its host's share."""
    shape = _groups(layout)
    p = shape.world
    if p < 2:
        return 0.0
    device = 2 * intra.alpha_s + 2 * (p - 1) / p * n * intra.beta
    if shape.hosts == 1:
        return device
    nic = max(g.ranks * (p - g.ranks) / p for g in shape.groups if g.ranks)
    return max(device, 2 * network.alpha_s + 2 * nic * n * network.beta)


def naive_time(n: float, layout: Layout | HostGroups, network: Link, intra: Link) -> float:
    """All to rank 0 and back: rank 0's link takes p-1 copies each way, host 0's NIC those of the other hosts."""
    shape = _groups(layout)
    p = shape.world
    remote = p - shape.first_ranks
    return 2 * max((p - 1) * intra.time(n), remote * network.time(n) if remote else 0.0)


def push_pull_time(n: float, layout: Layout | HostGroups, network: Link, intra: Link) -> float:
    """Every rank pushes n/S to each of the S servers (``layout.servers``) and pulls as much back.

    Per phase, the busiest link sets the pace: a host's memory link takes a message from each of its own
    ranks to each of its servers (the NIC does not see them), a NIC what its host sends to, or receives
    from, servers elsewhere.
    """
    shape = _groups(layout)
    s = shape.servers
    if not s:
        raise UsageError("a push/pull needs at least one server in the layout")
    part, p = n / s, shape.world
    phase = 0.0
    for g in shape.groups:
        # this host's memory link takes a message from each of its own ranks to each of its servers
        local = g.ranks * g.servers
        out_msgs = g.ranks * (s - g.servers)  # this host's ranks to servers elsewhere
        in_msgs = g.servers * (p - g.ranks)  # other hosts' ranks to servers here
        remote = max(out_msgs, in_msgs)
        phase = max(phase, local * intra.time(part) if local else 0.0,
                    remote * network.time(part) if remote else 0.0)
    return 2 * phase


def hierarchical_time(n: float, layout: Layout | HostGroups, network: Link, intra: Link) -> float:
    """Allreduce inside each host, a ring of one leader per host across them, the leader's result copied back."""
    shape = _groups(layout)
    g = shape.most_ranks
    inside = sharded_time(n, HostGroups((HostGroup(g, 0, 1, True),)), network, intra) if g > 1 else 0.0
    if shape.hosts == 1:
        return inside
    return inside + _ring(n, shape.hosts, network) + (intra.time(n) if g > 1 else 0.0)


def _host_work(strategy: str, n: float, group: HostGroup, shape: HostGroups) -> tuple[int, float, float]:
    """One host of ``group`` during ``strategy``: how many ranks and servers add into a sum there, the bytes
    they add together, and the most one of them adds."""
    p, r = shape.world, group.ranks
    if strategy in ("ring", "sharded"):
        each = (p - 1) / p * n
        return r, r * each, each if r else 0.0
    if strategy == "naive":
        first = (p - 1) * n if group.first else 0.0
        return r, first, first
    if strategy == "hierarchical":
        own = (r - 1) / r * n if r else 0.0
        leader = own + (shape.hosts - 1) / shape.hosts * n
        return r, (r - 1) * own + leader if r else 0.0, leader if r else 0.0
    server = p * n / max(1, shape.servers) if group.servers else 0.0
    return r + group.servers, group.servers * server, server


def cpu_time(strategy: str, n: float, layout: Layout | HostGroups, cpu: HostCPU) -> float:
    """Seconds a host's reductions add when its ranks outnumber its cores (0 when every rank has a core).

    Side by side, the busiest rank's reductions would last ``bytes x reduce_s_per_byte``; taking turns on
    ``cores`` cores, a host's last as long as all of its ranks' together over the cores. The difference
    for the busiest host is charged.
    """
    shape = _groups(layout)
    extra = 0.0
    for group in shape.groups:
        workers, total, largest = _host_work(strategy, n, group, shape)
        if workers > cpu.cores:
            extra = max(extra, (total / cpu.cores - largest) * cpu.reduce_s_per_byte)
    return extra


LayoutFormula = Callable[[float, Layout | HostGroups, Link, Link], float]
STRATEGIES: Registry[tuple[LayoutFormula, int]] = Registry("gradient strategy")
"""Strategy name -> (its time formula over a layout, the number of parameter servers it places; 0: none)."""
for _name, _entry in (("ring", (ring_time, 0)), ("sharded", (sharded_time, 0)), ("ps-1", (push_pull_time, 1)),
                      ("ps-2", (push_pull_time, 2)), ("hierarchical", (hierarchical_time, 0)),
                      ("naive", (naive_time, 0))):
    STRATEGIES.register(_name, _entry)


def layout_time(strategy: str, n: float, layout: Layout | HostGroups, network: Link, intra: Link,
                cpu: HostCPU | None = None) -> float:
    """Seconds for ``strategy`` to sum ``n`` bytes of gradients on ``layout`` (its servers already placed); with
    ``cpu``, plus what ranks that outnumber their host's cores add (:func:`cpu_time`)."""
    formula, _ = STRATEGIES.get(strategy)
    shape = _groups(layout)
    if shape.world < 2 and strategy not in ("ps-1", "ps-2"):
        return 0.0
    extra = cpu_time(strategy, n, shape, cpu) if cpu is not None else 0.0
    return formula(n, shape, network, intra) + extra


def communication_time(strategy: str, n: float, cluster: Cluster) -> float:
    """Seconds for ``strategy`` to sum ``n`` bytes of gradients over every device of ``cluster``."""
    _, servers = STRATEGIES.get(strategy)
    return layout_time(strategy, n, cluster.host_groups(servers), cluster.network, cluster.intra, cluster.cpu)


def link_from_allreduce(fit: Link, world: int) -> Link:
    """The per-message link behind a measured ring allreduce among ``world`` ranks, ``t(n) = fit.time(n)``.

    A ring takes ``2(k-1) alpha + 2(k-1)/k n beta``, so alpha is the intercept over 2(k-1) and beta the
    slope times k / 2(k-1). For two ranks: half the intercept, the slope as is.

    >>> link_from_allreduce(Link(100e-6, 1e9), 2)
    Link(alpha_s=5e-05, bandwidth=1000000000.0)
    """
    if world < 2:
        raise UsageError(f"world={world}: an allreduce fit needs at least 2 ranks")
    return Link(fit.alpha_s / (2 * (world - 1)), fit.bandwidth * 2 * (world - 1) / world)


def alpha_beta_fit(sizes: Sequence[float], seconds: Sequence[float], around: float | None = None) -> Link:
    """``t = alpha + n / B`` with the bandwidth from the larger half of the sizes and the latency from the rest.

    A least-squares line through every size lets the large messages (whose times are large) decide the
    intercept too, and on a busy machine it lands far from what a small message costs. Here the slope
    comes from the larger half, and alpha is the median of what the others took beyond their bytes. A
    message cannot cost more than a larger one on the same link: one that did waited on something else
    (a delayed acknowledgement, a neighbour on the cores), so each time is first capped at the larger
    sizes' least.

    >>> alpha_beta_fit([4e3, 32e3, 512e3, 4e6], [60e-6 + n / 1e9 for n in (4e3, 32e3, 512e3, 4e6)]).describe()
    '60 us + 1.00 GB/s'
    >>> alpha_beta_fit([4e3, 32e3, 512e3, 4e6], [40e-3, 60e-6 + 32e3 / 1e9, 60e-6 + 512e3 / 1e9,
    ...                                          60e-6 + 4e6 / 1e9]).describe()  # 4 KB waited 40 ms on an ack
    '60 us + 1.00 GB/s'

    ``around``: the link as messages of about that many bytes see it: the latency of the smallest messages,
    and the bandwidth that gives the time read off the measured curve between the two sizes on either side
    of ``around`` (the nearest two at an end). A transport that copies through the CPU moves a
    message that stays in the caches faster per byte than one that does not, so one line through every
    size overstates what a small message costs and understates a large one; NCCL prices each message-size
    band with a link of its own for the same reason.

    >>> cached = [60e-6 + n / (4e9 if n <= 1e6 else 1e9) for n in (4e3, 32e3, 512e3, 4e6, 16e6)]
    >>> alpha_beta_fit([4e3, 32e3, 512e3, 4e6, 16e6], cached, around=256e3).describe()
    '60 us + 4.00 GB/s'
    """
    pairs = sorted(zip(sizes, seconds, strict=True))
    if len({n for n, _ in pairs}) < 2:
        raise ValueError(f"a link fit needs times at two sizes or more, got sizes {list(sizes)}")
    capped = [(n, min(t for _, t in pairs[i:])) for i, (n, _) in enumerate(pairs)]
    half = len(capped) // 2
    large = capped[half - 1:] if len(capped) - half < 2 else capped[half:]
    slope_link = Link.fit([n for n, _ in large], [t for _, t in large], min_alpha_s=1e-7)
    if math.isinf(slope_link.bandwidth):
        whole = Link.fit([n for n, _ in capped], [t for _, t in capped], min_alpha_s=1e-7)
    else:
        rest = capped[:-1]
        whole = Link(max(statistics.median(t - n / slope_link.bandwidth for n, t in rest), 1e-7),
                     slope_link.bandwidth)
    if around is not None:
        curve = [min((p for p in capped if p[0] == n), key=lambda p: p[1]) for n in sorted({n for n, _ in capped})]

        def between(i: int, n: float) -> float:  # the time at n on the line through curve[i - 1] and curve[i]
            (n0, t0), (n1, t1) = curve[i - 1], curve[i]
            return t0 + (n - n0) * (t1 - t0) / (n1 - n0)

        # the latency: the smallest message's time less its bytes at the rate the next size adds
        latency = max(min(between(1, 0.0), curve[0][1]), 1e-7)
        took = between(max(next((i for i, (n, _) in enumerate(curve) if n >= around), len(curve) - 1), 1), around)
        if took > latency:
            return Link(latency, around / (took - latency))
    return whole


def link_from_strategy(strategy: str, fit: Link, layout: Layout) -> Link:
    """The per-message link behind ``strategy`` measured on ``layout`` as ``t(n) = fit.time(n)``, every message on it.

    Each formula is ``A alpha + B n beta`` in the link's two figures, so alpha is the fit's intercept over
    A and beta its slope over B: :func:`link_from_allreduce` for any strategy (a parameter server's
    pushes and pulls, for instance, whose transport is not the collectives').

    >>> link_from_strategy("ring", Link(100e-6, 1e9), Layout((0, 1)))
    Link(alpha_s=5e-05, bandwidth=1000000000.0)
    """
    latency = Link(1.0, math.inf)
    per_byte = Link(0.0, 1.0)
    a = layout_time(strategy, 0.0, layout, latency, latency)
    b = layout_time(strategy, 1.0, layout, per_byte, per_byte)
    if a <= 0 or b <= 0:
        raise UsageError(f"{strategy} on {layout.world} rank(s) sends no message; measure it on more ranks")
    return Link(fit.alpha_s / a, fit.bandwidth * b)


def straggler(pair_seconds: dict[tuple[int, int], float], factor: float = 2.0) -> int | None:
    """The host whose link is slow, from the time of one exchange between every pair of hosts; None if none is.

    A host is at best as fast as its own link, so its fastest pair bounds that link: the straggler is the
    host whose fastest pair took more than ``factor`` times the median of the other hosts' fastest pairs.

    >>> straggler({(0, 1): 0.01, (0, 2): 0.1, (1, 2): 0.1})
    2
    >>> straggler({(0, 1): 0.01, (0, 2): 0.012, (1, 2): 0.011}) is None
    True
    """
    hosts = sorted({h for pair in pair_seconds for h in pair})
    if len(hosts) < 3:
        return None  # two hosts share their one link: the slow side cannot be told apart
    best = {h: min(t for pair, t in pair_seconds.items() if h in pair) for h in hosts}
    slowest = max(hosts, key=best.__getitem__)
    others = statistics.median(best[h] for h in hosts if h != slowest)
    return slowest if best[slowest] > factor * others else None


@dataclass(frozen=True)
class ScaleRow:
    """One host count: each strategy's communication seconds, and the step they give."""

    hosts: int
    devices: int
    communication_s: dict[str, float]
    compute_s: float

    def step_s(self, strategy: str) -> float:
        return self.compute_s + self.communication_s[strategy]

    def share(self, strategy: str) -> float:
        step = self.step_s(strategy)
        return self.communication_s[strategy] / step if step > 0 else 0.0

    @property
    def best(self) -> str:
        return min(self.communication_s, key=lambda s: (self.communication_s[s], list(self.communication_s).index(s)))


@dataclass(frozen=True)
class Projection:
    """Rows for 1..N hosts; efficiency is throughput per host over one host's best; the knee where it breaks."""

    rows: list[ScaleRow]
    gradient_bytes: float
    strategies: tuple[str, ...]

    def efficiency(self, row: ScaleRow, strategy: str) -> float:
        first = self.rows[0]
        step = row.step_s(strategy)
        if step <= 0:
            return 1.0
        return (row.hosts / step) / (first.hosts / first.step_s(first.best)) / row.hosts

    @property
    def knee(self) -> int | None:
        """The first host count whose added host brings less than half a host's throughput (best strategy)."""
        if not self.rows or self.rows[0].step_s(self.rows[0].best) <= 0:
            return None
        one = 1 / self.rows[0].step_s(self.rows[0].best)
        for prev, row in zip(self.rows, self.rows[1:]):
            gained = row.hosts / row.step_s(row.best) - prev.hosts / prev.step_s(prev.best)
            if gained < 0.5 * one * (row.hosts - prev.hosts):
                return row.hosts
        return None

    def to_dict(self) -> dict:
        return {"gradient_bytes": self.gradient_bytes, "knee_hosts": self.knee,
                "rows": [{"hosts": r.hosts, "devices": r.devices, "compute_s": r.compute_s, "best": r.best,
                          "strategies": {s: {"step_s": r.step_s(s), "communication_s": r.communication_s[s],
                                             "communication_share": r.share(s),
                                             "efficiency": self.efficiency(r, s)} for s in self.strategies}}
                         for r in self.rows]}


def project(gradient_bytes: float, compute_s: float, cluster: Cluster,
            strategies: Sequence[str] = tuple(STRATEGIES)) -> Projection:
    """Each strategy's step (``compute_s`` per device, then the gradient sum) on 1..``cluster.hosts`` hosts.

    The batch per device stays fixed as hosts are added (weak scaling, as d2l 12.7 scales out).
    """
    if not math.isfinite(gradient_bytes) or gradient_bytes < 0:
        raise UsageError(f"gradient_bytes={gradient_bytes!r}: expected a finite number >= 0")
    if not math.isfinite(compute_s) or compute_s < 0:
        raise UsageError(f"compute_s={compute_s!r}: expected a finite number of seconds >= 0")
    for s in strategies:
        STRATEGIES.get(s)
    rows = []
    for hosts in range(1, cluster.hosts + 1):
        sub = Cluster(hosts, cluster.devices_per_host, cluster.network, cluster.intra, cluster.cpu)
        rows.append(ScaleRow(hosts, hosts * cluster.devices_per_host,
                             {s: communication_time(s, gradient_bytes, sub) for s in strategies}, compute_s))
    return Projection(rows, gradient_bytes, tuple(strategies))

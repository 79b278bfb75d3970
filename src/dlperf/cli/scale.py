"""``dlperf scale``: how a model's data-parallel step would scale on N hosts of G devices, strategy by strategy.

    dlperf scale --model resnet18 --hosts 8 --devices-per-host 2 --link 10gbit
    dlperf scale --gradients 160MB --hosts 1 --devices-per-host 4 --intra-link 16GB/s   # d2l 12.7.1

Each figure says where it came from: measured now, read from saved measurements, given on the command
line, or assumed (a default, named). The formulas are :mod:`dlperf.probe.projection`'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

NETWORK_LATENCY_S = 250e-6  # d2l Table 12.4.1: a round trip within a datacenter, 500 us, halved
INTRA_LATENCY_S = 5e-6  # d2l 12.4.6: PCIe latency
PCIE_BYTES_PER_S = 16e9  # d2l 12.7.1: PCIe 3.0 x16, each GPU and the CPU to the switch
MAX_HOSTS = 1024
MAX_DEVICES = 64


@dataclass
class Figure:
    """A value the projection uses, and where it came from (shown beside it)."""

    value: Any  # a Link, or seconds
    source: str


def _link_arg(name: str):
    def parse(text: str):
        from ..errors import UsageError
        from ..probe.links import parse_link

        try:
            return parse_link(text)
        except UsageError as exc:
            raise argparse.ArgumentTypeError(f"{exc} (RATE[,LATENCY] for {name})") from None

    parse.__name__ = "link"
    return parse


def _size_arg(text: str) -> float:
    from ..errors import UsageError
    from ..probe.links import parse_rate

    try:
        size = parse_rate(text.strip() + ("" if text.strip()[-1:].isalpha() else "B"))
    except (UsageError, IndexError):
        raise argparse.ArgumentTypeError(f"{text[:60]!r} is not a size; give --gradients bytes with a unit, "
                                         "e.g. 160MB or 44.7MB") from None
    return size


def _model_arg(text: str) -> str:
    from .profile import target

    text = text.strip()
    if ":" in text:
        return target(text)
    from ..models import model_names

    names = model_names()
    if text.lower() not in names:
        raise argparse.ArgumentTypeError(f"unknown network {text[:60]!r}; give a zoo name ({', '.join(names)}) or "
                                         "MODULE:FACTORY")
    return text.lower()


def register(sub) -> argparse.ArgumentParser:
    from ..probe.projection import STRATEGIES
    from . import options as va
    from .profile import input_value

    p = sub.add_parser("scale", help="project a model's data-parallel step on N hosts: each gradient strategy's "
                                     "time, communication share, efficiency, the knee",
                       description=__doc__.splitlines()[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", type=_model_arg, metavar="NAME|MODULE:FACTORY",
                      help="a zoo network (lenet, resnet18, ...) or a factory that builds a torch.nn.Module")
    what.add_argument("--gradients", type=_size_arg, metavar="SIZE",
                      help="gradient bytes per step instead of a model (e.g. 160MB); compute from --step-ms")
    p.add_argument("--input", action="append", type=input_value, metavar="SPEC|MODULE:FUNCTION",
                   help="one device's input batch for a MODULE:FACTORY model, as profile takes it: a batch-first "
                        "tensor spec with optional dtype and range (64x3x32x32, 64x32:int64:0-1000; repeat for "
                        "several arguments) or a function returning the batch")
    p.add_argument("--loss", default=None, type=va.loss_value, help=va.LOSS_HELP + " (for a measured step)")
    p.add_argument("--batch-size", type=va.int_in(1, 1 << 20, "--batch-size"),
                   help="batch per device for a zoo network (default: its CPU batch of Shi et al.)")
    p.add_argument("--hosts", required=True, type=va.int_in(1, MAX_HOSTS, "--hosts"), help="project 1..N hosts")
    p.add_argument("--devices-per-host", type=va.int_in(1, MAX_DEVICES, "--devices-per-host"), default=1,
                   help="devices (and data-parallel ranks) per host (default 1)")
    p.add_argument("--link", type=_link_arg("--link"), metavar="RATE[,LATENCY]",
                   help="each host's network link, e.g. 10gbit or 25gbit,20us (default: the gloo link dlperf "
                        "measured between hosts, if saved; latency default 250us)")
    p.add_argument("--intra-link", type=_link_arg("--intra-link"), metavar="RATE[,LATENCY]",
                   help="each device's link to its host's other devices and memory, e.g. 16GB/s (default: the "
                        "saved dlperf probe copy rate, else PCIe 3.0 x16; latency default 5us)")
    p.add_argument("--cores-per-host", type=va.positive_float("--cores-per-host", max_value=1e5, min_value=1),
                   help="cores of each host (at least 1): where its devices (ranks) outnumber them, they take turns "
                        "for their reductions, charged at the saved dlperf probe's memory rate (default: not charged)")
    p.add_argument("--step-ms", type=va.positive_float("--step-ms", max_value=1e7),
                   help="one device's compute per step, assumed, instead of measuring it")
    p.add_argument("--compute", choices=["measure", "probe"], default="measure",
                   help="measure: time a few training steps now (default); probe: the floor from the saved "
                        "dlperf probe figures")
    p.add_argument("--strategies", type=va.csv_list("--strategies", list(STRATEGIES), "gradient strategy"),
                   help=f"a subset of {', '.join(STRATEGIES)} (default: all)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   type=va.output_path("--json", allow_stdout=True, in_place=True),
                   help="also print one JSON document as the last stdout line (or write it to FILE)")
    p.set_defaults(func=run)
    return p


def _model_and_batch(args: argparse.Namespace):
    import torch

    from ..errors import UsageError

    if ":" in args.model:
        if args.input is None:
            raise UsageError(f"--model {args.model} needs --input, the shape of one device's batch, e.g. 64x3x32x32")
        if args.batch_size is not None:
            raise UsageError("--batch-size is for zoo networks; a MODULE:FACTORY model takes its batch from --input")
        from .._cliargs import require_memory
        from ..probe.targets import build_model
        from ..probe.user_inputs import batch_maker, input_bytes
        from .profile import input_source

        source = input_source(args.input, "scale")
        if not isinstance(source, str):  # as profile predicts it: the inputs, copies of them, a doubled batch
            require_memory(4 * input_bytes(source), "--input " + " --input ".join(s.text() for s in source),
                           "give a smaller --input")
        torch.manual_seed(0)
        model = build_model(args.model)
        return model, batch_maker(source)(model, torch.Generator().manual_seed(0))
    if args.input is not None:
        raise UsageError("--input is for a MODULE:FACTORY model; give a zoo network's batch with --batch-size")
    from .._cliargs import batch_bytes, require_memory
    from ..models import get_spec

    spec = get_spec(args.model)
    batch = args.batch_size or spec.cpu_batch
    require_memory(batch_bytes(spec, batch, training=True), f"--batch-size {batch} on {spec.name}",
                   "give a smaller --batch-size")
    torch.manual_seed(0)
    x, _ = spec.input.make_batch(batch, generator=torch.Generator().manual_seed(0))
    return spec.build(), x


def _compute(args: argparse.Namespace, model, x) -> Figure:
    import torch

    from ..errors import UsageError
    from ..probe.cost import Hardware, TrainingStep, count_step, step_floor

    if args.step_ms is not None:
        return Figure(args.step_ms / 1e3, "assumed (--step-ms)")
    if model is None:
        return Figure(0.0, "assumed 0: no --model or --step-ms, communication alone")
    from ..batch import batch_size

    batch = batch_size(x)
    if args.compute == "probe":
        from ..probe.cache import load_probe

        result = load_probe()
        if result is None:
            raise UsageError("--compute probe needs saved probe figures; run `dlperf probe --quick` first, or use "
                             "--compute measure")
        floor = step_floor(count_step(model, x, loss=args.loss), Hardware.from_probe_result(result), devices=1,
                           allreduce=None)
        return Figure(floor.no_overlap_s, f"floor from the saved dlperf probe figures (batch {batch}; a lower "
                                          "bound: a real step takes longer)")
    from ..timing import time_steps

    step = TrainingStep(model, x, loss=args.loss)
    timing = time_steps(step, warmup=1, steps=3, max_seconds=20)
    marked = ", contended: other work competed for the cores" if timing.contended else ""
    loss = f", loss {step.loss.name}" if step.loss is not None else ""
    return Figure(timing.median_s, f"measured now: median of {len(timing.samples)} training steps, batch {batch}"
                                   f"{loss}, {torch.get_num_threads()} threads on this machine{marked}")


def _network(args: argparse.Namespace) -> Figure:
    from ..errors import UsageError
    from ..probe.cost import Link
    from ..probe.links import saved_between_hosts
    from ..probe.projection import link_from_allreduce

    if args.link is not None:
        link, with_latency = args.link
        if with_latency:
            return Figure(link, "given (--link)")
        return Figure(Link(NETWORK_LATENCY_S, link.bandwidth),
                      "rate given (--link); latency assumed: d2l Table 12.4.1's datacenter round trip, halved")
    saved = saved_between_hosts()
    if saved is not None:
        fit, world, path = saved
        return Figure(link_from_allreduce(fit, world),
                      f"measured: gloo between hosts, {world} ranks, saved by dlperf launch in {path}")
    if args.hosts == 1:
        return Figure(Link(NETWORK_LATENCY_S, 1.25e9), "not used (one host)")
    raise UsageError("--hosts above 1 needs --link RATE (e.g. --link 10gbit): no link between hosts has been "
                     "measured here")


def _intra(args: argparse.Namespace) -> Figure:
    from ..probe.cost import Hardware, Link

    if args.intra_link is not None:
        link, with_latency = args.intra_link
        if with_latency:
            return Figure(link, "given (--intra-link)")
        return Figure(Link(INTRA_LATENCY_S, link.bandwidth), "rate given (--intra-link); latency assumed: "
                                                             "d2l 12.4.6's PCIe latency")
    from ..probe.cache import load_probe

    result = load_probe(quiet=True)
    if result is not None:
        return Figure(Hardware.from_probe_result(result).link("device"),
                      "measured: the saved dlperf probe's copy between logical CPU devices")
    return Figure(Link(INTRA_LATENCY_S, PCIE_BYTES_PER_S), "assumed: d2l 12.7.1's PCIe 3.0 x16 switch "
                                                           "(give --intra-link)")


REDUCE_BYTES_MOVED = 3.0
"""Memory traffic per byte reduced: ``a += b`` reads both and writes one (STREAM's add)."""
ASSUMED_MEMORY_BYTES_PER_S = 40e9  # d2l 12.4.4's quad-core, the top of its 20-40 GB/s


def _cpu(args: argparse.Namespace) -> Figure | None:
    """Each host's cores and the cost of a byte reduced, when --cores-per-host asks for the CPU term."""
    from ..probe.projection import HostCPU

    if args.cores_per_host is None:
        return None
    from ..probe.cache import load_probe

    result = load_probe(quiet=True)
    triads = [v for k, v in (result.figures().items() if result is not None else ()) if
              k.startswith("stream_triad_") and v]
    if triads:
        rate, source = max(triads) * 1e9, "cores given (--cores-per-host); reduction measured: the saved dlperf " \
                                          "probe's STREAM triad, 3 bytes moved per byte reduced"
    else:
        rate, source = ASSUMED_MEMORY_BYTES_PER_S, "cores given (--cores-per-host); reduction assumed: 3 bytes " \
                                                   "moved per byte at d2l 12.4.4's 40 GB/s (run dlperf probe)"
    return Figure(HostCPU(args.cores_per_host, REDUCE_BYTES_MOVED / rate), source)


def _describe_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def render(projection, figures: dict[str, Figure], title: str) -> str:
    """The table: one row per host count, each strategy's step (ms) and communication share, the knee."""
    strategies = projection.strategies
    lines = [title]
    for name, fig in figures.items():
        value = fig.value
        shown = value.describe() if hasattr(value, "describe") else f"{float(value) * 1e3:.3f} ms/step per device"
        lines.append(f"  {name:<9}{shown:<28}{fig.source}")
    lines.append("  overlap  none assumed: step = compute + gradient sum (overlap lowers the communication shown)")
    head = f"{'hosts':>5} {'devices':>7} " + " ".join(f"{s:>17}" for s in strategies) + f"  {'best':<13}{'eff':>5}"
    lines += ["", f"{'':>14}" + " ".join(f"{'ms (comm %)':>17}" for _ in strategies), head, "-" * len(head)]
    knee = projection.knee
    for row in projection.rows:
        cells = " ".join(f"{row.step_s(s) * 1e3:>9.2f} ({row.share(s) * 100:>3.0f}%)" for s in strategies)
        mark = "  <- knee" if row.hosts == knee else ""
        lines.append(f"{row.hosts:>5} {row.devices:>7} {cells}  {row.best:<13}"
                     f"{projection.efficiency(row, row.best):>5.2f}{mark}")
    lines.append("")
    lines.append("eff: throughput per host over one host's best (batch per device fixed); knee: the first host count "
                 "whose added host brings less than half a host's throughput"
                 + (f" (here {knee})" if knee else f" (none up to {projection.rows[-1].hosts} hosts)"))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from .._io import atomic_write_text, check_writable
    from ..errors import UsageError
    from ..probe.projection import STRATEGIES, Cluster, project

    if args.json and args.json != "-":
        check_writable(args.json)
    if args.gradients is not None and (args.input is not None or args.batch_size is not None):
        raise UsageError("--input and --batch-size go with --model; --gradients gives the bytes alone")
    network, intra = _network(args), _intra(args)  # bad or missing links fail before any model is built
    model, x = _model_and_batch(args) if args.model else (None, None)
    if model is not None and x is not None:
        from ..batch import batch_size

        gradient_bytes = float(sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad))
        # a batch may be several inputs or a dict: its size is their common first axis
        title = (f"dlperf scale: {args.model}, {_describe_bytes(gradient_bytes)} of gradients, batch {batch_size(x)} "
                 f"per device, 1..{args.hosts} hosts x {args.devices_per_host} devices")
    else:
        gradient_bytes = args.gradients
        title = (f"dlperf scale: {_describe_bytes(gradient_bytes)} of gradients (given), 1..{args.hosts} hosts x "
                 f"{args.devices_per_host} devices")
    compute, cpu = _compute(args, model, x), _cpu(args)
    cluster = Cluster(args.hosts, args.devices_per_host, network.value, intra.value,
                      cpu.value if cpu is not None else None)
    projection = project(gradient_bytes, float(compute.value), cluster,
                         args.strategies or list(STRATEGIES))
    figures = {"compute": compute, "network": network, "intra": intra, **({"cpu": cpu} if cpu is not None else {})}
    print(render(projection, figures, title), flush=True)
    if args.json:
        doc = {**projection.to_dict(), "figures": {
            name: {"value": (fig.value.alpha_s, fig.value.bandwidth) if hasattr(fig.value, "alpha_s")
                   else (fig.value.cores, fig.value.reduce_s_per_byte) if hasattr(fig.value, "cores")
                   else fig.value, "source": fig.source} for name, fig in figures.items()}}
        atomic_write_text(args.json, json.dumps(doc, indent=None if args.json == "-" else 1) + "\n")
    sys.stdout.flush()
    return 0

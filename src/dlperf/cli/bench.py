"""``dlperf bench``: time one training step per network, device and thread count (Shi et al. Table 7).

A network is a zoo name or your own model's factory, ``mypkg.nets:make_cnn``, with ``--input`` giving its
batch (``--input 64x3x32x32``, ``--input 64x32:int64 --input 64:int64``, or ``--input mypkg.data:make_batch``).
"""

from __future__ import annotations

import argparse
import sys

from ..bench.modes import mode_names
from ..bench.scaling import ScalingConfig, run_scaling
from ..bench.sweep import (
    OUTPUT_FORMATS,
    Outputs,
    SweepProgress,
    cell_description,
    check_batch_memory,
    check_outputs,
    emit_outputs,
)
from ..errors import UsageError
from ..models import model_names
from . import options as va
from .profile import input_source, input_value, target

MAX_BATCH = 2**20
MAX_STEPS = 100_000
MAX_THREADS = 1024


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="time one training step per network, device and thread count",
                       description=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="fewer timed steps (same batch sizes): the whole CPU table in minutes")
    p.add_argument("--networks", type=va.csv_list("--networks", model_names(), what="network", other=target),
                   default=None, help=f"comma-separated, default the paper's seven; choices: "
                                      f"{', '.join(model_names())}, or MODULE:FACTORY for your own model")
    p.add_argument("--loss", default=None, type=va.loss_value,
                   help="for a MODULE:FACTORY network: " + va.LOSS_HELP)
    p.add_argument("--input", action="append", type=input_value, metavar="SPEC|MODULE:FUNCTION",
                   help="the batch of a MODULE:FACTORY network, as dlperf profile takes it: one SHAPE[:DTYPE"
                        "[:LOW-HIGH]] per model argument, batch first (64x32:int64), or a function returning the "
                        "batch; --batch-size repeats its rows to that size"),
    p.add_argument("--devices", type=va.device_list("--devices"), default=None,
                   help="comma-separated, e.g. cpu,gpu(0),cuda:1 (default: the CPU and every GPU)")
    p.add_argument("--threads", type=va.int_list(1, MAX_THREADS, "--threads"), default=None,
                   help="intra-op thread counts for CPU cells, e.g. 1,2,4 (default: 1, 2, 4, ... cores)")
    p.add_argument("--batch-size", type=va.int_in(1, MAX_BATCH, "--batch-size"), default=None,
                   help="override every network's batch size")
    p.add_argument("--steps", type=va.int_in(1, MAX_STEPS, "--steps"), default=None,
                   help="timed steps per cell (default 10, quick 5)")
    p.add_argument("--warmup", type=va.int_in(0, MAX_STEPS, "--warmup"), default=None,
                   help="untimed steps per cell (default 2, quick 1; at least 1 except with --scaling)")
    p.add_argument("--mode", type=va.choice("mode", mode_names()), default="eager",
                   help=f"how the step runs: {', '.join(mode_names())}")
    p.add_argument("--explain", action="store_true",
                   help="add each cell's floor from the cost model (dlperf.probe.cost), measured/floor and "
                        "%% of peak FLOP/s")
    p.add_argument("--scaling", action="store_true",
                   help="Table 8 instead: time per mini-batch on 1..k devices, global batch split")
    fmt = p.add_argument_group("output")
    fmt.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                     type=va.output_path("--json", allow_stdout=True, in_place=True),
                     help="also print one JSON document as the last stdout line (or write it to FILE)")
    fmt.add_argument("--csv", nargs="?", const="-", default=None, metavar="FILE",
                     type=va.output_path("--csv", allow_stdout=True, in_place=True),
                     help="one row per cell as CSV, to stdout instead of the table, or to FILE")
    fmt.add_argument("--markdown", nargs="?", const="-", default=None, metavar="FILE",
                     type=va.output_path("--markdown", allow_stdout=True, in_place=True),
                     help="the table as Markdown, to stdout instead of the terminal table, or to FILE")
    fmt.add_argument("--plot", default=None, metavar="FILE.png", type=va.output_path("--plot", in_place=True),
                     help="thread-scaling plot (needs matplotlib)")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace):
    from ..bench.runner import BenchConfig

    overrides = {"mode": args.mode, "explain": bool(getattr(args, "explain", False))}
    for name in ("networks", "devices", "threads", "batch_size", "steps", "warmup"):
        if getattr(args, name) is not None:  # unset options keep the config's (or --quick's) defaults
            overrides[name] = getattr(args, name)
    return BenchConfig.quick(**overrides) if args.quick else BenchConfig(**overrides)


def outputs_of(args: argparse.Namespace) -> Outputs:
    """The output options as the library's :class:`~dlperf.bench.sweep.Outputs` (two to one file are refused)."""
    given = {flag: getattr(args, flag, None) for flag in OUTPUT_FORMATS}
    return Outputs(**{flag: "-" if value is True else value for flag, value in given.items()})


def scaling_config(args: argparse.Namespace) -> ScalingConfig:
    """``--scaling``'s options as a :class:`~dlperf.bench.scaling.ScalingConfig`; options Table 8 cannot honour
    are refused."""
    ignored = [option for option, given in ((f"--mode {getattr(args, 'mode', 'eager')}",
                                             getattr(args, "mode", "eager") != "eager"),
                                            ("--threads", getattr(args, "threads", None) is not None)) if given]
    if ignored:
        raise UsageError(f"--scaling does not take {', '.join(ignored)}: it times eager steps with the cores "
                         f"split among the device workers")
    return ScalingConfig(networks=list(getattr(args, "networks", None) or []),
                         devices=list(getattr(args, "devices", None) or []),
                         steps=getattr(args, "steps", None), warmup=getattr(args, "warmup", None),
                         quick=bool(getattr(args, "quick", False)), batch_size=getattr(args, "batch_size", None),
                         global_batch=dict(getattr(args, "global_batch", None) or {}),
                         explain=bool(getattr(args, "explain", False)), outputs=outputs_of(args))


def main_scaling(args: argparse.Namespace) -> int:
    """``dlperf bench --scaling``: Table 8 on the parsed options."""
    return run_scaling(scaling_config(args))


def user_networks_of(args: argparse.Namespace):
    """The user's ``module:factory`` networks known to the sweep while it runs (imports and runs their code)."""
    from ..bench.runner import user_networks

    inputs = input_source(args.input, "bench") if getattr(args, "input", None) else None
    return user_networks(list(getattr(args, "networks", None) or []), inputs, getattr(args, "loss", None))


def run(args: argparse.Namespace) -> int:
    outputs = outputs_of(args)
    with user_networks_of(args):
        return _run(args, outputs)


def _run(args: argparse.Namespace, outputs) -> int:
    if args.scaling:
        return main_scaling(args)
    config = build_config(args)
    check_outputs(outputs)
    check_batch_memory(config.networks, config.batch_size)
    _warn_oversubscribed(config.threads if args.threads is not None else [])
    result = _run_with_progress(config)
    _emit(result, outputs)
    if result.interrupted:
        # the finished cells are in every output; 130 tells a script the sweep is incomplete
        print(f"dlperf bench: interrupted after {len(result.cells)} of {result.planned} cells; "
              "the outputs hold the finished ones", file=sys.stderr, flush=True)
        return 130
    return 0


def _warn_oversubscribed(threads: list[int]) -> None:
    from ..devices import cpu_count

    over = [t for t in threads if t > cpu_count()]
    if over:
        va.warn("bench", f"--threads {','.join(map(str, over))} is more than the {cpu_count()} cores this "
                         "process may use; those cells time oversubscribed threads")


def _run_with_progress(config):
    from ..bench.runner import run_bench

    with SweepProgress("cell", sum(1 for _ in config.cells()), config.warmup + config.steps) as progress:
        def on_cell_done(cell):
            progress.finish(cell_description(cell.network, cell.device, cell.threads), cell.contention)

        return run_bench(config, on_cell_start=lambda *cell: progress.start(cell_description(*cell)),
                         on_step=progress.step, on_cell_done=on_cell_done)


def _emit(result, outputs: Outputs) -> None:
    from ..bench import report

    emit_outputs(result, outputs, report)
    failed = [c for c in result.cells if c.error]
    if failed:
        print(f"{len(failed)} cell(s) failed; the reason is in the table.", file=sys.stderr)
    if result.contended:
        marked = sum(c.contended for c in result.cells)
        print(f"dlperf bench: {marked} cell(s) were timed on a busy machine and are marked "
              f"{report.CONTENDED_MARK}; rerun them when the machine is quiet.", file=sys.stderr)

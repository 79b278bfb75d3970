"""``dlperf profile MODULE:FACTORY --input SPEC``: where a training step of your model spends its time.

    dlperf profile mypkg.nets:make_model --input 64x3x32x32
    dlperf profile mypkg.nets:make_transformer --input 64x32:int64 --input 64:int64:1-33
    dlperf profile mypkg.nets:make_ranker --input mypkg.data:make_batch
    dlperf profile dlperf.models.lenet:lenet --input 256x1x28x28 --threads 2 --trace step.json --json

The factory is imported and called with no arguments: that runs your code, which is why the verb
exists only for a module you name. The current directory is searched first, as ``python -m`` would.
"""

from __future__ import annotations

import argparse
import re
import sys

from ..errors import UsageError
from ..probe.targets import build_model, read_hardware

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
_TARGET = re.compile(f"{_DOTTED}:{_DOTTED}")


def _shown(text: str) -> str:
    from .options import one_line

    return one_line(repr(text if len(text) <= 60 else text[:57] + "..."))


def target(text: str) -> str:
    """``package.module:factory`` (a dotted attribute path after the colon is allowed)."""
    if len(text) > 500 or not _TARGET.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(
            f"{_shown(text)} is not MODULE:FACTORY; give a dotted module and a callable in it that builds the "
            "model, e.g. mypkg.nets:make_model")
    return text.strip()


def input_value(text: str):
    """One ``--input``: a tensor spec ``SHAPE[:DTYPE[:LOW-HIGH]]`` (batch first), or ``module:factory`` of a
    function returning the whole batch."""
    from ..models.inputs import parse_tensor_spec

    stripped = text.strip()
    if stripped[:1].isalpha() or stripped[:1] == "_":
        if len(text) > 500 or not _TARGET.fullmatch(stripped):
            raise argparse.ArgumentTypeError(
                f"{_shown(text)} is neither a tensor spec nor MODULE:FUNCTION; give a batch-first shape with an "
                "optional dtype and range (64x32:int64:0-1000) or a function returning the batch "
                "(mypkg.data:make_batch)")
        return stripped
    try:
        return parse_tensor_spec(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def input_source(values: list, verb: str = "profile"):
    """The ``--input`` values as one :data:`~dlperf.probe.user_inputs.InputSource`: specs, or one factory."""
    factories = [v for v in values if isinstance(v, str)]
    if factories and len(values) > 1:
        raise UsageError(f"{verb} --input {factories[0]} with {len(values) - 1} other --input: a batch factory "
                         "makes the whole batch; give it alone, or give one tensor spec per model argument")
    return factories[0] if factories else list(values)


def hardware_source(text: str) -> str:
    """``seed:NAME`` or the path of an existing regular file (read later, in :func:`read_hardware`)."""
    from ..probe.cost import SEED_PRESETS
    from . import options as va

    if text.startswith("seed:"):
        if text[5:] not in SEED_PRESETS:
            raise argparse.ArgumentTypeError(f"unknown seed hardware {_shown(text[5:])}; valid choices: "
                                             + ", ".join(f"seed:{n}" for n in SEED_PRESETS))
        return text
    return va.existing_file("--hardware")(text)


def register(sub) -> argparse.ArgumentParser:
    from . import options as va

    p = sub.add_parser("profile", help="profile training steps of any model: time per operator group, floors, "
                                       "measured suggestions", description=__doc__.splitlines()[0])
    p.add_argument("target", metavar="MODULE:FACTORY", type=target,
                   help="a callable that takes no arguments and returns a torch.nn.Module")
    p.add_argument("--input", required=True, action="append", type=input_value, metavar="SPEC|MODULE:FUNCTION",
                   help="one model argument as SHAPE[:DTYPE[:LOW-HIGH]], batch first (64x3x32x32, 64x32:int64, "
                        "64x32:int64:0-1000; integer ids default to below the model's smallest nn.Embedding); "
                        "repeat for several arguments; or a function returning the whole batch (a tensor, tuple "
                        "or dict), e.g. mypkg.data:make_batch")
    p.add_argument("--loss", default=None, type=va.loss_value, help=va.LOSS_HELP)
    p.add_argument("--threads", type=va.int_in(1, 1024, "--threads"), help="torch intra-op threads (default: as is)")
    p.add_argument("--steps", type=va.int_in(1, 1000, "--steps"), default=5, help="timed steps (default 5)")
    p.add_argument("--seed", type=va.int_in(0, va.SEED_MAX, "--seed"), default=0, help="seed for weights and input")
    p.add_argument("--hardware", metavar="FILE|seed:NAME", type=hardware_source,
                   help="figures for the floors: a JSON file in Hardware.from_probe's format, or one of d2l's "
                        "machines (seed:pcie-4gpu, seed:v100-8gpu, seed:cpu-4core); default: this machine's "
                        "saved `dlperf probe` figures, else a quick estimate")
    p.add_argument("--no-suggest", action="store_true", help="skip measuring the suggestions")
    p.add_argument("--trace", type=va.output_path("--trace", in_place=True), metavar="FILE",
                   help="write the profiled step as a Chrome trace (chrome://tracing, Perfetto)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   type=va.output_path("--json", allow_stdout=True, in_place=True),
                   help="also print one JSON document as the last stdout line (or write it to FILE)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from .._cliargs import require_memory
    from .._io import atomic_write_text, check_writable
    from ..bench.plans import plan_advice
    from ..probe.profile import profile
    from ..probe.user_inputs import batch_maker, input_bytes

    for path in (args.trace, args.json):
        if path and path != "-":
            check_writable(path)  # before minutes of profiling
    source = input_source(args.input)
    if not isinstance(source, str):
        # the inputs, their copies for the suggestions, and a doubled batch
        require_memory(4 * input_bytes(source), "--input " + " --input ".join(s.text() for s in source),
                       "give a smaller --input")
    hardware = read_hardware(args.hardware) if args.hardware else None  # a bad file fails before user code runs
    make = batch_maker(source)
    torch.manual_seed(args.seed)
    model = build_model(args.target)
    batch = make(model, torch.Generator().manual_seed(args.seed))
    report = profile(model, batch, steps=args.steps, threads=args.threads, suggest=not args.no_suggest,
                     trace=args.trace, name=args.target, hardware=hardware, plans=plan_advice, loss=args.loss)
    print(report, flush=True)
    if report.contended:
        print("dlperf profile: timed on a busy machine; the times marked ! are not the step's cost, rerun when the "
              "machine is quiet", file=sys.stderr, flush=True)
    if args.trace:
        print(f"trace written to {args.trace}")
    if args.json:
        import json

        # "-" and /dev/stdout: one line, the last on stdout; a file: indented
        document = json.dumps(report.to_dict(), indent=None if args.json == "-" else 1)
        atomic_write_text(args.json, document + "\n")
    return 0

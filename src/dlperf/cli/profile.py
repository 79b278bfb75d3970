"""``dlperf profile MODULE:FACTORY --input SHAPE``: where a training step of your model spends its time.

    dlperf profile mypkg.nets:make_model --input 64x3x32x32
    dlperf profile dlperf.models.lenet:lenet --input 256x1x28x28 --threads 2 --trace step.json --json

The factory is imported and called with no arguments: that runs your code, which is why the verb
exists only for a module you name. The current directory is searched first, as ``python -m`` would.
"""

from __future__ import annotations

import argparse
import math
import re

from ..probe.targets import build_model, read_hardware

MAX_DIM = 2**24
MAX_ELEMENTS = 2**31
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


def input_shape(text: str) -> tuple[int, ...]:
    """A shape such as ``64x3x32x32``: batch first, every dimension a whole number >= 1."""
    parts = text.strip().lower().split("x")
    fix = "give --input the shape of one batch, batch first, e.g. 64x3x32x32"
    if len(text) > 100 or not 1 <= len(parts) <= 8 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not a shape; {fix}")
    dims = tuple(int(p) for p in parts)
    if any(not 1 <= d <= MAX_DIM for d in dims):
        raise argparse.ArgumentTypeError(f"{_shown(text)} has a dimension outside 1..{MAX_DIM}; {fix}")
    if math.prod(dims) > MAX_ELEMENTS:
        raise argparse.ArgumentTypeError(f"{_shown(text)} has more than {MAX_ELEMENTS} elements; "
                                         "give a smaller --input")
    return dims


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
    p.add_argument("--input", required=True, type=input_shape, metavar="SHAPE",
                   help="shape of one float32 input batch, batch first, e.g. 64x3x32x32")
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
    from ..probe.profile import profile

    for path in (args.trace, args.json):
        if path and path != "-":
            check_writable(path)  # before minutes of profiling
    # the input, its gradient-free copies for the suggestions, and a doubled batch
    require_memory(4 * 4 * math.prod(args.input), f"--input {'x'.join(map(str, args.input))}",
                   "give a smaller --input")
    hardware = read_hardware(args.hardware) if args.hardware else None  # a bad file fails before user code runs
    torch.manual_seed(args.seed)
    model = build_model(args.target)
    x = torch.randn(args.input, generator=torch.Generator().manual_seed(args.seed))
    report = profile(model, x, steps=args.steps, threads=args.threads, suggest=not args.no_suggest,
                     trace=args.trace, name=args.target, hardware=hardware)
    print(report, flush=True)
    if args.trace:
        print(f"trace written to {args.trace}")
    if args.json:
        import json

        # "-" and /dev/stdout: one line, the last on stdout; a file: indented
        document = json.dumps(report.to_dict(), indent=None if args.json == "-" else 1)
        atomic_write_text(args.json, document + "\n")
    return 0

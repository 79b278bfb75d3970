"""``dlperf export MODEL DIR``: write a zoo model or your own as a portable graph plus parameters.

    dlperf export lenet out/lenet --batch 2
    dlperf export mlp out/mlp --weights mlp_state.pt
    dlperf export mymodels:make_cnn out/cnn --input 2x3x32x32
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import UsageError
from ..hybrid.zoo_export import CHECK_ATOL, CHECK_RTOL, MAX_BATCH, ZooExportConfig, check_export, export_zoo_model
from .profile import input_value


def register(sub) -> argparse.ArgumentParser:
    from ..models import model_names
    from . import options as va

    p = sub.add_parser("export", help="export a zoo model or your own as graph.json + params.safetensors",
                       description=__doc__.splitlines()[0])
    p.add_argument("model", metavar="MODEL", type=_model,
                   help=f"zoo model name ({', '.join(model_names())}) or pkg.module:factory (called with no "
                        "arguments; give its example with --input)")
    p.add_argument("--input", action="append", type=input_value, metavar="SPEC|MODULE:FUNCTION",
                   help="your model's example input: a tensor spec SHAPE[:DTYPE[:LOW-HIGH]] per positional argument "
                        "(batch first), or pkg.module:function returning it (not for zoo models: --batch)")
    p.add_argument("directory", metavar="DIRECTORY", type=va.existing_dir("DIRECTORY"),
                   help="output directory (created; existing export files are replaced)")
    p.add_argument("--batch", type=va.int_in(1, MAX_BATCH, "--batch"), default=2,
                   help="batch size of the example input (dimension 0 stays dynamic where the model allows)")
    p.add_argument("--weights", type=va.existing_file("--weights"),
                   help="a state_dict saved with torch.save to load before exporting (default: random "
                        "initialization)")
    p.add_argument("--seed", type=va.int_in(0, va.SEED_MAX, "--seed"), default=0,
                   help="seed for the random initialization and example")
    p.add_argument("--pt2", action="store_true", help="also write model.pt2 (torch.export program)")
    p.add_argument("--no-check", action="store_true", help="skip loading the written files back and comparing "
                   "outputs (export itself does so before writing: an export that does not load or reproduce the "
                   "model is not written, and exits with status 1)")
    p.set_defaults(func=run)
    return p


def _model(text: str) -> str:
    from ..models import model_names
    from . import options as va
    from .profile import target

    if ":" in text:
        return target(text)
    return va.choice("network", model_names())(text)


def run(args: argparse.Namespace) -> int:
    from ..hybrid.export import ExportCheckError

    try:
        if ":" in args.model:
            done = _export_factory(args)
        else:
            if args.input:
                raise UsageError(f"--input with zoo model {args.model}: its input is known; give --batch instead")
            config = ZooExportConfig(args.model, args.directory, batch=args.batch, weights=args.weights,
                                     seed=args.seed, pt2=args.pt2)
            done = export_zoo_model(config)
    except ExportCheckError as exc:  # the same failure as the check below, found before writing
        print(f"dlperf export: error: {exc}", file=sys.stderr)
        return 1
    for kind, path in done.paths.items():
        print(f"{kind:<7} {path}  {os.path.getsize(path) / 1e6:.2f} MB")
    if not args.no_check:
        diff, matches = check_export(done)
        print(f"check   loaded output differs from the model's by at most {diff:.3g}")
        if not matches:
            print(f"dlperf export: error: the export in {args.directory} does not reproduce the model "
                  f"(max difference {diff:.3g}, tolerance rtol={CHECK_RTOL:g} atol={CHECK_ATOL:g})", file=sys.stderr)
            return 1
    return 0


def _export_factory(args: argparse.Namespace):
    """Your model (``pkg.module:factory``) on the example ``--input`` names, exported."""
    import torch

    from ..hybrid.zoo_export import export_model
    from ..probe.targets import build_model
    from ..probe.user_inputs import batch_maker
    from .profile import input_source

    if not args.input:
        raise UsageError(f"export {args.model} needs its example input: give --input SHAPE (one per positional "
                         "argument, e.g. --input 2x3x32x32) or --input pkg.module:function")
    if args.weights:
        raise UsageError("--weights loads into zoo models; load your own weights in your factory")
    torch.manual_seed(args.seed)
    model = build_model(args.model)
    example = batch_maker(input_source(args.input, "export"))(model, torch.Generator().manual_seed(args.seed))
    if isinstance(example, dict):
        raise UsageError(f"export {args.model} with a mapping batch {sorted(example)}: an export takes its inputs "
                         "positionally; give them as --input specs in the forward's order")
    return export_model(model, example, args.directory, pt2=args.pt2)

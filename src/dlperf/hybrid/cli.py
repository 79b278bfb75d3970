"""``dlperf export MODEL DIR``: write a zoo model as a portable graph plus parameters.

    dlperf export lenet out/lenet --batch 2
    dlperf export mlp out/mlp --weights mlp_state.pt
"""

from __future__ import annotations

import argparse
import os

import torch

from ..errors import UsageError


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("export", help="export a zoo model as graph.json + params.safetensors",
                       description=__doc__.splitlines()[0])
    p.add_argument("model", help="zoo model name (dlperf.models.model_names())")
    p.add_argument("directory", help="output directory (created; existing export files are replaced)")
    p.add_argument("--batch", type=int, default=2, help="batch size of the example input (dimension 0 stays "
                   "dynamic where the model allows)")
    p.add_argument("--weights", help="a state_dict saved with torch.save to load before exporting "
                   "(default: random initialization)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random initialization and example")
    p.add_argument("--pt2", action="store_true", help="also write model.pt2 (torch.export program)")
    p.add_argument("--no-check", action="store_true", help="skip loading the export back and comparing outputs")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..models import get_spec
    from .export import export, load

    spec = get_spec(args.model)  # a miss lists the zoo
    if args.batch < 1:
        raise UsageError(f"--batch must be >= 1, got {args.batch}")
    torch.manual_seed(args.seed)
    model = spec.build().eval()
    if args.weights:
        if not os.path.isfile(args.weights):
            raise UsageError(f"--weights {args.weights!r}: no such file")
        model.load_state_dict(torch.load(args.weights, map_location="cpu", weights_only=True))
    x, _ = spec.input.make_batch(args.batch, generator=torch.Generator().manual_seed(args.seed))
    paths = export(model, args.directory, (x,), pt2=args.pt2)
    for kind, path in paths.items():
        print(f"{kind:<7} {path}  {os.path.getsize(path) / 1e6:.2f} MB")
    if not args.no_check:
        with torch.no_grad():
            diff = (load(args.directory)(x) - model(x)).abs().max().item()
        print(f"check   loaded output differs from the model's by at most {diff:.3g}")
    return 0

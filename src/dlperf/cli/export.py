"""``dlperf export MODEL DIR``: write a zoo model as a portable graph plus parameters.

    dlperf export lenet out/lenet --batch 2
    dlperf export mlp out/mlp --weights mlp_state.pt
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ..errors import UsageError

MAX_BATCH = 2**24


def register(sub) -> argparse.ArgumentParser:
    from .. import _cliargs as va
    from ..models import model_names

    p = sub.add_parser("export", help="export a zoo model as graph.json + params.safetensors",
                       description=__doc__.splitlines()[0])
    p.add_argument("model", metavar="MODEL", type=va.choice("network", model_names()),
                   help="zoo model name (dlperf.models.model_names())")
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
    p.add_argument("--no-check", action="store_true", help="skip loading the export back and comparing outputs "
                   "(otherwise a mismatch beyond float tolerance exits with status 1)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from .._cliargs import batch_bytes, require_memory
    from ..hybrid.export import export, load
    from ..models import get_spec

    spec = get_spec(args.model)  # a miss lists the zoo
    if args.batch < 1:
        raise UsageError(f"--batch must be >= 1, got {args.batch}")
    if os.path.exists(args.directory) and not os.path.isdir(args.directory):
        raise UsageError(f"{args.directory!r} is not a directory; give a directory for the export files")
    require_memory(batch_bytes(spec, args.batch, training=False), f"--batch {args.batch}", "give a smaller --batch")
    torch.manual_seed(args.seed)
    model = spec.build().eval()
    if args.weights:
        _load_weights(model, args.weights, args.model)
    x, _ = spec.input.make_batch(args.batch, generator=torch.Generator().manual_seed(args.seed))
    paths = export(model, args.directory, (x,), pt2=args.pt2)
    for kind, path in paths.items():
        print(f"{kind:<7} {path}  {os.path.getsize(path) / 1e6:.2f} MB")
    if not args.no_check:
        with torch.no_grad():
            got, want = load(args.directory)(x), model(x)
        diff = (got - want).abs().max().item()
        print(f"check   loaded output differs from the model's by at most {diff:.3g}")
        if not _close(got, want):
            print(f"dlperf export: error: the export in {args.directory} does not reproduce the model "
                  f"(max difference {diff:.3g}, tolerance rtol={CHECK_RTOL:g} atol={CHECK_ATOL:g})", file=sys.stderr)
            return 1
    return 0


# The export replays the same ATen kernels in the same order, so float32 outputs normally agree
# bit for bit; the tolerance only absorbs kernel choices that depend on the batch (dynamic shapes).
CHECK_RTOL = 1e-4
CHECK_ATOL = 1e-5


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """True when the loaded export's output matches the model's (NaN only where the model has NaN)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    return bool(torch.allclose(got, want, rtol=CHECK_RTOL, atol=CHECK_ATOL, equal_nan=True))


def _load_weights(model: torch.nn.Module, path: str, name: str) -> None:
    """Load a state_dict file into ``model``; a wrong file is a one-line UsageError."""
    from .._io import safe_torch_load

    # tensors in dicts only: nothing in the file may run code
    state = safe_torch_load(path, "--weights", "a state_dict of tensors saved with torch.save")
    if not isinstance(state, dict):
        raise UsageError(f"--weights {path!r}: holds a {type(state).__name__}, not a state_dict "
                         "(save model.state_dict())")
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        missing = sorted(set(model.state_dict()) - set(state))
        unexpected = sorted(set(state) - set(model.state_dict()))
        if missing or unexpected:
            detail = f"missing {_few(missing)}, unexpected {_few(unexpected)}"
        else:
            detail = "tensor shapes differ"
        raise UsageError(f"--weights {path!r}: does not fit model {name!r}: {detail}") from exc


def _few(keys: list[str], n: int = 3) -> str:
    if not keys:
        return "none"
    shown = ", ".join(keys[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")

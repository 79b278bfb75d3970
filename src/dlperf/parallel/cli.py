"""``dlperf train``: data-parallel training of LeNet or ResNet-18 on a list of devices (d2l 12.5-12.6).

    dlperf train --model lenet --devices cpu:0,cpu:1 --batch-size 256 --lr 0.2 --epochs 2

Without ``--data`` it trains on the embedded glyph dataset (no network needed); with ``--data DIR``
it reads Fashion-MNIST IDX files from DIR (``--download`` fetches them first). Each epoch prints the
test accuracy and the training seconds, and the last line reads like d2l's
``test acc: 0.85, 2.0 sec/epoch on [cpu(0), cpu(1)]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import torch

from .._io import atomic_open, check_writable, safe_torch_load
from ..devices import to_device
from ..errors import UsageError
from .allreduce import DEFAULT_ALGORITHM, algorithm_names, get_algorithm
from .split import check_devices
from .trainer import Trainer

__all__ = ["register", "run", "save_checkpoint", "load_checkpoint", "TRAIN_MODELS"]

TRAIN_MODELS = ("lenet", "resnet18")
_CHECKPOINT_FORMAT = 1


MAX_BATCH = 2**24
MAX_EPOCHS = 100_000
MAX_LR = 100.0  # beyond this SGD on these models only diverges to NaN
# The embedded dataset keeps each uint8 image and its int64 label, plus two int64 permutations.
_STORED_EXAMPLE_BYTES = 28 * 28 + 3 * 8


def register(sub) -> None:
    from .. import _cliargs as va
    from ..kvstore import kvstore_types

    p = sub.add_parser("train", help="train LeNet or ResNet-18 data-parallel on a list of devices",
                       description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lenet", choices=TRAIN_MODELS)
    p.add_argument("--devices", default="cpu:0", type=va.device_list("--devices"),
                   help="comma-separated, e.g. cpu:0,cpu:1 or gpu:0,gpu:1")
    p.add_argument("--batch-size", type=va.int_in(1, MAX_BATCH, "--batch-size"), default=256,
                   help="global mini-batch, split across devices (at least one example per device); an "
                        "epoch's last batch with fewer examples than devices is skipped")
    p.add_argument("--lr", type=va.positive_float("--lr", max_value=MAX_LR), default=0.2)
    p.add_argument("--epochs", type=va.int_in(1, MAX_EPOCHS, "--epochs"), default=10)
    p.add_argument("--data", metavar="DIR", type=va.existing_dir("--data"),
                   help="Fashion-MNIST IDX directory (default: embedded glyphs)")
    p.add_argument("--download", action="store_true", help="download Fashion-MNIST into --data first")
    p.add_argument("--train-size", type=va.int_in(1, 10**12, "--train-size"), default=12000,
                   help="embedded dataset: training images")
    p.add_argument("--test-size", type=va.int_in(1, 10**12, "--test-size"), default=2000,
                   help="embedded dataset: test images")
    p.add_argument("--algorithm", default=DEFAULT_ALGORITHM, type=va.choice("allreduce algorithm", algorithm_names()),
                   help=f"allreduce: {', '.join(algorithm_names())} (auto: the cost model's pick for the "
                        "measured links, printed at start)")
    p.add_argument("--kvstore", default=None, type=va.choice("kvstore type", kvstore_types()),
                   help="aggregate through a KVStore: local or device")
    p.add_argument("--seed", type=va.int_in(0, va.SEED_MAX, "--seed"), default=0)
    p.add_argument("--checkpoint", metavar="FILE", type=va.output_path("--checkpoint"),
                   help="save the state atomically after every epoch")
    p.add_argument("--resume", metavar="FILE", type=va.existing_file("--resume"),
                   help="continue bit-identically from a checkpoint")
    p.add_argument("--check-finite", action="store_true",
                   help="stop at the first step whose loss or gradients are NaN/inf, before it updates the weights")
    p.add_argument("--trace", metavar="FILE", type=va.output_path("--trace"),
                   help="write the engine's timeline of the run (Chrome trace JSON; summarise: dlperf trace FILE)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run)


def parse_devices(text: str | list) -> list:
    """``"cpu:0,cpu:1"`` -> ``[cpu(0), cpu(1)]``."""
    if not isinstance(text, str):  # already parsed by the option's type
        return list(text)
    parts = [t for t in (s.strip() for s in text.split(",")) if t]
    if not parts:
        raise UsageError("--devices is empty; give e.g. cpu:0,cpu:1")
    return [to_device(t) for t in parts]


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` so that a crash leaves either the old file or the new one, never half of one."""
    with atomic_open(path, "wb") as f:
        torch.save(state, f)


_CONFIG_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,), "devices": (int,), "batch_size": (int,), "lr": (float, int), "data": (str, type(None)),
    "train_size": (int,), "test_size": (int,), "seed": (int,), "algorithm": (str,), "kvstore": (str, type(None))}
_HISTORY_TYPES: dict[str, tuple[type, ...]] = {
    "epoch": (int,), "loss": (float, int), "test_acc": (float, int), "seconds": (float, int)}
_HISTORY_OPTIONAL: dict[str, tuple[type, ...]] = {"nonfinite_since_step": (int, type(None))}
_TRAINER_TYPES: dict[str, tuple[type, ...]] = {"model": (dict,), "buffers": (list,), "steps": (int,)}


def _check_fields(where: str, d: object, required: dict[str, tuple[type, ...]],
                  optional: dict[str, tuple[type, ...]] | None = None) -> str | None:
    """The first problem with dict ``d`` (missing, unexpected or wrong-typed key), or None."""
    if not isinstance(d, dict):
        return f"{where} is a {type(d).__name__}, not a dict"
    allowed = {**required, **(optional or {})}
    for key, types in allowed.items():
        if key not in d:
            if key in required:
                return f"{where} has no {key!r}"
            continue
        v = d[key]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            return f"{where}[{key!r}] is a {type(v).__name__}, expected {' or '.join(t.__name__ for t in types)}"
    extra = sorted(map(str, set(d) - set(allowed)))
    return f"{where} has unexpected keys {extra}" if extra else None


def _checkpoint_problem(state: object) -> str | None:
    problem = _check_fields("the file", state, {"format": (int,), "config": (dict,), "history": (list,),
                                                "trainer": (dict,)})
    if problem:
        return problem
    if state["format"] != _CHECKPOINT_FORMAT:
        return f"format {state['format']} (this dlperf reads format {_CHECKPOINT_FORMAT})"
    problem = _check_fields("config", state["config"], _CONFIG_TYPES)
    for i, rec in enumerate(state["history"]):
        problem = problem or _check_fields(f"history[{i}]", rec, _HISTORY_TYPES, _HISTORY_OPTIONAL)
    trainer = state["trainer"]
    problem = problem or _check_fields("trainer", {k: v for k, v in trainer.items()
                                                   if k not in ("optimizer", "kvstore")}, _TRAINER_TYPES)
    if problem:
        return problem
    if not any(isinstance(trainer.get(k), dict) for k in ("optimizer", "kvstore")):
        return "trainer has no optimizer state"
    tensors = [trainer["model"], *trainer["buffers"]]
    if not all(isinstance(t, dict) and all(isinstance(v, torch.Tensor) for v in t.values()) for t in tensors):
        return "trainer's model or buffers are not dicts of tensors"
    return None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`; any unreadable file is one :class:`UsageError`.

    Only tensors and plain containers are unpickled (``weights_only``): a checkpoint is data, and a
    file from elsewhere must not be able to run code.
    """
    state = safe_torch_load(path, "--resume checkpoint", "a checkpoint written by dlperf train --checkpoint")
    problem = _checkpoint_problem(state)
    if problem:
        raise UsageError(f"--resume checkpoint {str(path)!r} is not a dlperf train checkpoint: {problem}; "
                         "give a file written by dlperf train --checkpoint")
    return state


def _config(args) -> dict[str, Any]:
    return {"model": args.model, "devices": len(parse_devices(args.devices)), "batch_size": args.batch_size,
            "lr": args.lr, "data": args.data, "train_size": args.train_size, "test_size": args.test_size,
            "seed": args.seed, "algorithm": args.algorithm, "kvstore": args.kvstore}


def _check_args(args) -> None:
    """What the option types cannot see alone: combinations, and work that would not fit in memory."""
    from .._cliargs import batch_bytes, require_memory

    for name in ("batch_size", "epochs", "train_size", "test_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.lr <= MAX_LR:  # also NaN
        raise UsageError(f"--lr must be > 0 and <= {MAX_LR:g}, got {args.lr}")
    if args.download and not args.data:
        raise UsageError("--download needs --data DIR to download into; add --data DIR or drop --download")
    if args.data and not args.download and not os.path.isdir(args.data):
        raise UsageError(f"--data {args.data!r} does not exist; give the directory holding the Fashion-MNIST "
                         "IDX files, or add --download to fetch them into it")
    if args.data is None:
        require_memory((args.train_size + args.test_size) * _STORED_EXAMPLE_BYTES,
                       f"--train-size {args.train_size} --test-size {args.test_size}",
                       "give smaller sizes")
    from ..models import get_spec

    require_memory(batch_bytes(get_spec(args.model), args.batch_size, training=True),
                   f"--batch-size {args.batch_size} on {args.model}", "give a smaller --batch-size")


def _progress(enabled: bool, total: int, description: str):
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeRemainingColumn(), transient=True, console=Console(stderr=True))
    bar.start()
    bar.add_task(description, total=total)  # task id 0
    return bar


def train_epochs(trainer: Trainer, train_loader, test_loader, first_epoch: int, epochs: int,
                 show_progress: bool = False, on_epoch=None) -> list[dict[str, Any]]:
    """Train epochs ``first_epoch .. epochs-1``; return one record per epoch (loss, test acc, seconds).

    Every device needs at least one example of each step, so an epoch's last batch with fewer
    examples than devices is skipped (at most ``devices - 1`` examples an epoch).
    """
    history = []
    for epoch in range(first_epoch, epochs):
        bar = _progress(show_progress, len(train_loader), f"epoch {epoch + 1}/{epochs}")
        loss_sum: torch.Tensor | float = 0.0
        # the first step whose loss was NaN/inf, kept on the device and read with loss_sum at the end
        first_bad: torch.Tensor | None = None
        batches = 0
        try:
            start = time.perf_counter()
            # closing(): after Ctrl-C the loader's thread stops now, not when the traceback is freed
            with closing(train_loader.epoch_batches(epoch)) as train_batches:
                for X, y in train_batches:
                    if X.shape[0] < trainer.k:
                        continue  # only an epoch's last batch can be this short: see the docstring
                    # summed where it is: reading it on the host every step would stall a GPU's queue
                    loss = trainer.train_step(X, y).detach().float()
                    loss_sum = loss_sum + loss
                    bad = torch.where(torch.isfinite(loss), float("inf"), float(trainer.steps))
                    first_bad = bad if first_bad is None else torch.minimum(first_bad, bad)
                    batches += 1
                    if bar:
                        bar.advance(0, 1)
            for d in trainer.devices:
                d.synchronize()
            seconds = time.perf_counter() - start
        finally:
            if bar:
                bar.stop()
        with closing(test_loader.epoch_batches(0)) as test_batches:
            test_acc = trainer.evaluate_accuracy(test_batches)
        record = {"epoch": epoch + 1, "loss": float(loss_sum) / max(batches, 1), "test_acc": test_acc,
                  "seconds": seconds}
        if first_bad is not None and float(first_bad) != float("inf"):
            record["nonfinite_since_step"] = int(first_bad)
        history.append(record)
        if on_epoch:
            on_epoch(record)
    return history


def _epoch_line(rec: dict[str, Any]) -> str:
    loss = f"loss {rec['loss']:.3f}"
    if rec.get("nonfinite_since_step") is not None:
        loss += f" (non-finite since step {rec['nonfinite_since_step']}; --check-finite stops there)"
    return f"epoch {rec['epoch']}: {loss}, test acc {rec['test_acc']:.3f}, {rec['seconds']:.1f} sec"


def run(args: argparse.Namespace) -> int:
    from ..data import load_data
    from ..models import get_spec

    _check_args(args)
    devices = check_devices(parse_devices(args.devices))  # fail before any data is made or read
    if args.batch_size < len(devices):
        raise UsageError(f"--batch-size {args.batch_size} is smaller than the {len(devices)} devices; each "
                         f"device needs at least one example per step: use --batch-size {len(devices)} or more")
    get_algorithm(args.algorithm)
    if args.checkpoint:
        try:
            check_writable(args.checkpoint)  # now, not after the first epoch
        except OSError as exc:
            raise UsageError(f"--checkpoint: {exc}") from None
    config = _config(args)
    resume = load_checkpoint(args.resume) if args.resume else None
    if resume is not None and resume["config"] != config:
        diff = {k: (resume["config"].get(k), v) for k, v in config.items() if resume["config"].get(k) != v}
        raise UsageError(f"--resume {args.resume}: settings differ from the checkpoint's (was, now): {diff}")
    torch.manual_seed(args.seed)
    spec = get_spec(args.model)
    train_loader, test_loader = load_data(args.batch_size, args.data, seed=args.seed, train=args.train_size,
                                          test=args.test_size, download=args.download)
    history: list[dict[str, Any]] = list(resume["history"]) if resume else []
    saved: list[int] = []  # epochs whose checkpoint this run wrote
    first = len(history)
    try:
        _train(args, spec, devices, config, train_loader, test_loader, resume, history, saved)
    except KeyboardInterrupt:
        kept = f"; {args.checkpoint} holds epoch {saved[-1]}" if saved else ""
        print(f"dlperf train: interrupted{kept}", file=sys.stderr, flush=True)
        return 130
    timed = [h["seconds"] for h in history[first:]] or [h["seconds"] for h in history]
    per_epoch = sum(timed) / len(timed) if timed else 0.0
    acc = history[-1]["test_acc"] if history else float("nan")
    names = "[" + ", ".join(str(d) for d in devices) + "]"
    print(f"test acc: {acc:.2f}, {per_epoch:.1f} sec/epoch on {names}")
    if args.json:
        print(json.dumps({"model": args.model, "devices": [str(d) for d in devices], "test_acc": acc,
                          "sec_per_epoch": per_epoch, "epochs": history}))
    return 0


def _announce_auto(model: torch.nn.Module, devices: list) -> None:
    """Say once which algorithm ``--algorithm auto`` takes for this model's gradient buckets, and why."""
    from .allreduce import choose_algorithm
    from .allreduce.auto import describe_bytes
    from .buckets import DEFAULT_BUCKET_BYTES

    sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    # the Trainer reduces buckets of up to DEFAULT_BUCKET_BYTES; a larger parameter gets one of its own
    nbytes = max(min(sum(sizes), DEFAULT_BUCKET_BYTES), max(sizes, default=0))
    # the Trainer pushes each bucket's phases to the engine, one operation per device lane, as backward fills it
    name, reason = choose_algorithm(nbytes, devices, workers=True)
    print(f"allreduce: auto chose {name} for gradient buckets of {describe_bytes(nbytes)} ({reason})", flush=True)


def _train(args, spec, devices, config, train_loader, test_loader, resume, history, saved) -> None:
    model = spec.build()
    if args.algorithm == "auto" and args.kvstore is None:
        _announce_auto(model, devices)
    with Trainer(model, devices, "sgd", {"lr": args.lr}, loss=spec.loss, algorithm=args.algorithm,
                 kvstore=args.kvstore, check_finite=getattr(args, "check_finite", False),
                 trace=getattr(args, "trace", None)) as trainer:
        if resume is not None:
            try:
                trainer.load_state_dict(resume["trainer"])
            except (KeyError, TypeError, ValueError, RuntimeError) as exc:
                raise UsageError(f"--resume {args.resume}: the checkpoint does not fit this model "
                                 f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})"
                                 ) from None
        first = len(history)  # before on_epoch appends

        def on_epoch(rec: dict[str, Any]) -> None:
            history.append(rec)
            print(_epoch_line(rec), flush=True)
            if args.checkpoint:
                save_checkpoint(args.checkpoint, {"format": _CHECKPOINT_FORMAT, "config": config,
                                                  "history": history, "trainer": trainer.state_dict()})
                saved.append(rec["epoch"])

        show = not (args.no_progress or args.json) and sys.stderr.isatty()
        train_epochs(trainer, train_loader, test_loader, first, args.epochs, show, on_epoch)

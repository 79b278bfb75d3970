"""``dlperf train --model pkg.module:factory`` / ``--data pkg.module:factory``: your own model and data.

The factories are imported the way ``dlperf profile`` imports its model (the current directory first, as
``python -m`` would) and called with no arguments. The data factory returns ``train`` or ``(train, test)``,
each an iterable of ``(inputs, targets)`` batches that can be iterated once per epoch; without a test set
the accuracy is the training set's. Training is the Trainer's, with the same options and printing as the
zoo's runs; checkpoints and several processes stay with the zoo's models for now (one line says so).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from ..errors import UsageError, blame_user_code

__all__ = ["uses_factories", "run_factories"]


def uses_factories(args: argparse.Namespace) -> bool:
    return ":" in args.model or (args.data is not None and ":" in args.data)


class _Batches:
    """An iterable of batches seen as the loaders ``train_epochs`` takes (one pass per epoch)."""

    def __init__(self, batches: Iterable[Any], what: str) -> None:
        self.batches, self.what = batches, what

    def __len__(self) -> int:
        try:
            return len(self.batches)  # type: ignore[arg-type]
        except TypeError:
            return 0

    def epoch_batches(self, epoch: int) -> Iterator[tuple[Any, Any]]:
        from ..batch import describe

        batches, i = None, 0
        while True:
            try:  # the user's iterable: what it raises is noted for the one line that names it
                batches = iter(self.batches) if batches is None else batches
                batch = next(batches)
            except StopIteration:
                return
            except Exception as exc:
                blame_user_code(exc, f"the {self.what} data (epoch {epoch + 1}, batch {i})",
                                "fix the data factory's batches")
                raise
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise UsageError(f"{self.what} batch {i} is {describe(batch)}; the data factory's batches must be "
                                 "(inputs, targets) pairs")
            yield batch[0], batch[1]
            i += 1


def _data(args: argparse.Namespace) -> tuple[Any, Any]:
    if args.data is not None and ":" in args.data:
        from ..probe.targets import load_factory

        try:
            made = load_factory(args.data)()
        except UsageError:
            raise
        except (Exception, SystemExit) as exc:  # noqa: BLE001 (user code)
            raise UsageError(f"{args.data}() raised {type(exc).__name__}: {exc}; fix the data factory") from None
        train, test = made if isinstance(made, tuple) and len(made) == 2 else (made, made)
        for part, name in ((train, "train"), (test, "test")):
            if not isinstance(part, Iterable):
                raise UsageError(f"{args.data}() gave a {type(part).__name__} as its {name} set; return an iterable "
                                 "of (inputs, targets) batches, e.g. a DataLoader, or a (train, test) pair of them")
        return _Batches(train, "train"), _Batches(test, "test")
    from ..data import load_data

    train_loader, test_loader = load_data(args.batch_size, args.data, seed=args.seed, train=args.train_size,
                                          test=args.test_size, download=args.download)
    return train_loader, test_loader


def run_factories(args: argparse.Namespace) -> int:
    """Train the factories' model on the factories' data (or the zoo's), following ``args.plan``."""
    import torch

    from ..models import get_spec
    from ..parallel import Trainer
    from ..parallel.planner import PlannerOptions
    from ..parallel.planning import plan_for
    from ..parallel.training import epoch_line, train_epochs
    from ..probe.targets import build_model

    for flag, given in (("--checkpoint", args.checkpoint), ("--resume", args.resume),
                        ("--nproc-per-node", args.nproc_per_node)):
        if given is not None:
            raise UsageError(f"{flag} with a MODULE:FACTORY model or data is not supported yet; train a zoo model "
                             f"for it, or drop {flag}")
    torch.manual_seed(args.seed)
    zoo = ":" not in args.model
    model = get_spec(args.model).build() if zoo else build_model(args.model)
    loss = get_spec(args.model).loss if zoo else None
    train_loader, test_loader = _data(args)
    plan = args.plan
    if plan == "auto":
        first = next(iter(train_loader.epoch_batches(0)), None)
        if first is None:
            raise UsageError("the training data gave no batch; the data factory must yield (inputs, targets) pairs")
        rng = torch.get_rng_state()  # planning must not move the weights the run starts from
        steps = max(1, args.epochs * len(train_loader)) if len(train_loader) else None
        try:
            decision = plan_for(model, first, args.devices, optimizer_params={"lr": args.lr}, loss=loss,
                                options=PlannerOptions(run_steps=steps))
        finally:
            torch.set_rng_state(rng)
        plan = decision.plan
        print(plan.line(), flush=True)
        for skipped in decision.skipped:
            print(f"plan: skipped {skipped}", flush=True)
    elif plan is not None:
        plan = plan.filled(algorithm=args.algorithm, bucket_bytes=args.bucket_bytes, kvstore=args.kvstore)
        print(plan.line(), flush=True)
    history: list[dict[str, Any]] = []
    devices = list(args.devices)
    with Trainer(model, args.devices, "sgd", {"lr": args.lr}, loss=loss, plan=plan, algorithm=args.algorithm,
                 bucket_bytes=args.bucket_bytes, kvstore=args.kvstore, check_finite=args.check_finite,
                 trace=args.trace, processes=None) as trainer:
        def record(rec: dict[str, Any]) -> None:
            history.append(rec)
            print(epoch_line(rec), flush=True)

        devices = list(trainer.devices)  # those the plan uses, which may be fewer than --devices names
        show = not (args.no_progress or args.json) and sys.stderr.isatty()
        train_epochs(trainer, train_loader, test_loader, 0, args.epochs, show, record)
    acc = history[-1]["test_acc"] if history else float("nan")
    per_epoch = sum(h["seconds"] for h in history) / max(1, len(history))
    names = "[" + ", ".join(str(d) for d in devices) + "]"
    print(f"test acc: {acc:.2f}, {per_epoch:.1f} sec/epoch on {names}")
    if args.json:
        print(json.dumps({"model": args.model, "devices": [str(d) for d in devices], "processes": 1,
                          "test_acc": acc, "sec_per_epoch": per_epoch, "epochs": history,
                          "plan": plan.name if plan is not None and not isinstance(plan, str) else None}))
    return 0

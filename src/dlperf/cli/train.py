"""``dlperf train``: train a zoo network or your own model, data-parallel, on a list of devices (d2l 12.5-12.6).

    dlperf train --model lenet --devices cpu:0,cpu:1 --batch-size 256 --lr 0.2 --epochs 2
    dlperf train --model mymodels:make_gru --data mymodels:gru_data --loss mse --plan auto

The options become a :class:`~dlperf.parallel.training.run_config.RunConfig` (one table, :data:`FLAGS`, maps each
of its parameters to the flag that sets it) and :func:`~dlperf.parallel.training.run.run_training` does the rest;
this module only prints. Each epoch prints the loss, the test accuracy and the seconds, and the last line reads
like d2l's ``test acc: 0.85, 2.0 sec/epoch on [cpu(0), cpu(1)]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from typing import Any

from ..errors import UsageError, stop_status
from ..parallel.allreduce import DEFAULT_ALGORITHM, algorithm_names
from ..parallel.optimizers import SCHEDULES
from ..parallel.training.run_config import (
    MAX_BATCH,
    MAX_BUCKET_BYTES,
    MAX_EPOCHS,
    MAX_LR,
    TRAIN_MODELS,
    RunConfig,
    RunSection,
    is_factory,
)

__all__ = ["register", "run", "run_config", "check_in_parent", "epoch_line"]



_interrupted_after: list[int] = []  # the last epoch this process saw saved, for the line after Ctrl-C


def register(sub) -> None:
    from ..kvstore import kvstore_types
    from . import options as va

    p = sub.add_parser("train", help="train a zoo network or your own model data-parallel on a list of devices",
                       description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lenet", type=model_source,
                   help=f"{', '.join(TRAIN_MODELS)}, or pkg.module:factory (called with no arguments)")
    p.add_argument("--devices", default="cpu:0", type=va.device_list("--devices"),
                   help="comma-separated, e.g. cpu:0,cpu:1 or gpu:0,gpu:1")
    p.add_argument("--batch-size", type=va.int_in(1, MAX_BATCH, "--batch-size"), default=256,
                   help="global mini-batch of the embedded or IDX data, split across devices (at least one example "
                        "per device); an epoch's last batch with fewer examples than devices is skipped")
    p.add_argument("--optimizer", default="sgd", type=optimizer_value,
                   help="sgd, adam, adamw, or pkg.module:fn(params) returning a torch.optim optimizer")
    p.add_argument("--lr", type=va.positive_float("--lr", max_value=MAX_LR), default=0.2)
    p.add_argument("--momentum", type=va.fraction("--momentum"), default=None,
                   help="SGD's momentum (default: the optimizer's own, 0 for SGD)")
    p.add_argument("--weight-decay", type=va.fraction("--weight-decay"), default=None,
                   help="weight decay (default: the optimizer's own)")
    p.add_argument("--lr-schedule", default=None, type=va.choice("learning-rate schedule", SCHEDULES.names()),
                   help="constant, step (a tenth at half the run, a hundredth at three quarters), cosine (to 0 over "
                        "the run) or warmup (from a tenth over its first tenth); default: none")
    p.add_argument("--accumulate", type=va.int_in(1, 4096, "--accumulate"), default=1,
                   help="sum the gradients of this many batches before one synchronization and update")
    p.add_argument("--clip-grad-norm", type=va.positive_float("--clip-grad-norm", max_value=1e30), default=None,
                   help="scale the summed gradients down to this total 2-norm before each update")
    p.add_argument("--epochs", type=va.int_in(1, MAX_EPOCHS, "--epochs"), default=10)
    p.add_argument("--data", metavar="DIR|MODULE:FACTORY", type=data_source,
                   help="Fashion-MNIST IDX directory, or pkg.module:factory returning train or (train, test) "
                        "batches: (inputs, targets) pairs or mappings with their labels (default: embedded glyphs)")
    p.add_argument("--loss", default=None, type=va.loss_value, help=va.LOSS_HELP)
    p.add_argument("--plan", default=None, type=plan_option,
                   help="auto: measure the plans valid here on the first batch and train on the fastest (printed "
                        "first); or pin one by name, e.g. 1x2,channels-last (replicas x threads, layout, ...)")
    p.add_argument("--replan", action="store_true",
                   help="with --plan auto: measure the plans again even where a decision is cached")
    p.add_argument("--download", action="store_true", help="download Fashion-MNIST into --data first")
    p.add_argument("--train-size", type=va.int_in(1, 10**12, "--train-size"), default=12000,
                   help="embedded dataset: training images")
    p.add_argument("--test-size", type=va.int_in(1, 10**12, "--test-size"), default=2000,
                   help="embedded dataset: test images")
    p.add_argument("--algorithm", default=DEFAULT_ALGORITHM, type=va.choice("allreduce algorithm", algorithm_names()),
                   help=f"allreduce: {', '.join(algorithm_names())} (auto: the cost model's pick for the "
                        "measured links, printed at start)")
    p.add_argument("--bucket-bytes", type=va.int_in(1, MAX_BUCKET_BYTES, "--bucket-bytes"), default=None,
                   help="gradient bucket size (default: 1 MiB, larger for large models); smaller buckets "
                        "are reduced while backward still runs (see it with --trace)")
    p.add_argument("--strategy", default=None, type=strategy_option,
                   help="how gradients are synchronized, by name (one-device, allreduce, processes, kvstore, "
                        "update-on-kvstore, parameter-servers) or pkg.module:Class of your own; default: from the "
                        "devices, processes and --kvstore")
    p.add_argument("--kvstore", default=None, type=va.choice("kvstore type", kvstore_types()),
                   help="aggregate through a KVStore: local or device in one process; dist_sync or "
                        "dist_device_sync across processes (parameter servers: dlperf launch --num-servers)")
    p.add_argument("--seed", type=va.int_in(0, va.SEED_MAX, "--seed"), default=0)
    p.add_argument("--checkpoint", metavar="FILE", type=va.output_path("--checkpoint"),
                   help="save the state atomically after every epoch")
    p.add_argument("--resume", metavar="FILE", type=va.existing_file("--resume"),
                   help="continue bit-identically from a checkpoint")
    p.add_argument("--resume-hparams-from-checkpoint", action="store_true",
                   help="with --resume: train with the optimizer hyperparameters the checkpoint holds (checked "
                        "for type and range) instead of refusing a checkpoint whose differ from this run's")
    p.add_argument("--check-finite", action="store_true",
                   help="stop at the first step whose loss or gradients are NaN/inf, before it updates the weights")
    p.add_argument("--trace", metavar="FILE", type=va.output_path("--trace"),
                   help="write the engine's timeline of the run (Chrome trace JSON; summarise: dlperf trace FILE)")
    p.add_argument("--nproc-per-node", type=va.int_in(1, 1024, "--nproc-per-node"), default=None,
                   help="train as this many processes on this host (dlperf launch for more options)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    # dlperf launch checks a train command through this, before any process starts
    p.set_defaults(func=run, check_in_parent=check_in_parent)


def model_source(text: str) -> str:
    """A zoo model's name or ``pkg.module:factory``."""
    from .profile import target

    if text in TRAIN_MODELS:
        return text
    if is_factory(text):
        return target(text)
    raise argparse.ArgumentTypeError(f"{text[:60]!r} is neither a model ({', '.join(TRAIN_MODELS)}) nor "
                                     "MODULE:FACTORY; give one, e.g. lenet or mypkg.nets:make_model")


def data_source(text: str) -> str:
    """A Fashion-MNIST directory, or ``pkg.module:factory`` returning batches."""
    from . import options as va
    from .profile import target

    return target(text) if is_factory(text) else va.existing_dir("--data")(text)


def optimizer_value(text: str) -> object:
    """An optimizer's name, or ``pkg.module:fn`` (imported now: it is the user's) taking the parameters."""
    from ..parallel.optimizers import OPTIMIZERS

    if is_factory(text):
        from ..probe.targets import load_factory

        try:
            return load_factory(text)
        except UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    if text.lower() in OPTIMIZERS:
        return text.lower()
    raise argparse.ArgumentTypeError(f"{text[:60]!r} is not an optimizer; give one of {', '.join(OPTIMIZERS.names())} "
                                     "or MODULE:FN, e.g. adamw or myopt:make")


def strategy_option(text: str) -> str:
    """A registered gradient synchronization strategy's name, or ``pkg.module:Class`` (imported now)."""
    from ..parallel.strategies import strategy_class

    try:
        strategy_class(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def plan_option(text: str) -> object:
    """``auto`` or a plan's name, checked now (one line, exit 2)."""
    from ..parallel.planning.plan import parse_plan

    if text == "auto":
        return text
    try:
        return parse_plan(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_config(args: argparse.Namespace, processes: int | None = None) -> RunConfig:
    """The parsed options as the library's :class:`RunConfig` (which checks them; errors in its words)."""
    from ..parallel.launchers import LaunchConfig
    from ..parallel.launchers.launch_config import RUN_TIMEOUT_S
    from ..parallel.training.trainer_config import TrainerConfig

    nproc = processes if processes is not None else args.nproc_per_node
    plan = args.plan
    if nproc is not None and plan is not None and not (getattr(plan, "launcher", None) == "processes"
                                                       and plan.replicas == nproc):
        raise UsageError(f"--plan {getattr(plan, 'name', plan)} with {nproc} processes: a plan with processes is "
                         f"measured and started by dlperf train; give --plan auto or --plan {nproc}xT,processes "
                         "without --nproc-per-node, or drop --plan")
    from ..parallel.strategies import choose_strategy

    # the store's rule before the config's other checks (the CLI names its parameters' flags)
    choose_strategy(args.kvstore, processes=nproc or 1, strategy=args.strategy, devices=args.devices)
    run = RunSection(model=args.model, data=args.data, devices=args.devices, batch_size=args.batch_size,
                     epochs=args.epochs, seed=args.seed, train_size=args.train_size, test_size=args.test_size,
                     download=args.download, checkpoint=args.checkpoint, resume=args.resume,
                     resume_hparams_from_checkpoint=args.resume_hparams_from_checkpoint)
    params = {"lr": args.lr, **{k: v for k, v in (("momentum", args.momentum), ("weight_decay", args.weight_decay))
                                if v is not None}}
    trainer = TrainerConfig(args.optimizer, params, loss=args.loss, algorithm=args.algorithm, kvstore=args.kvstore,
                            strategy=args.strategy, bucket_bytes=args.bucket_bytes, check_finite=args.check_finite,
                            trace=args.trace, plan=plan, lr_schedule=args.lr_schedule, accumulate=args.accumulate,
                            clip_grad_norm=args.clip_grad_norm)
    # processes given: checked for the launch that will start them (dlperf launch -- train ...)
    launch = LaunchConfig(nproc, join_timeout_s=RUN_TIMEOUT_S) if nproc is not None else None
    from ..parallel.planning.records import PlannerOptions

    return RunConfig(run, trainer, PlannerOptions(replan=args.replan), launch=launch)


def check_in_parent(args: argparse.Namespace, processes: int, num_servers: int = 0) -> RunConfig:
    """Check the options for ``processes`` processes (``num_servers`` of them parameter servers) before they
    start: a mistake is one line, not one a process."""
    from ..parallel.communication.process_group import check_process_settings
    from ..parallel.strategies import choose_strategy
    from ..parallel.training.run_config import check_resume

    plan = getattr(args, "plan", None)
    if plan is not None and getattr(plan, "launcher", None) == "processes" and plan.replicas != processes:
        raise UsageError(f"--plan {plan.name} with {processes} processes: its replicas are {plan.replicas} processes; "
                         f"launch {plan.replicas}, or give the plan without dlperf launch (dlperf train starts them)")
    choose_strategy(args.kvstore, processes=processes, num_servers=num_servers, strategy=args.strategy,
                    devices=args.devices)
    config = run_config(args, processes)
    check_resume(config)
    check_process_settings()
    return config


def run(args: argparse.Namespace) -> int:
    from ..parallel.launchers import LaunchError
    from ..parallel.training.run import RunHooks, run_training
    from . import show_notes
    from .launch import report_launch_error

    if args.nproc_per_node is not None:
        from ..parallel.launchers import rank_info

        if rank_info().world_size > 1:
            raise UsageError(f"--nproc-per-node {args.nproc_per_node} in a process already started as one of "
                             f"{rank_info().world_size}; give the process count once, to dlperf launch or to "
                             "dlperf train")
    config = run_config(args)
    hooks = RunHooks(on_start=show_notes, on_epoch=print_epoch,
                     on_result=partial(print_result, as_json=args.json),
                     show_progress=not (args.no_progress or args.json) and sys.stderr.isatty())
    _interrupted_after.clear()
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        run_training(config, hooks)
    except (LaunchError, SignalException) as exc:  # SignalException: SIGTERM or SIGHUP while processes train
        return report_launch_error("train", exc, verbose=False)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated)
        said, status = stop_status(exc)
        kept = f"; {config.run.checkpoint} holds epoch {_interrupted_after[-1]}" \
            if _interrupted_after and config.run.checkpoint else ""
        print(f"dlperf train: {said}{kept}", file=sys.stderr, flush=True)
        return status
    return 0


def epoch_line(rec: dict[str, Any]) -> str:
    """One finished epoch as printed: loss (and since which step it was not finite), test accuracy, seconds."""
    loss = f"loss {rec['loss']:.3f}"
    if rec.get("nonfinite_since_step") is not None:
        loss += f" (non-finite since step {rec['nonfinite_since_step']}; --check-finite stops there)"
    metric = f"test loss {rec['test_loss']:.4f}" if "test_loss" in rec else f"test acc {rec['test_acc']:.3f}"
    return f"epoch {rec['epoch']}: {loss}, {metric}, {rec['seconds']:.1f} sec"


def print_epoch(rec: dict[str, Any]) -> None:
    _interrupted_after.append(rec["epoch"])
    print(epoch_line(rec), flush=True)


def print_result(result: Any, as_json: bool = False) -> None:
    """The run's last lines: the exchanges across processes, then d2l's line (and the JSON object)."""
    names = "[" + ", ".join(str(d) for d in result.devices) + "]"
    if result.processes > 1:
        names += f" x {result.processes - result.servers} processes"
        if result.servers:
            names += f" + {result.servers} server{'s' * (result.servers > 1)}"
    if result.exchanges is not None:  # before the d2l line, which stays the last
        print(result.exchanges.describe())
    metric = f"test loss: {result.test_loss:.4f}" if result.test_loss is not None else \
        f"test acc: {result.test_acc:.2f}"
    print(f"{metric}, {result.seconds_per_epoch:.1f} sec/epoch on {names}", flush=True)
    if as_json:
        print(json.dumps({"model": result.config.run.model, "devices": [str(d) for d in result.devices],
                          "processes": result.processes, "test_acc": result.test_acc, "test_loss": result.test_loss,
                          "sec_per_epoch": result.seconds_per_epoch, "epochs": result.history,
                          "plan": result.plan.name if result.plan is not None else None,
                          "exchanges": result.exchanges.as_dict() if result.exchanges else None}), flush=True)


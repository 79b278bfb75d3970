"""``dlperf train``: data-parallel training of LeNet or ResNet-18 on a list of devices (d2l 12.5-12.6).

    dlperf train --model lenet --devices cpu:0,cpu:1 --batch-size 256 --lr 0.2 --epochs 2

Without ``--data`` it trains on the embedded glyph dataset (no network needed); with ``--data DIR``
it reads Fashion-MNIST IDX files from DIR (``--download`` fetches them first). Each epoch prints the
test accuracy and the training seconds, and the last line reads like d2l's
``test acc: 0.85, 2.0 sec/epoch on [cpu(0), cpu(1)]``.

``--nproc-per-node N`` trains as N processes on this host (the short form of ``dlperf launch
--nproc-per-node N -- train ...``): ``--devices`` are each process's own, ``--batch-size`` is the global
batch, the first process prints and writes the checkpoint.

``--plan auto`` measures the plans valid for the model, batch and devices on the first batch (replicas x
threads, layout, ...: :mod:`dlperf.parallel.planner`) and trains on the fastest, printing it first; ``--plan
1x2,channels-last`` pins one. A plan whose replicas are processes (``2x1,processes``, pinned or chosen by
``auto``) trains as that many processes, as ``--nproc-per-node`` would, and a checkpoint of one resumes so.
``--model pkg.module:factory`` and ``--data pkg.module:factory`` train your own
model and data: each factory is imported and called with no arguments (that runs your code), the data
factory returning ``train`` or ``(train, test)``, each an iterable of ``(inputs, targets)`` batches that can
be iterated once per epoch (a ``DataLoader`` is one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import fields

from ..errors import UsageError, stop_status
from ..parallel.allreduce import DEFAULT_ALGORITHM, algorithm_names
from ..parallel.training import (
    MAX_BATCH,
    MAX_BUCKET_BYTES,
    MAX_EPOCHS,
    MAX_LR,
    TRAIN_MODELS,
    TrainConfig,
    TrainState,
    check_resume,
    epoch_line,
    prepare,
    train,
)

__all__ = ["register", "run", "train_config"]


def register(sub) -> None:
    from ..kvstore import kvstore_types
    from . import options as va

    p = sub.add_parser("train", help="train LeNet or ResNet-18 data-parallel on a list of devices",
                       description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lenet", type=model_source,
                   help=f"{', '.join(TRAIN_MODELS)}, or pkg.module:factory (called with no arguments)")
    p.add_argument("--devices", default="cpu:0", type=va.device_list("--devices"),
                   help="comma-separated, e.g. cpu:0,cpu:1 or gpu:0,gpu:1")
    p.add_argument("--batch-size", type=va.int_in(1, MAX_BATCH, "--batch-size"), default=256,
                   help="global mini-batch, split across devices (at least one example per device); an "
                        "epoch's last batch with fewer examples than devices is skipped")
    p.add_argument("--lr", type=va.positive_float("--lr", max_value=MAX_LR), default=0.2)
    p.add_argument("--epochs", type=va.int_in(1, MAX_EPOCHS, "--epochs"), default=10)
    p.add_argument("--data", metavar="DIR|MODULE:FACTORY", type=data_source,
                   help="Fashion-MNIST IDX directory, or pkg.module:factory returning train or (train, test) "
                        "batches (default: embedded glyphs)")
    p.add_argument("--plan", default=None, type=plan_option,
                   help="auto: measure the plans valid here on the first batch and train on the fastest (printed "
                        "first); or pin one by name, e.g. 1x2,channels-last (replicas x threads, layout, ...)")
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


def _factory_text(text: str) -> bool:
    return ":" in text and not text.startswith(("/", ".", "~"))


def model_source(text: str) -> str:
    """A zoo model's name or ``pkg.module:factory``."""
    from .profile import target

    if text in TRAIN_MODELS:
        return text
    if _factory_text(text):
        return target(text)
    raise argparse.ArgumentTypeError(f"{text[:60]!r} is neither a model ({', '.join(TRAIN_MODELS)}) nor "
                                     "MODULE:FACTORY; give one, e.g. lenet or mypkg.nets:make_model")


def data_source(text: str) -> str:
    """A Fashion-MNIST directory, or ``pkg.module:factory`` returning batches."""
    from . import options as va
    from .profile import target

    return target(text) if _factory_text(text) else va.existing_dir("--data")(text)


def plan_option(text: str) -> object:
    """``auto`` or a plan's name, checked now (one line, exit 2)."""
    from ..parallel.plan import parse_plan

    if text == "auto":
        return text
    try:
        return parse_plan(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def train_config(args: argparse.Namespace, processes: int | None = None) -> TrainConfig:
    """The parsed options as a :class:`~dlperf.parallel.training.TrainConfig` (which checks them).

    Every option named like a config field is passed on, so a new option needs only its field and its
    ``add_argument``. ``processes``: how many will train (default: as this process was started).
    """
    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)
                          and f.name != "plan"}, processes=processes)


def check_in_parent(args: argparse.Namespace, processes: int, num_servers: int = 0) -> TrainConfig:
    """Check the options for ``processes`` processes (``num_servers`` of them parameter servers) before they
    start: a mistake is one line, not one a process."""
    from ..parallel.procs import check_process_settings
    from ..parallel.strategies import choose_strategy
    from .train_factory import uses_factories

    plan = getattr(args, "plan", None)
    if uses_factories(args):
        raise UsageError("MODULE:FACTORY models or data train in one process; drop them, or drop the process count")
    if plan is not None and not _runs_as(plan, processes):
        raise UsageError(f"--plan {getattr(plan, 'name', plan)} with {processes} processes: a plan with processes "
                         f"is measured and started by dlperf train; give --plan auto or --plan {processes}xT,processes "
                         "without --nproc-per-node, or drop --plan")
    choose_strategy(args.kvstore, processes=processes, num_servers=num_servers, cli=True)
    config = train_config(args, processes)
    check_resume(config)
    check_process_settings()
    return config


def run(args: argparse.Namespace) -> int:
    from ..parallel.launchers import in_launched_worker
    from .train_factory import run_factories, uses_factories

    _check_given_plan(args, uses_factories(args))
    if uses_factories(args):
        if _process_plan(args.plan) is not None:
            raise UsageError(f"--plan {args.plan.name} with MODULE:FACTORY models or data: those train in one "
                             "process; give a plan without processes")
        return run_factories(args)
    if args.plan is None or args.plan == "auto":
        recorded = _recorded_process_plan(args)
        args.plan = recorded if recorded is not None and args.nproc_per_node is None else args.plan
    plan = _process_plan(args.plan)
    # a launched process is one of the plan's processes already: it trains, it never starts more of them
    if plan is not None and args.nproc_per_node is None and not in_launched_worker():
        args.nproc_per_node = plan.replicas  # the plan's processes, started here as --nproc-per-node would
    if args.nproc_per_node is not None:
        return _launch(args)
    return _run(train_config(args), args.json, args.no_progress, args.plan)


def _here(args: argparse.Namespace, batch_size: int | None, processes: int):
    from ..parallel.launchers import in_launched_worker
    from ..parallel.plan_check import Here

    return Here(devices=args.devices, batch_size=batch_size, processes=processes, can_launch=not in_launched_worker(),
                allow_mixed_precision=True, check_finite=args.check_finite)


def _check_given_plan(args: argparse.Namespace, factories: bool) -> None:
    """``--plan NAME`` against this machine and this run, before anything starts: one line when it cannot run."""
    from ..parallel.launchers import rank_info
    from ..parallel.plan import Plan
    from ..parallel.plan_check import plan_problem

    if not isinstance(args.plan, Plan):
        return
    plan = args.plan.filled(algorithm=args.algorithm, bucket_bytes=args.bucket_bytes, kvstore=args.kvstore)
    # a factory's batches are its own: --batch-size does not size them; a plan against --nproc-per-node is
    # check_in_parent's to name (with how to launch it)
    here = _here(args, None if factories else args.batch_size, rank_info().world_size)
    problem = plan_problem(plan, here)
    if problem is not None:
        raise UsageError(f"--plan {args.plan.name}: {problem}; give a plan that fits this run, or --plan auto")


def _process_plan(plan: object):
    """``plan`` when it runs its replicas as processes, else None."""
    from ..parallel.plan import Plan

    return plan if isinstance(plan, Plan) and plan.launcher == "processes" else None


def _runs_as(plan: object, processes: int) -> bool:
    found = _process_plan(plan)
    return found is not None and found.replicas == processes


def _recorded_process_plan(args: argparse.Namespace):
    """The checkpoint's plan when it ran as processes and can run here (resuming starts as many), else None."""
    from ..parallel.checkpoint import load_checkpoint
    from ..parallel.plan import Plan
    from ..parallel.plan_check import usable_here

    if args.resume is None:
        return None
    recorded = load_checkpoint(args.resume)["trainer"].get("plan")
    if recorded is None:
        return None
    plan = _process_plan(Plan.from_dict(recorded, "the checkpoint's plan"))
    if plan is None:
        return None
    here = dataclasses.replace(_here(args, args.batch_size, 1), kvstore=args.kvstore)
    return usable_here(plan, here, f"the checkpoint {args.resume}", "training without it")


def _launch(args: argparse.Namespace) -> int:
    from ..parallel.launchers import rank_info
    from .launch import DEFAULT_TIMEOUT_S, start

    if rank_info().world_size > 1:
        raise UsageError(f"--nproc-per-node {args.nproc_per_node} in a process already started as one of "
                         f"{rank_info().world_size}; give the process count once, to dlperf launch or to dlperf train")
    config = check_in_parent(args, args.nproc_per_node)
    layout = argparse.Namespace(nproc_per_node=args.nproc_per_node, nnodes=1, node_rank=0, master=None,
                                num_servers=0, max_restarts=0, timeout=DEFAULT_TIMEOUT_S)
    return start(layout, _run, config, args.json, args.no_progress, args.plan)


def _run(config: TrainConfig, as_json: bool, no_progress: bool, plan: object = None) -> int:
    from ..parallel.launchers import in_launched_worker, rank_info
    from ..parallel.procs import last_exchange_report
    from ..parallel.servers import is_server_rank, server_ranks
    from ..parallel.training import serve

    if config.processes is None:
        config.processes = rank_info().world_size
    if is_server_rank(config.kvstore):  # the last --num-servers ranks hold the weights; they do not train
        serve(config)
        return 0
    if rank_info().rank != 0:  # one process reports: the others train silently
        return _quiet(config, plan)
    state = prepare(config)
    config.plan = _choose_plan(config, state, plan)
    chosen = _process_plan(config.plan)
    if chosen is not None and not in_launched_worker():  # planned here: train as the plan's processes, once
        return _launch_plan(config, as_json, no_progress, chosen)
    try:
        _train(config, state, show_progress=not (no_progress or as_json) and sys.stderr.isatty())
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated)
        said, status = stop_status(exc)
        kept = f"; {config.checkpoint} holds epoch {state.saved[-1]}" if state.saved else ""
        print(f"dlperf train: {said}{kept}", file=sys.stderr, flush=True)
        return status
    history = state.history
    per_epoch = state.seconds_per_epoch()
    acc = history[-1]["test_acc"] if history else float("nan")
    names = "[" + ", ".join(str(d) for d in config.devices) + "]"
    servers = server_ranks(config.kvstore)
    if config.processes > 1:
        names += f" x {config.processes - servers} processes"
        if servers:
            names += f" + {servers} server{'s' * (servers > 1)}"
    exchanges = last_exchange_report() if config.processes > 1 else None
    if exchanges is not None:  # before the d2l line, which stays the last
        print(exchanges.describe())
    print(f"test acc: {acc:.2f}, {per_epoch:.1f} sec/epoch on {names}")
    if as_json:
        print(json.dumps({"model": config.model, "devices": [str(d) for d in config.devices],
                          "processes": config.processes, "test_acc": acc, "sec_per_epoch": per_epoch,
                          "epochs": history, "exchanges": exchanges.as_dict() if exchanges else None}))
    return 0


def _choose_plan(config: TrainConfig, state: TrainState, plan: object) -> object:
    """The plan the run follows (printed first): the checkpoint's when resuming, measured on the first batch
    for ``auto``, or the one named."""
    from contextlib import closing

    import torch

    from ..parallel.plan import EXECUTIONS, Plan
    from ..parallel.planner import PlannerOptions
    from ..parallel.planning import plan_for

    if isinstance(plan, Plan):  # a plan by name leaves the store and algorithm to the run's options
        plan = plan.filled(algorithm=config.algorithm, bucket_bytes=config.bucket_bytes, kvstore=config.kvstore)
    recorded = state.resume["trainer"].get("plan") if state.resume is not None else None
    if recorded is not None:
        chosen = Plan.from_dict(recorded, "the checkpoint's plan")
        if plan is None or plan == "auto" or plan == chosen:
            print(f"plan: {chosen.summary()} (from the checkpoint)", flush=True)
            # the Trainer takes the checkpoint's plan over when it loads the state, except across processes
            return chosen if chosen.launcher == "processes" else None
    if plan == "auto" and state.resume is not None:
        print("plan: as the checkpoint was trained (it records no plan)", flush=True)
        return None
    if plan != "auto":
        if isinstance(plan, Plan):
            print(plan.line(), flush=True)
        return plan
    with closing(state.train_loader.epoch_batches(0)) as batches:
        X, y = next(iter(batches))
    steps = max(1, (config.epochs - len(state.history)) * len(state.train_loader))
    # a step captured from forward to update cannot hold the update back for --check-finite
    executions = [n for n in EXECUTIONS.names() if not EXECUTIONS.get(n).whole_step] if config.check_finite else None
    rng = torch.get_rng_state()  # planning must not move the weights the run starts from
    try:
        decision = plan_for(state.spec.build(), (X, y), config.device_list(), optimizer_params={"lr": config.lr},
                            loss=state.spec.loss, options=PlannerOptions(run_steps=steps, executions=executions),
                            processes=config.kvstore is None)
    finally:
        torch.set_rng_state(rng)
    print(decision.plan.line() + (" [cached]" if decision.cached else f" [planned in {decision.planning_s:.1f} s]"),
          flush=True)
    for skipped in decision.skipped:
        print(f"plan: skipped {skipped}", flush=True)
    return decision.plan


def _launch_plan(config: TrainConfig, as_json: bool, no_progress: bool, plan) -> int:
    """Train ``config`` as the ``plan``'s processes (the plan ``--plan auto`` chose in this process)."""
    from ..parallel.procs import check_process_settings
    from .launch import DEFAULT_TIMEOUT_S, start

    n = plan.replicas
    print(f"plan: starting {n} processes", flush=True)
    check_process_settings()
    config = dataclasses.replace(config, processes=n, plan=None)
    layout = argparse.Namespace(nproc_per_node=n, nnodes=1, node_rank=0, master=None, num_servers=0,
                                max_restarts=0, timeout=DEFAULT_TIMEOUT_S)
    return start(layout, _run, config, as_json, no_progress, plan)


def _quiet(config: TrainConfig, plan: object = None) -> int:
    from ..parallel.plan import Plan

    if isinstance(plan, Plan):  # the plan rank 0 names (printed there), for this rank's Trainer too
        config.plan = plan.filled(algorithm=config.algorithm, bucket_bytes=config.bucket_bytes,
                                  kvstore=config.kvstore)
    state = prepare(config)
    try:
        train(config, state)
    except KeyboardInterrupt as exc:
        return stop_status(exc)[1]
    return 0


def _train(config: TrainConfig, state: TrainState, show_progress: bool) -> None:
    train(config, state, on_epoch=lambda rec: print(epoch_line(rec), flush=True),
          on_message=lambda line: print(line, flush=True), show_progress=show_progress)

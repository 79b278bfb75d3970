"""``run_training``: one training run from its :class:`~dlperf.parallel.training.run_config.RunConfig` to its end,
as ``dlperf train`` runs it.

It starts the processes the launch section or a processes plan asks for (each runs this same function), serves
on a parameter-server rank, checks a checkpoint to resume, loads the data, chooses the plan (the checkpoint's,
one named, or :func:`~dlperf.parallel.training.planned.plan_for` on the first batch), and trains epoch by epoch,
saving a checkpoint after each. It prints nothing: notes go through :mod:`logging`, results to the
:class:`RunHooks` the caller gives (picklable functions: a launch calls them in other processes)::

    result = run_training(RunConfig(RunSection(model="lenet", devices="cpu:0,cpu:1", epochs=2)))
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import torch

from ...batch import batch_size
from ...devices import Device
from ..communication.process_group import check_process_settings
from ..launchers import LaunchConfig, ProcessLauncher, rank_info
from ..launchers.launch_config import RUN_TIMEOUT_S
from ..planning.plan import EXECUTIONS, Plan
from .checkpoint import CHECKPOINT_FORMAT, save_checkpoint
from .run_config import RunConfig, TrainState, check_resume, prepare
from .trainer import Trainer

__all__ = ["RunHooks", "RunResult", "run_training", "choose_plan", "train", "train_epochs", "serve", "launch_run",
           "describe_auto_choice"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunHooks:
    """What a run reports, to functions the caller gives: module-level functions, since a launch calls them in
    each of its processes. ``on_start()`` runs first in every process (set up logging there);
    ``on_epoch(record)`` and ``on_result(result)`` run on the first process only."""

    on_start: Callable[[], None] | None = None
    on_epoch: Callable[[dict[str, Any]], None] | None = None
    on_result: Callable[[RunResult], None] | None = None
    show_progress: bool = False


@dataclass
class RunResult:
    """A finished run as the first process saw it."""

    config: RunConfig
    history: list[dict[str, Any]]
    seconds_per_epoch: float
    devices: list[Device]
    """The devices the Trainer ran on in each process (a plan may use others than the run section named)."""
    processes: int
    servers: int
    plan: Plan | None
    exchanges: Any = None
    """The processes' exchange report (:class:`~dlperf.parallel.communication.process_group.ExchangeReport`)."""

    @property
    def test_acc(self) -> float:
        return self.history[-1]["test_acc"] if self.history else float("nan")


def run_training(config: RunConfig, hooks: RunHooks | None = None) -> RunResult | None:
    """Run ``config`` to its end (see the module's notes); the result on the first process, else None.

    Starting processes (``config.launch``, or a processes plan chosen or named in one process), each runs this
    same function; a failed launch raises :class:`~dlperf.parallel.launchers.LaunchError`.
    """
    from ..communication.servers import is_server_rank

    hooks = hooks or RunHooks()
    if hooks.on_start is not None:
        hooks.on_start()
    if config.launch is None and rank_info().world_size == 1:
        config = _as_recorded_processes(config)
    if config.launch is not None and rank_info().world_size == 1:
        check_resume(config)  # here, once, before any process starts: a mismatch is one line, not one a process
        check_process_settings()
        launch_run(config, hooks)
        return None
    if is_server_rank(config.trainer.kvstore):  # the last num_servers ranks hold the weights; they do not train
        serve(config)
        return None
    state = prepare(config)
    plan = choose_plan(config, state)
    if plan is not None and plan.launcher == "processes" and rank_info().world_size == 1:
        # chosen or named here: train as that many processes, each pinned to the plan
        pinned = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, plan=plan),
                                     launch=LaunchConfig(plan.replicas, join_timeout_s=RUN_TIMEOUT_S))
        launch_run(pinned, hooks)
        return None
    return train(config, state, plan, hooks)


def _as_recorded_processes(config: RunConfig) -> RunConfig:
    """A resumed run whose checkpoint was trained as a processes plan, to start as that many processes again."""
    from .checkpoint import load_checkpoint

    given = config.trainer.plan
    if not config.run.resume or not (given is None or given == "auto" or isinstance(given, Plan)):
        return config
    recorded = load_checkpoint(config.run.resume)["trainer"].get("plan")
    plan = Plan.from_dict(recorded, "the checkpoint's plan") if recorded is not None else None
    if plan is None or plan.launcher != "processes" or (isinstance(given, Plan) and given != plan):
        return config
    return dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, plan=plan),
                               launch=LaunchConfig(plan.replicas, join_timeout_s=RUN_TIMEOUT_S))


def choose_plan(config: RunConfig, state: TrainState) -> Plan | None:
    """The plan the run follows (said first): the checkpoint's when resuming, measured on the first batch for
    ``"auto"``, or the one named (None: as the trainer section says)."""
    from .planned import plan_for

    trainer, plan = config.trainer, config.trainer.plan
    if isinstance(plan, Plan):  # a plan by name leaves the store and algorithm to the run's options
        plan = plan.filled(algorithm=str(getattr(trainer.algorithm, "name", trainer.algorithm)),
                           bucket_bytes=trainer.bucket_bytes,
                           kvstore=trainer.kvstore if isinstance(trainer.kvstore, str) else None)
    recorded = state.resume["trainer"].get("plan") if state.resume is not None else None
    if recorded is not None:
        chosen = Plan.from_dict(recorded, "the checkpoint's plan")
        if plan is None or plan == "auto" or plan == chosen:
            log.info("plan: %s (from the checkpoint)", chosen.summary())
            return chosen
    if plan != "auto":
        if isinstance(plan, Plan) and rank_info().rank == 0:
            log.info(plan.line())
        return plan
    if state.resume is not None:
        log.info("plan: as the checkpoint was trained (it records no plan)")
        return None
    if rank_info().world_size > 1:  # every process would measure its own: they could disagree
        log.info("plan: kept as given (a run across processes plans in one process only)")
        return None
    with closing(state.train_loader.epoch_batches(0)) as batches:
        first = next(iter(batches), None)
    if first is None:
        from ...errors import UsageError

        raise UsageError("the training data gave no batch to plan on; check the data")
    epochs_left = config.run.epochs - len(state.history)
    steps = max(1, epochs_left * len(state.train_loader)) if len(state.train_loader) else None
    # a step captured from forward to update cannot hold the update back for check_finite
    executions = [n for n in EXECUTIONS.names() if not EXECUTIONS.get(n).whole_step] if trainer.check_finite \
        else config.planner.executions
    options = dataclasses.replace(config.planner, run_steps=steps, executions=executions)
    rng = torch.get_rng_state()  # planning must not move the weights the run starts from
    try:
        decision = plan_for(state.build_model(), first, config.devices, config=config.trainer_config(),
                            options=options, processes=trainer.kvstore is None)
    finally:
        torch.set_rng_state(rng)
    log.info("%s%s", decision.plan.line(),
             " [cached]" if decision.cached else f" [planned in {decision.planning_s:.1f} s]")
    for skipped in decision.skipped:
        log.info("plan: skipped %s", skipped)
    return decision.plan


def launch_run(config: RunConfig, hooks: RunHooks) -> None:
    """Run ``config`` as the processes its launch section names, each calling ``run_training``."""
    assert config.launch is not None
    launcher = ProcessLauncher(config.launch)
    if isinstance(config.trainer.plan, Plan):
        log.info("plan: starting %d processes", config.launch.nproc_per_node)
    launcher.launch(_launched, dataclasses.replace(config, launch=None), hooks)


def _launched(config: RunConfig, hooks: RunHooks) -> int:
    run_training(config, hooks)
    return 0


def serve(config: RunConfig) -> None:
    """On a parameter-server rank of a ``dist_*`` store: serve the workers' training to its end."""
    from ..communication.servers import serve_kvstore

    trainer = config.trainer
    serve_kvstore(str(trainer.kvstore), trainer.optimizer, trainer.optimizer_params)  # the workers' update


def describe_auto_choice(model: torch.nn.Module, devices: list, bucket_bytes: int | None = None) -> str:
    """Which algorithm ``algorithm="auto"`` takes for this model's gradient buckets, and why (one line)."""
    from ..allreduce import choose_algorithm
    from ..allreduce.auto import describe_bytes
    from ..communication.buckets import auto_bucket_bytes

    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in params]
    # the Trainer reduces buckets of up to auto_bucket_bytes; a larger parameter gets one of its own
    cap = auto_bucket_bytes(params) if bucket_bytes is None else bucket_bytes
    nbytes = max(min(sum(sizes), cap), max(sizes, default=0))
    # the Trainer pushes each bucket's phases to the engine, one operation per device lane, as backward fills it
    name, reason = choose_algorithm(nbytes, devices, workers=True)
    return f"allreduce: auto chose {name} for gradient buckets of {describe_bytes(nbytes)} ({reason})"


def train(config: RunConfig, state: TrainState, plan: Plan | None, hooks: RunHooks | None = None) -> RunResult:
    """Train from ``state`` up to the run's epochs, saving its checkpoint after every epoch (the first process
    writes it). Ctrl-C propagates, with ``state`` holding the finished epochs."""
    from ..communication.process_group import last_exchange_report
    from ..communication.servers import server_ranks

    run, rank, hooks = config.run, rank_info().rank, hooks or RunHooks()
    model = state.build_model()
    algorithm = getattr(config.trainer.algorithm, "name", config.trainer.algorithm)
    if algorithm == "auto" and config.trainer.kvstore is None and rank == 0:
        log.info(describe_auto_choice(model, config.devices, config.trainer.bucket_bytes))
    options = dataclasses.replace(config.trainer_config(plan, rank=rank), loss=state.loss)
    with Trainer(model, config.devices, config=options) as trainer:
        if state.resume is not None:
            _load(trainer, state.resume["trainer"], run.resume)
        if algorithm == "auto" and config.trainer.kvstore is None and trainer.processes is not None:
            from ..communication.process_group import describe_process_allreduce

            # collective: every process measures the links now, before the first step's sums wait on them
            for line in describe_process_allreduce(trainer.processes.group, choose=True):
                log.info(line)
        settings = config.checkpoint_settings()

        def record(rec: dict[str, Any]) -> None:
            state.history.append(rec)
            # kept before it is reported: an epoch on the screen is an epoch a Ctrl-C right after it keeps
            if run.checkpoint and trainer.rank == 0:
                save_checkpoint(run.checkpoint, {"format": CHECKPOINT_FORMAT, "config": settings,
                                                 "history": state.history, "trainer": trainer.state_dict()})
                state.saved.append(rec["epoch"])
            if hooks.on_epoch is not None and trainer.rank == 0:
                hooks.on_epoch(rec)

        train_epochs(trainer, state.train_loader, state.test_loader, len(state.history), run.epochs,
                     hooks.show_progress and trainer.rank == 0, record)
        devices, world = list(trainer.devices), trainer.world
    processes = config.processes
    result = RunResult(config, state.history, state.seconds_per_epoch(), devices, processes,
                       server_ranks(config.trainer.kvstore), trainer.plan,
                       last_exchange_report() if processes > 1 else None)
    if hooks.on_result is not None and rank == 0 and world >= 1:
        hooks.on_result(result)
    return result


def _load(trainer: Trainer, state: dict[str, Any], source: str | None) -> None:
    from ...errors import UsageError

    try:
        trainer.load_state_dict(state)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise UsageError(f"resume={source}: the checkpoint does not fit this model "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})") from None


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
    examples than devices is skipped (at most ``devices - 1`` examples an epoch; across processes, the
    devices of all processes, and every process skips the same batch). The loss is the mean over
    every process's examples.
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
                    if batch_size(X, "input") < trainer.total_devices:
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
            # each process's loss is its part of the batch's mean: one sum per epoch, not per step
            loss_sum = trainer.sum_across_processes(torch.as_tensor(loss_sum, dtype=torch.float32))
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

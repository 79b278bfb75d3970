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

import copy
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import torch

from ...batch import batch_size
from ...devices import Device
from ...errors import UsageError
from ..communication.process_group import check_process_settings
from ..launchers import LaunchConfig, ProcessLauncher, in_launched_worker, rank_info
from ..launchers.launch_config import RUN_TIMEOUT_S
from ..planning.plan import EXECUTIONS, Plan
from ..planning.plan_check import plan_problem, usable_here
from .checkpoint import CHECKPOINT_FORMAT, save_checkpoint
from .run_config import RunConfig, TrainState, check_resume, prepare, run_here
from .trainer import Trainer

__all__ = ["RunHooks", "RunResult", "run_training", "choose_plan", "train", "train_epochs", "serve", "launch_run",
           "describe_auto_choice"]

log = logging.getLogger(__name__)

_ANNOUNCED = "DLPERF_PLAN_ANNOUNCED"
"""Set for the processes a run starts for its plan, whose line the starting process printed already."""


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
        return self.history[-1].get("test_acc", float("nan")) if self.history else float("nan")

    @property
    def test_loss(self) -> float | None:
        """The last epoch's test loss, where the metric is the loss (targets that are not class labels)."""
        return self.history[-1].get("test_loss") if self.history else None


def run_training(config: RunConfig, hooks: RunHooks | None = None) -> RunResult | None:
    """Run ``config`` to its end (see the module's notes); the result on the first process, else None.

    Starting processes (``config.launch``, or a processes plan chosen or named in one process), each runs this
    same function; a failed launch raises :class:`~dlperf.parallel.launchers.LaunchError`.
    """
    from ..communication.servers import is_server_rank

    hooks = hooks or RunHooks()
    if hooks.on_start is not None:
        hooks.on_start()
    launched = in_launched_worker()  # one of the processes already: it trains, it never starts more
    if config.launch is None and not launched:
        config = _as_recorded_processes(config)
    if config.launch is not None and not launched:
        check_resume(config)  # here, once, before any process starts: a mismatch is one line, not one a process
        check_process_settings()
        launch_run(config, hooks)
        return None
    if is_server_rank(config.trainer.kvstore):  # the last num_servers ranks hold the weights; they do not train
        serve(config)
        return None
    state = prepare(config)
    plan = choose_plan(config, state)
    if plan is not None and plan.launcher == "processes" and not launched:
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
    here = dataclasses.replace(run_here(config), processes=1)
    if usable_here(plan, here, f"the checkpoint {config.run.resume}", "training without it") is None:
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
        problem = plan_problem(plan, run_here(config))
        if problem is not None:  # named by the user: refused, not ignored (they asked for it)
            from ...errors import UsageError

            raise UsageError(f"plan={plan.name}: {problem}; give a plan that fits this run, or plan=auto")
    recorded = state.resume["trainer"].get("plan") if state.resume is not None else None
    if recorded is not None:
        chosen = Plan.from_dict(recorded, "the checkpoint's plan")
        if plan is None or plan == "auto" or plan == chosen:
            log.info("plan: %s (from the checkpoint)", chosen.summary())
            return chosen
    if plan != "auto":
        if isinstance(plan, Plan) and rank_info().rank == 0 and not os.environ.get(_ANNOUNCED):
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
    log.info("%s [%s]", decision.plan.line(), decision.provenance())
    for skipped in decision.skipped:
        log.info("plan: skipped %s", skipped)
    return decision.plan


def launch_run(config: RunConfig, hooks: RunHooks) -> None:
    """Run ``config`` as the processes its launch section names, each calling ``run_training``."""
    assert config.launch is not None
    launcher = ProcessLauncher(config.launch)
    announced = isinstance(config.trainer.plan, Plan)
    if announced:
        log.info("plan: starting %d processes", config.launch.nproc_per_node)
    os.environ[_ANNOUNCED] = "1" if announced else ""  # the processes do not print the plan line again
    # each process's share of the run: checked as a whole here already, so not again by dataclasses.replace,
    # which would check it as the one process this launcher is
    share = copy.copy(config)
    share.launch = None
    try:
        launcher.launch(_launched, share, hooks)
    finally:
        os.environ.pop(_ANNOUNCED, None)


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
    options = dataclasses.replace(config.trainer_config(plan, rank=rank), loss=state.loss,
                                  schedule_steps=_schedule_steps(config, state))
    with Trainer(model, config.devices, config=options) as trainer:
        if state.resume is not None:
            _load(trainer, state.resume["trainer"], run.resume)
        if algorithm == "auto" and config.trainer.kvstore is None and trainer.processes is not None:
            from ..communication.process_group import describe_process_allreduce

            # collective: every process measures the links now, before the first step's sums wait on them
            lines = describe_process_allreduce(trainer.processes.group, choose=True)
            if rank == 0:  # one account of the choice, not one per process
                for line in lines:
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


def _schedule_steps(config: RunConfig, state: TrainState) -> int | None:
    """The updates of the whole run (resumed epochs included) a named learning-rate schedule spans."""
    if not isinstance(config.trainer.lr_schedule, str):
        return config.trainer.schedule_steps
    batches = len(state.train_loader)
    if not batches:
        from ...errors import UsageError

        raise UsageError(f"lr_schedule={config.trainer.lr_schedule} spans the run, whose length the data does not "
                         "say (it has no len()); give data with a length, or a factory optimizer -> scheduler")
    return max(1, config.run.epochs * -(-batches // config.trainer.accumulate))


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
    every process's examples. An epoch that trains on nothing (no batch, or every batch skipped) or a test
    pass without an example raises :class:`UsageError`: a loss of 0 and an accuracy of 0 would look like results.
    """
    history = []
    for epoch in range(first_epoch, epochs):
        bar = _progress(show_progress, len(train_loader), f"epoch {epoch + 1}/{epochs}")
        loss_sum: torch.Tensor | float = 0.0
        # the first step whose loss was NaN/inf, kept on the device and read with loss_sum at the end
        first_bad: torch.Tensor | None = None
        batches = given = largest = 0
        try:
            start = time.perf_counter()
            # closing(): after Ctrl-C the loader's thread stops now, not when the traceback is freed
            with closing(train_loader.epoch_batches(epoch)) as train_batches:
                for X, y in train_batches:
                    n = batch_size(X, "input")
                    given, largest = given + 1, max(largest, n)
                    if n < trainer.total_devices:
                        continue  # only an epoch's last batch can be this short: see the docstring
                    # summed where it is: reading it on the host every step would stall a GPU's queue
                    loss = trainer.train_step(X, y).detach().float()
                    loss_sum = loss_sum + loss
                    bad = torch.where(torch.isfinite(loss), float("inf"), float(trainer.steps))
                    first_bad = bad if first_bad is None else torch.minimum(first_bad, bad)
                    batches += 1
                    if bar:
                        bar.advance(0, 1)
            if batches == 0:
                raise UsageError(_nothing_trained(epoch, first_epoch, given, largest, trainer.total_devices))
            trainer.flush()  # micro-batches accumulated past the last update: an update on what the epoch has
            for d in trainer.devices:
                d.synchronize()
            seconds = time.perf_counter() - start  # (every step's loss is the batch's mean in every process)
        finally:
            if bar:
                bar.stop()
        tested = [0]
        metric = "test_acc" if _classifies(trainer, test_loader) else "test_loss"
        with closing(test_loader.epoch_batches(0)) as test_batches:
            counted = _counted(test_batches, tested)
            test_value = trainer.evaluate_accuracy(counted) if metric == "test_acc" else trainer.evaluate_loss(counted)
        if tested[0] == 0:
            raise UsageError(f"the test data gave no example after epoch {epoch + 1}, so there is no accuracy to "
                             "report; give test batches with examples, from a source that can be iterated once per "
                             "epoch (a list or a DataLoader, not a generator; without a test set the training data "
                             "is evaluated)")
        record = {"epoch": epoch + 1, "loss": float(loss_sum) / max(batches, 1), metric: test_value,
                  "seconds": seconds}
        if first_bad is not None and float(first_bad) != float("inf"):
            record["nonfinite_since_step"] = int(first_bad)
        history.append(record)
        if on_epoch:
            on_epoch(record)
    return history


def _classifies(trainer: Trainer, test_loader: Any) -> bool:
    """Whether the test data's labels are class labels (accuracy is its metric), else its mean loss is: a
    regressor's float targets have no accuracy. Read from the first test batch's labels."""
    from ...losses import labels_of

    with closing(test_loader.epoch_batches(0)) as batches:
        first = next(iter(batches), None)
    if first is None:
        return True
    labels = labels_of(*first)
    return isinstance(labels, torch.Tensor) and not labels.is_floating_point() and labels.dtype != torch.bool


def _counted(batches, count: list[int]):
    """``batches`` passed through, their examples added to ``count[0]``."""
    for X, y in batches:
        count[0] += batch_size(X, "input")
        yield X, y


def _nothing_trained(epoch: int, first_epoch: int, given: int, largest: int, devices: int) -> str:
    """Why epoch ``epoch`` took no step, in one line with the fix."""
    if given == 0 and epoch > first_epoch:
        return (f"the training data gave no batch in epoch {epoch + 1} (it did in epoch {first_epoch + 1}): it runs "
                "dry after one pass, as a generator does; give a source that can be iterated once per epoch (a list "
                "or a DataLoader)")
    if given == 0:
        return (f"the training data gave no batch in epoch {epoch + 1}, so nothing would train; give at least one "
                "(inputs, targets) batch")
    if largest == 0:
        return (f"every batch of epoch {epoch + 1} ({given}) holds 0 examples, so nothing would train; give "
                "batches with examples along the first axis")
    return (f"every batch of epoch {epoch + 1} ({given}, the largest of {largest} examples) is smaller than the "
            f"{devices} devices a step splits it across, each needing one example, so each was skipped and nothing "
            f"would train; give batches of at least {devices} examples or train on fewer devices (replicas)")

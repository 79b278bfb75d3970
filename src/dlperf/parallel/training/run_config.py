"""One training run's configuration, in sections (:class:`RunConfig`), and what it prepares before training: the
checkpoint to resume, checked, and the data.

The model is a zoo network or ``pkg.module:factory`` (called with no arguments); the data the embedded glyphs,
Fashion-MNIST IDX files, or ``pkg.module:factory`` returning ``train`` or ``(train, test)``, each an iterable of
``(inputs, targets)`` pairs or mapping batches that carry their labels (HuggingFace's convention).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..._io import check_writable
from ...batch import describe
from ...devices import Device, to_device
from ...errors import UsageError, blame_user_code
from ..launchers import LaunchConfig, in_launched_worker, rank_info, restart_count
from ..planning.plan import Plan
from ..planning.plan_check import ANY, Here, keep_usable_plan
from ..planning.records import PlannerOptions
from ..split import check_devices
from ..strategies import STRATEGIES, choose_strategy
from .checkpoint import load_checkpoint
from .resume import history_problem, trainer_state_problem
from .trainer_config import TrainerConfig

__all__ = ["RunSection", "RunConfig", "TrainState", "FactoryBatches", "check_resume", "prepare", "parse_devices",
           "step_args", "is_factory", "run_here", "TRAIN_MODELS", "MAX_BATCH", "MAX_EPOCHS", "MAX_LR",
           "MAX_BUCKET_BYTES"]

TRAIN_MODELS = ("lenet", "resnet18")
MAX_BATCH = 2**24
MAX_EPOCHS = 100_000
MAX_LR = 100.0  # beyond this SGD on these models only diverges to NaN
MAX_BUCKET_BYTES = 2**40
# The embedded dataset keeps each uint8 image and its int64 label, plus two int64 permutations.
_STORED_EXAMPLE_BYTES = 28 * 28 + 3 * 8


def is_factory(text: str | None) -> bool:
    """Whether a model or data source names ``pkg.module:factory`` (not a zoo name or a directory)."""
    return text is not None and ":" in text and not text.startswith(("/", ".", "~"))


def parse_devices(text: str | list) -> list:
    """``"cpu:0,cpu:1"`` -> ``[cpu(0), cpu(1)]``."""
    if not isinstance(text, str):  # already parsed
        return list(text)
    parts = [t for t in (s.strip() for s in text.split(",")) if t]
    if not parts:
        raise UsageError("devices='' is empty; give e.g. 'cpu:0,cpu:1'")
    return [to_device(t) for t in parts]


@dataclass
class RunSection:
    """What to train, on which data and devices, for how long, and where its state goes."""

    model: str = "lenet"
    """A zoo network (``TRAIN_MODELS``) or ``pkg.module:factory`` returning a ``torch.nn.Module``."""
    data: str | None = None
    """Fashion-MNIST IDX directory, ``pkg.module:factory`` returning batches, or None (the embedded glyphs)."""
    devices: list[Device] | str = "cpu:0"
    """Devices sharing each mini-batch (``"cpu:0,cpu:1"`` or a list); parsed into a list of Device."""
    batch_size: int = 256
    """Global mini-batch of the embedded or IDX data, split across the devices of every process."""
    epochs: int = 10
    """Epochs to reach, counting those a resumed checkpoint already holds."""
    seed: int = 0
    """Seed for the weights and the data order."""
    train_size: int = 12000
    """Embedded dataset: training images."""
    test_size: int = 2000
    """Embedded dataset: test images."""
    download: bool = False
    """Download Fashion-MNIST into ``data`` first."""
    checkpoint: str | None = None
    """File the state is saved to, atomically, after every epoch."""
    resume: str | None = None
    """Checkpoint to continue from, bit-identically."""
    resume_hparams_from_checkpoint: bool = False
    """Resume with the optimizer hyperparameters the checkpoint holds (checked for range), not the run's."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "epochs", "train_size", "test_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name}={value!r}: expected an integer >= 1")
        if not is_factory(self.model) and self.model not in TRAIN_MODELS:
            raise UsageError(f"model={self.model!r}: expected one of {', '.join(TRAIN_MODELS)} or "
                             "'pkg.module:factory'")
        if self.download and not self.data:
            raise UsageError("download=True needs data=DIR to download into; give data or drop download")
        if self.data and not is_factory(self.data) and not self.download and not os.path.isdir(self.data):
            raise UsageError(f"data={self.data!r} does not exist; give the directory holding the Fashion-MNIST IDX "
                             "files, or download=True to fetch them into it")
        if self.resume_hparams_from_checkpoint and not self.resume:
            raise UsageError("resume_hparams_from_checkpoint=True needs resume=FILE to take them from")
        self.devices = check_devices(parse_devices(self.devices))  # fail before any data is made or read


@dataclass
class RunConfig:
    """One run in sections: what and where (``run``), how the Trainer trains (``trainer``: optimizer and its
    ``lr``, loss, gradient strategy, plan), how ``plan="auto"`` plans (``planner``), and the processes to
    start on this host (``launch``; None: as this process was started). Checked as a whole when made."""

    run: RunSection = field(default_factory=RunSection)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig("sgd", {"lr": 0.2}))
    planner: PlannerOptions = field(default_factory=PlannerOptions)
    launch: LaunchConfig | None = None

    def __post_init__(self) -> None:
        lr = self.lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr <= MAX_LR:  # also NaN
            raise UsageError(f"lr={lr!r}: expected a number > 0 and <= {MAX_LR:g}")
        run = self.run
        if not is_factory(run.model):
            from ..._cliargs import batch_bytes, require_memory
            from ...models import get_spec

            require_memory(batch_bytes(get_spec(run.model), run.batch_size, training=True),
                           f"batch_size={run.batch_size} on {run.model}", "give a smaller batch_size")
        if run.data is None:
            from ..._cliargs import require_memory

            require_memory((run.train_size + run.test_size) * _STORED_EXAMPLE_BYTES,
                           f"train_size={run.train_size} test_size={run.test_size}", "give smaller sizes")
        total = self.processes * len(self.devices)
        if run.batch_size < total:
            where = f"{len(self.devices)} devices" if self.processes == 1 else \
                f"{total} devices ({self.processes} processes x {len(self.devices)})"
            raise UsageError(f"batch_size={run.batch_size} is smaller than the {where}; each device needs at least "
                             f"one example per step: give batch_size={total} or more")
        choose_strategy(self.trainer.kvstore, devices=self.devices, processes=self.processes,
                        update_on_kvstore=self.trainer.update_on_kvstore, strategy=self.trainer.strategy)
        if run.checkpoint:
            try:
                check_writable(run.checkpoint)  # now, not after the first epoch
            except OSError as exc:
                raise UsageError(f"checkpoint={run.checkpoint!r}: {exc}") from None

    @property
    def devices(self) -> list[Device]:
        """Each process's devices, as the run section parsed them."""
        return list(self.run.devices)  # type: ignore[arg-type]  # (parsed in RunSection.__post_init__)

    @property
    def lr(self) -> float:
        return (self.trainer.optimizer_params or {}).get("lr", 0.0)

    @property
    def processes(self) -> int:
        """How many processes train together (the launch's, else as this process was started)."""
        return self.launch.nproc_per_node * self.launch.nnodes if self.launch else rank_info().world_size

    def checkpoint_settings(self) -> dict[str, Any]:
        """The settings a checkpoint records; resuming needs them all equal."""
        run, trainer = self.run, self.trainer
        settings = {"model": run.model, "devices": len(self.devices), "batch_size": run.batch_size, "lr": self.lr,
                    "data": run.data, "train_size": run.train_size, "test_size": run.test_size, "seed": run.seed,
                    "algorithm": getattr(trainer.algorithm, "name", trainer.algorithm), "kvstore": trainer.kvstore}
        if self.processes > 1:  # absent for one process: older checkpoints still match
            settings["processes"] = self.processes
        # what the update does, recorded where it is not the default (older checkpoints still match)
        optimizer = trainer.optimizer if isinstance(trainer.optimizer, str) else "factory"
        for key, value, default in (("optimizer", optimizer, "sgd"), ("lr_schedule", trainer.lr_schedule, None),
                                    ("accumulate", trainer.accumulate, 1),
                                    ("clip_grad_norm", trainer.clip_grad_norm, None)):
            if value != default:
                settings[key] = value if isinstance(value, str | int | float) else "factory"
        return settings

    def trainer_config(self, plan: Plan | None = None, *, rank: int = 0) -> TrainerConfig:
        """The Trainer's options for this run: its section, with the planner's and the plan in force."""
        # one timeline per run: the first process's (the others would write the same file)
        return dataclasses.replace(self.trainer, planner=self.planner, plan=plan,
                                   trace=self.trainer.trace if rank == 0 else None)


def step_args(batch: Any, what: str = "a train batch") -> tuple[Any, Any]:
    """A data batch as a training step takes it: ``(inputs, targets)`` from a pair, ``(batch, None)`` from a
    mapping that carries its labels; anything else is one line naming it."""
    if isinstance(batch, Mapping):
        return batch, None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise UsageError(f"{what} is {describe(batch)}; the data's batches must be (inputs, targets) pairs or "
                     "mappings that carry their labels")


class FactoryBatches:
    """An iterable of a data factory's batches, seen as the loaders the epochs take (one pass per epoch)."""

    def __init__(self, batches: Iterable[Any], what: str) -> None:
        self.batches, self.what = batches, what

    def __len__(self) -> int:
        try:
            return len(self.batches)  # type: ignore[arg-type]
        except TypeError:
            return 0

    def epoch_batches(self, epoch: int) -> Iterator[tuple[Any, Any]]:
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
            yield step_args(batch, f"{self.what} batch {i}")
            i += 1


@dataclass
class TrainState:
    """A run in progress: the model's builder, the data, the checkpoint resumed from, what is finished so far.

    It outlives an interrupted :func:`train`, so the caller can say which epoch the checkpoint holds.
    """

    build_model: Callable[[], torch.nn.Module]
    """Builds the model (the zoo network's builder, or the user's factory)."""
    loss: Any
    """The loss the run's Trainer minimises (the trainer section's, else the zoo network's)."""
    train_loader: Any
    test_loader: Any
    resume: dict[str, Any] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    """One record per finished epoch, those resumed first: epoch, loss, test_acc, seconds."""
    saved: list[int] = field(default_factory=list)
    """Epochs whose checkpoint this run wrote."""
    first: int = 0
    """How many epochs the resumed checkpoint held (this run's first epoch index)."""

    def seconds_per_epoch(self) -> float:
        """Mean training seconds of this run's epochs (of the resumed ones when this run finished none)."""
        timed = [h["seconds"] for h in self.history[self.first:]] or [h["seconds"] for h in self.history]
        return sum(timed) / len(timed) if timed else 0.0


def _model_builder(run: RunSection) -> tuple[Callable[[], torch.nn.Module], Any]:
    """The run's model builder and the zoo network's loss (None for a factory: the trainer section's rule)."""
    if is_factory(run.model):
        from ...probe.targets import build_model

        return (lambda: build_model(run.model)), None
    from ...models import get_spec

    spec = get_spec(run.model)
    return spec.build, spec.loss


def _factory_data(source: str) -> tuple[FactoryBatches, FactoryBatches]:
    from ...probe.targets import load_factory

    try:
        made = load_factory(source)()
    except UsageError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 (user code)
        raise UsageError(f"{source}() raised {type(exc).__name__}: {exc}; fix the data factory") from None
    train, test = made if isinstance(made, tuple) and len(made) == 2 else (made, made)
    for part, name in ((train, "train"), (test, "test")):
        if not isinstance(part, Iterable):
            raise UsageError(f"{source}() gave a {type(part).__name__} as its {name} set; return an iterable of "
                             "batches, e.g. a DataLoader, or a (train, test) pair of them")
    return FactoryBatches(train, "train"), FactoryBatches(test, "test")


def run_here(config: RunConfig) -> Here:
    """What a checkpoint's or a named plan must fit to run in ``config``: its devices, global batch (a factory's
    batches are its own: not sized by ``batch_size``), processes, finiteness check and store. Mixed precision is
    allowed (a checkpoint's run chose it; it still needs GPUs)."""
    run = config.run
    return Here(devices=config.devices, batch_size=None if is_factory(run.data) else run.batch_size,
                processes=config.processes, can_launch=not in_launched_worker(), allow_mixed_precision=True,
                check_finite=config.trainer.check_finite,
                kvstore=config.trainer.kvstore if isinstance(config.trainer.kvstore, str | None) else ANY)


def check_resume(config: RunConfig) -> dict[str, Any] | None:
    """The checkpoint ``config.run.resume`` names, read and checked against ``config`` (None without one).

    Every field is checked against the run: its settings, the model's weights and buffers, the optimizer's
    hyperparameters and state, the step counter and the history (:func:`prepare` checks the step counter
    against the data's batches once they are loaded). A problem is one :class:`UsageError` line naming it.
    """
    run = config.run
    if not run.resume:
        return None
    resume = load_checkpoint(run.resume)
    settings = config.checkpoint_settings()
    if resume["config"] != settings:
        was = resume["config"]
        diff = {k: (was.get(k), settings.get(k)) for k in sorted({*was, *settings}) if was.get(k) != settings.get(k)}
        raise UsageError(f"resume={run.resume}: settings differ from the checkpoint's (was, now): {diff}")
    devices = config.devices
    strategy = STRATEGIES.get(choose_strategy(config.trainer.kvstore, devices=devices, processes=config.processes,
                                              update_on_kvstore=config.trainer.update_on_kvstore,
                                              strategy=config.trainer.strategy))
    trainer = resume["trainer"]
    keep_usable_plan(trainer, run_here(config), f"the checkpoint {run.resume}")
    build, _ = _model_builder(run)
    problem = trainer_state_problem(
        trainer, model=build(), devices=len(devices), make_reference=lambda params: _as_trained(config, params),
        on_store=strategy.state_key == "kvstore", from_checkpoint=run.resume_hparams_from_checkpoint)
    problem = problem or history_problem(resume["history"], trainer["steps"], epochs=run.epochs,
                                         batches_per_epoch=None)
    if problem:
        raise UsageError(f"resume={run.resume}: {problem}")
    return resume


def _as_trained(config: RunConfig, params: Any) -> torch.optim.Optimizer:
    """The optimizer a run of ``config`` trains with, as the Trainer makes it (a schedule adds its own keys)."""
    from ..optimizers import make_schedule

    optimizer = config.trainer.new_optimizer(params)
    if config.trainer.lr_schedule is not None:
        make_schedule(config.trainer.lr_schedule, optimizer, 1)
    return optimizer


def prepare(config: RunConfig) -> TrainState:
    """Check the checkpoint to resume against ``config``, seed torch and load the data: all before training."""
    from ...data import load_data

    run = config.run
    if run.resume is None and run.checkpoint and restart_count() > 0 and os.path.exists(run.checkpoint):
        # restarted by the launcher after a failure: continue from the last epoch the checkpoint holds
        run.resume = run.checkpoint
    resume = check_resume(config)  # before the data is read: a mismatch is reported at once
    torch.manual_seed(run.seed)
    build, zoo_loss = _model_builder(run)
    train_loader: Any
    test_loader: Any
    if is_factory(run.data):
        train_loader, test_loader = _factory_data(run.data)  # type: ignore[arg-type]
    else:
        train_loader, test_loader = load_data(run.batch_size, run.data, seed=run.seed, train=run.train_size,
                                              test=run.test_size, download=run.download)
    if resume is not None and len(train_loader):  # the step counter against the data's batches, known now
        problem = history_problem(resume["history"], resume["trainer"]["steps"], epochs=run.epochs,
                                  batches_per_epoch=-(-len(train_loader) // config.trainer.accumulate))
        if problem:
            raise UsageError(f"resume={run.resume}: {problem}")
    history = list(resume["history"]) if resume else []
    loss = config.trainer.loss if config.trainer.loss is not None else zoo_loss
    return TrainState(build, loss, train_loader, test_loader, resume, history, first=len(history))

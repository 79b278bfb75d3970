"""Data-parallel training of a zoo model for some epochs, with checkpoints (d2l 12.5-12.6).

:class:`TrainConfig` says what to train; :func:`prepare` checks it against a checkpoint to resume and
loads the data; :func:`train` runs the epochs. ``dlperf train`` is these three and its printing::

    config = TrainConfig(model="lenet", devices=["cpu:0", "cpu:1"], epochs=2)
    state = prepare(config)
    train(config, state, on_epoch=print)

Started as several processes (``dlperf launch``, ``dlperf train --nproc-per-node N``, ``torchrun``), every
process runs these same three with the same config: each loads the same data and trains on its slice of
every global batch, the first process alone writes the checkpoint, and every process can resume from it.
A process group the launcher restarts after a failure resumes from ``checkpoint`` by itself. With a
``dist_*`` kvstore the job's last ``DLPERF_NUM_SERVERS`` ranks are parameter servers: they call
:func:`serve` instead (see :mod:`~dlperf.parallel.servers`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import torch

from .._io import check_writable
from ..batch import batch_size
from ..devices import Device, to_device
from ..errors import UsageError
from .allreduce import DEFAULT_ALGORITHM, get_algorithm
from .checkpoint import CHECKPOINT_FORMAT, load_checkpoint, save_checkpoint
from .launchers import rank_info, restart_count
from .optimizers import make_optimizer
from .plan_check import keep_usable_plan, run_here
from .resume import HPARAMS_FLAG, history_problem, trainer_state_problem
from .split import check_devices
from .strategies import STRATEGIES, choose_strategy
from .trainer import Trainer
from .trainer_config import TrainerConfig

__all__ = ["TrainConfig", "TrainState", "check_resume", "prepare", "serve", "train", "train_epochs", "epoch_line",
           "parse_devices", "TRAIN_MODELS", "MAX_BATCH", "MAX_EPOCHS", "MAX_LR"]

TRAIN_MODELS = ("lenet", "resnet18")
MAX_BATCH = 2**24
MAX_EPOCHS = 100_000
MAX_LR = 100.0  # beyond this SGD on these models only diverges to NaN
MAX_BUCKET_BYTES = 2**40
# The embedded dataset keeps each uint8 image and its int64 label, plus two int64 permutations.
_STORED_EXAMPLE_BYTES = 28 * 28 + 3 * 8


def parse_devices(text: str | list) -> list:
    """``"cpu:0,cpu:1"`` -> ``[cpu(0), cpu(1)]``."""
    if not isinstance(text, str):  # already parsed by the option's type
        return list(text)
    parts = [t for t in (s.strip() for s in text.split(",")) if t]
    if not parts:
        raise UsageError("--devices is empty; give e.g. cpu:0,cpu:1")
    return [to_device(t) for t in parts]


@dataclass
class TrainConfig:
    """One training run; every field is checked when the config is made, before any data is read."""

    model: str = "lenet"
    """Zoo network to train: one of TRAIN_MODELS."""
    devices: list[Device] | str = "cpu:0"
    """Devices sharing each mini-batch (``"cpu:0,cpu:1"`` or a list); parsed into a list of Device."""
    batch_size: int = 256
    """Global mini-batch, split across the devices (at least one example per device)."""
    lr: float = 0.2
    """SGD learning rate, > 0 and <= MAX_LR."""
    epochs: int = 10
    """Epochs to reach, counting those a resumed checkpoint already holds."""
    data: str | None = None
    """Fashion-MNIST IDX directory; None trains on the embedded glyph dataset."""
    download: bool = False
    """Download Fashion-MNIST into ``data`` first."""
    train_size: int = 12000
    """Embedded dataset: training images."""
    test_size: int = 2000
    """Embedded dataset: test images."""
    algorithm: str = DEFAULT_ALGORITHM
    """Allreduce algorithm by name (``auto``: the cost model's pick for the measured links)."""
    kvstore: str | None = None
    """Aggregate through a KVStore of this type instead of allreduce."""
    bucket_bytes: int | None = None
    """Gradient bucket size (None: the Trainer's default); smaller buckets are reduced during backward."""
    seed: int = 0
    """Seed for the weights and the data order."""
    checkpoint: str | None = None
    """File the state is saved to, atomically, after every epoch."""
    resume: str | None = None
    """Checkpoint to continue from, bit-identically."""
    resume_hparams_from_checkpoint: bool = False
    """Resume with the optimizer hyperparameters the checkpoint holds (checked for range), not the run's."""
    check_finite: bool = False
    """Stop at the first step whose loss or gradients are NaN/inf, before it updates the weights."""
    trace: str | None = None
    """File the engine's timeline of the run is written to (Chrome trace JSON; ``dlperf trace FILE``)."""
    processes: int | None = None
    """Processes training together (``devices`` are each one's own); None: as the launcher started this one."""
    plan: Any = None
    """The :class:`~dlperf.parallel.plan.Plan` the Trainer follows (None: as the options say; see TrainerConfig)."""

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_data()
        from .._cliargs import batch_bytes, require_memory
        from ..models import get_spec

        require_memory(batch_bytes(get_spec(self.model), self.batch_size, training=True),
                       f"--batch-size {self.batch_size} on {self.model}", "give a smaller --batch-size")
        devices = self.devices = check_devices(parse_devices(self.devices))  # fail before any data is made or read
        if self.processes is None:
            self.processes = rank_info().world_size
        total = self.processes * len(self.devices)
        where = f"{len(self.devices)} devices" if self.processes == 1 else \
            f"{total} devices ({self.processes} processes x {len(self.devices)})"
        if self.batch_size < total:
            raise UsageError(f"--batch-size {self.batch_size} is smaller than the {where}; each device needs at "
                             f"least one example per step: use --batch-size {total} or more")
        get_algorithm(self.algorithm)
        choose_strategy(self.kvstore, devices=devices, processes=self.processes, cli=True)
        if self.resume_hparams_from_checkpoint and not self.resume:
            raise UsageError(f"{HPARAMS_FLAG} needs --resume FILE to take them from; add it or drop the option")
        if self.checkpoint:
            try:
                check_writable(self.checkpoint)  # now, not after the first epoch
            except OSError as exc:
                raise UsageError(f"--checkpoint: {exc}") from None

    def _check_numbers(self) -> None:
        if self.processes is not None and self.processes < 1:
            raise UsageError(f"processes={self.processes}: expected at least 1")
        for name in ("batch_size", "epochs", "train_size", "test_size"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.lr <= MAX_LR:  # also NaN
            raise UsageError(f"--lr must be > 0 and <= {MAX_LR:g}, got {self.lr}")
        if self.bucket_bytes is not None and not 1 <= self.bucket_bytes <= MAX_BUCKET_BYTES:
            raise UsageError(f"--bucket-bytes must be between 1 and {MAX_BUCKET_BYTES}, got {self.bucket_bytes}")

    def _check_data(self) -> None:
        from .._cliargs import require_memory

        if self.download and not self.data:
            raise UsageError("--download needs --data DIR to download into; add --data DIR or drop --download")
        if self.data and not self.download and not os.path.isdir(self.data):
            raise UsageError(f"--data {self.data!r} does not exist; give the directory holding the Fashion-MNIST "
                             "IDX files, or add --download to fetch them into it")
        if self.data is None:
            require_memory((self.train_size + self.test_size) * _STORED_EXAMPLE_BYTES,
                           f"--train-size {self.train_size} --test-size {self.test_size}", "give smaller sizes")

    def device_list(self) -> list[Device]:
        """``devices`` as ``__post_init__`` parsed them."""
        return check_devices(parse_devices(self.devices)) if isinstance(self.devices, str) else self.devices

    def checkpoint_config(self) -> dict[str, Any]:
        """The settings a checkpoint records; resuming needs them all equal."""
        settings = {"model": self.model, "devices": len(self.devices), "batch_size": self.batch_size, "lr": self.lr,
                    "data": self.data, "train_size": self.train_size, "test_size": self.test_size, "seed": self.seed,
                    "algorithm": self.algorithm, "kvstore": self.kvstore}
        if self.processes and self.processes > 1:  # absent for one process: older checkpoints still match
            settings["processes"] = self.processes
        return settings


@dataclass
class TrainState:
    """A run in progress: the data, the checkpoint resumed from, and what is finished so far.

    It outlives an interrupted :func:`train`, so the caller can say which epoch the checkpoint holds.
    """

    spec: Any
    """The zoo model's spec (builder, loss)."""
    train_loader: Any
    """Training batches, one shuffled order per epoch."""
    test_loader: Any
    """Test batches for the accuracy after each epoch."""
    resume: dict[str, Any] | None = None
    """The checkpoint continued from, or None."""
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


def check_resume(config: TrainConfig) -> dict[str, Any] | None:
    """The checkpoint ``config.resume`` names, read and checked against ``config`` (None without one).

    Every field is checked against the run: its settings, the model's weights and buffers, the
    optimizer's hyperparameters and state, the step counter and the history (:func:`prepare` checks
    the step counter against the data's batches once they are loaded). A problem is one
    :class:`UsageError` line naming the field.
    """
    if not config.resume:
        return None
    resume = load_checkpoint(config.resume)
    settings = config.checkpoint_config()
    if resume["config"] != settings:
        was = resume["config"]
        diff = {k: (was.get(k), settings.get(k)) for k in sorted({*was, *settings}) if was.get(k) != settings.get(k)}
        raise UsageError(f"--resume {config.resume}: settings differ from the checkpoint's (was, now): {diff}")
    from ..models import get_spec

    devices = config.device_list()
    strategy = STRATEGIES.get(choose_strategy(config.kvstore, devices=devices, processes=config.processes or 1))
    trainer = resume["trainer"]
    keep_usable_plan(trainer, run_here(config), f"the checkpoint {config.resume}")
    problem = trainer_state_problem(
        trainer, model=get_spec(config.model).build(), devices=len(devices),
        make_reference=lambda params: make_optimizer("sgd", params, {"lr": config.lr}),  # as train() makes it
        on_store=strategy.state_key == "kvstore", from_checkpoint=config.resume_hparams_from_checkpoint)
    problem = problem or history_problem(resume["history"], trainer["steps"], epochs=config.epochs,
                                         batches_per_epoch=None)
    if problem:
        raise UsageError(f"--resume {config.resume}: {problem}")
    return resume


def prepare(config: TrainConfig) -> TrainState:
    """Check ``config.resume`` against ``config``, seed torch and load the data: everything before training."""
    from ..data import load_data
    from ..models import get_spec

    if config.resume is None and config.checkpoint and restart_count() > 0 and os.path.exists(config.checkpoint):
        # restarted by the launcher after a failure: continue from the last epoch the checkpoint holds
        config.resume = config.checkpoint
    resume = check_resume(config)  # before the data is read: a mismatch is reported at once
    torch.manual_seed(config.seed)
    spec = get_spec(config.model)
    train_loader, test_loader = load_data(config.batch_size, config.data, seed=config.seed, train=config.train_size,
                                          test=config.test_size, download=config.download)
    if resume is not None:  # the step counter against the data's batches, known now
        problem = history_problem(resume["history"], resume["trainer"]["steps"], epochs=config.epochs,
                                  batches_per_epoch=len(train_loader))
        if problem:
            raise UsageError(f"--resume {config.resume}: {problem}")
    history = list(resume["history"]) if resume else []
    return TrainState(spec, train_loader, test_loader, resume, history, first=len(history))


def serve(config: TrainConfig) -> None:
    """On a parameter-server rank of a ``dist_*`` store: serve the workers' training of ``config`` to its end."""
    from .servers import serve_kvstore

    if config.kvstore is None:
        raise UsageError("serving needs a distributed --kvstore, e.g. --kvstore dist_sync")
    serve_kvstore(config.kvstore, "sgd", {"lr": config.lr})  # the update train() gives its Trainer


def describe_auto_choice(model: torch.nn.Module, devices: list, bucket_bytes: int | None = None) -> str:
    """Which algorithm ``algorithm="auto"`` takes for this model's gradient buckets, and why (one line)."""
    from .allreduce import choose_algorithm
    from .allreduce.auto import describe_bytes
    from .buckets import auto_bucket_bytes

    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in params]
    # the Trainer reduces buckets of up to auto_bucket_bytes; a larger parameter gets one of its own
    cap = auto_bucket_bytes(params) if bucket_bytes is None else bucket_bytes
    nbytes = max(min(sum(sizes), cap), max(sizes, default=0))
    # the Trainer pushes each bucket's phases to the engine, one operation per device lane, as backward fills it
    name, reason = choose_algorithm(nbytes, devices, workers=True)
    return f"allreduce: auto chose {name} for gradient buckets of {describe_bytes(nbytes)} ({reason})"


def train(config: TrainConfig, state: TrainState, *, on_epoch: Callable[[dict[str, Any]], None] | None = None,
          on_message: Callable[[str], None] | None = None, show_progress: bool = False) -> TrainState:
    """Train from ``state`` up to ``config.epochs``, saving ``config.checkpoint`` after every epoch.

    Across processes the first process writes the checkpoint (``state.saved`` stays empty in the others).

    ``on_epoch`` gets each finished epoch's record after it is in ``state.history`` and saved;
    ``on_message`` gets one-line notes (the algorithm ``auto`` chose). Ctrl-C propagates, with
    ``state`` holding the finished epochs.
    """
    model = state.spec.build()
    if config.algorithm == "auto" and config.kvstore is None and on_message:
        on_message(describe_auto_choice(model, config.device_list(), config.bucket_bytes))
    options = TrainerConfig("sgd", {"lr": config.lr}, loss=state.spec.loss, algorithm=config.algorithm,
                            bucket_bytes=config.bucket_bytes, kvstore=config.kvstore, check_finite=config.check_finite,
                            plan=config.plan,
                            # one timeline per run: the first process's (the others would write the same file)
                            trace=config.trace if rank_info().rank == 0 else None)
    with Trainer(model, config.device_list(), config=options) as trainer:
        if state.resume is not None:
            try:
                trainer.load_state_dict(state.resume["trainer"])
            except (KeyError, TypeError, ValueError, RuntimeError) as exc:
                raise UsageError(f"--resume {config.resume}: the checkpoint does not fit this model "
                                 f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})"
                                 ) from None
        if config.algorithm == "auto" and config.kvstore is None and trainer.processes is not None:
            from .procs import describe_process_allreduce

            # collective: every process measures the links now, before the first step's sums wait on them
            lines = describe_process_allreduce(trainer.processes.group, choose=True)
            if on_message:
                for line in lines:
                    on_message(line)
        first = len(state.history)  # before record() appends
        settings = config.checkpoint_config()

        def record(rec: dict[str, Any]) -> None:
            state.history.append(rec)
            # kept before it is reported: an epoch on the screen is an epoch a Ctrl-C right after it keeps
            if config.checkpoint and trainer.rank == 0:
                save_checkpoint(config.checkpoint, {"format": CHECKPOINT_FORMAT, "config": settings,
                                                    "history": state.history, "trainer": trainer.state_dict()})
                state.saved.append(rec["epoch"])
            if on_epoch:
                on_epoch(rec)

        train_epochs(trainer, state.train_loader, state.test_loader, first, config.epochs, show_progress, record)
    return state


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


def epoch_line(rec: dict[str, Any]) -> str:
    """One finished epoch as printed: loss (and since which step it was not finite), test accuracy, seconds."""
    loss = f"loss {rec['loss']:.3f}"
    if rec.get("nonfinite_since_step") is not None:
        loss += f" (non-finite since step {rec['nonfinite_since_step']}; --check-finite stops there)"
    return f"epoch {rec['epoch']}: {loss}, test acc {rec['test_acc']:.3f}, {rec['seconds']:.1f} sec"

"""Trainer: data-parallel training of one model on k devices (d2l 12.6, concisely).

Each replica's forward and backward is an operation of the asynchronous engine (d2l 12.2) on its device's
worker; how gradients are synchronized and the replicas updated is the trainer's *strategy*
(:mod:`dlperf.parallel.strategies`). Started as several processes, a Trainer spans them all: every process passes
the same global batch and trains on its slice (docs/library.md has the details).

>>> import torch
>>> from torch import nn
>>> from dlperf.devices import cpu
>>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
>>> X, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
>>> with Trainer(net, [cpu(0), cpu(1)], "sgd", {"lr": 0.1}) as trainer:
...     loss = trainer.train_step(X, y)
...     trainer.strategy.name, trainer.max_replica_difference()
('allreduce', 0.0)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...batch import batch_size, call_loss, call_model, map_tensors
from ...devices import Device, DeviceLike
from ...engine import Engine, Trace, create_engine
from ...errors import UsageError
from ...losses import StepLoss, resolve_loss
from ..allreduce import get_algorithm
from ..allreduce.lanes import EngineLanes, comm_lanes
from ..communication.buckets import GradientBuckets
from ..communication.process_group import ProcessAxis, allreduce_across_processes, broadcast_from_first, join_processes
from ..launchers import rank_info
from ..optimizers import OPTIMIZERS, OptimizerLike, make_optimizer, make_schedule
from ..replicas import broadcast_buffers, max_replica_difference, replicate
from ..split import check_devices, split_step
from ..strategies import NonFiniteError, StepContext, Strategy, create_strategy
from .evaluate import evaluate_accuracy
from .trainer_config import TrainerConfig
from .trainer_gluon import GluonCalls
from .trainer_plan import Plan, PlanState, apply_plan, cpu_threads, reference_plan, resize_state, wants_channels_last

__all__ = ["Trainer", "TrainerConfig", "make_optimizer", "OPTIMIZERS", "NonFiniteError"]

log = logging.getLogger(__name__)


class Trainer(GluonCalls):
    """Keeps one replica per device identical while training them on the parts of each batch.

    Args:
        module: the model; it is copied onto every device (``trainer.module`` is the first copy).
        devices: distinct, available devices, e.g. ``[cpu(0), cpu(1)]`` or ``try_all_gpus()``.
        optimizer, optimizer_params: as :class:`TrainerConfig`'s (given here, they override ``config``'s).
        config: a :class:`TrainerConfig`; ``**options`` are its fields as keywords instead (or on top).

    Across processes, :meth:`train_step` takes the global batch, the same in every process, and
    ``devices`` are this process's own (see :class:`TrainerConfig`).
    """

    def __init__(self, module: nn.Module, devices: Sequence[DeviceLike], optimizer: OptimizerLike | None = None,
                 optimizer_params: dict[str, Any] | None = None, *, config: TrainerConfig | None = None,
                 example_batch: tuple[Any, Any] | None = None, **options: Any) -> None:
        if optimizer is not None:
            options["optimizer"] = optimizer
        if optimizer_params is not None:
            options["optimizer_params"] = optimizer_params
        self.config = dataclasses.replace(config, **options) if config is not None else TrainerConfig(**options)
        self._closed = False
        self.planning = PlanState(self.config.plan, self.config.planner)
        given = check_devices(devices)
        if self.planning.mode is not None:
            self.planning.reference = reference_plan(module, given, self.config)
        self._unbuilt: tuple[nn.Module, list[Device]] | None = (module, given)  # until a build succeeds
        if not self.planning.pending:
            self._build(module, *apply_plan(self.planning.plan, given, self.config))
        elif example_batch is not None:  # plan="auto": nothing is built before the plan is chosen
            self._plan_on(*example_batch)

    def _plan_on(self, X: Any, y: Any) -> None:
        """Choose the plan on this batch (:func:`~dlperf.parallel.training.planned.plan_for`), then build on it."""
        from .planned import plan_for  # the planner times candidate Trainers: the same function every caller uses

        assert self._unbuilt is not None and self.planning.reference is not None
        module, devices = self._unbuilt
        if self.config.processes is not None and (self.config.processes != "auto" or rank_info().world_size > 1):
            log.info("plan: kept as given (a Trainer across processes plans in one process only)")
            plan = self.planning.plan = self.planning.reference
        else:
            plan = self.planning.decided(plan_for(module, (X, y), devices, config=self.config,
                                                  options=self.planning.options, reference=self.planning.reference))
        self._build(module, *apply_plan(plan, devices, self.config))

    def _build(self, module: nn.Module, devices: Sequence[DeviceLike], cfg: TrainerConfig) -> None:
        """Replicas, engine, lanes and strategy for ``devices`` as ``cfg`` says (again when a plan changes)."""
        self.devices = check_devices(devices)
        self.check_finite = cfg.check_finite
        self.buffers = cfg.buffers
        self.loss: StepLoss = resolve_loss(cfg.loss)
        self.k = len(self.devices)
        axis = join_processes(None if cfg.processes == "auto" else cfg.processes) if cfg.processes is not None else None
        try:
            self.strategy: Strategy = create_strategy(cfg.kvstore, update_on_kvstore=cfg.update_on_kvstore,
                                                      devices=self.devices, processes=axis.world if axis else 1,
                                                      strategy=cfg.strategy)
            self.processes: ProcessAxis | None = self.strategy.join(axis)
        except BaseException:
            if axis is not None:
                axis.close()
            raise
        if self.processes is not None:  # every process starts from the first one's weights
            broadcast_from_first([*module.parameters(), *module.buffers()], self.processes.group)
        self.replicas = replicate(module, self.devices)
        self.channels_last = wants_channels_last(cfg, self.devices, module)
        if self.channels_last:
            for r in self.replicas:
                r.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # (torch's stubs lack it)
        self._forwards = self.planning.forwards(self.replicas)
        self._trace_path = Path(cfg.trace) if cfg.trace is not None else None
        threads = cpu_threads(self.devices, cfg.threads, self.processes.cores() if self.processes is not None else None)
        self.engine: Engine = create_engine(self.planning.engine_kind(), cpu_threads=threads,
                                            trace=cfg.trace is not None)
        lanes, kind = comm_lanes(self.devices)
        self.lanes = EngineLanes(self.engine, lanes, kind)
        self.algorithm = get_algorithm(cfg.algorithm)
        self._ctx = StepContext(self.replicas, self.devices, self.engine, self.lanes, self.processes,
                                cfg.new_optimizer, self.algorithm, cfg.bucket_bytes, cfg.check_finite,
                                clip_grad_norm=cfg.clip_grad_norm)
        try:
            self.strategy.attach(self._ctx)
        except BaseException:
            self.close()
            raise
        self._accumulate, self._micro = cfg.accumulate, 0
        self._schedulers = self._make_schedulers(cfg)
        self._whole_step = self.planning.whole_step(self.replicas, self.optimizers, self.loss, self.world)
        self._direct = self.planning.engine_kind() == "naive" and self.k == 1 and self.processes is None
        self._autocast = self.plan is not None and self.plan.mixed_precision != "off"  # else no context per step
        self._unbuilt = None

    def _make_schedulers(self, cfg: TrainerConfig) -> list[Any]:
        """One scheduler per replica's optimizer (they stay equal); refused where the store runs the optimizer."""
        store_updates = self.strategy.state_key == "kvstore"
        for name, value in (("clip_grad_norm", cfg.clip_grad_norm), ("lr_schedule", cfg.lr_schedule)):
            if value is not None and store_updates:
                self.close()
                raise UsageError(f"{name}={value!r} with the {self.strategy.name!r} strategy: the store runs the "
                                 "update, which sees neither; use a strategy whose replicas update themselves (no "
                                 "update_on_kvstore)")
        if cfg.lr_schedule is None:
            return []
        return [make_schedule(cfg.lr_schedule, opt, cfg.schedule_steps) for opt in self.optimizers]

    @property
    def plan(self) -> Plan | None:
        """The plan in force (None without one, or while ``plan="auto"`` waits for the first batch); what
        planning measured: ``trainer.planning.decision``."""
        return self.planning.plan

    @property
    def steps(self) -> int:
        """Finished steps."""
        return self._ctx.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self._ctx.steps = value

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """One optimizer per replica (none when the store updates the weights)."""
        return list(getattr(self.strategy, "optimizers", []))

    @property
    def update_on_kvstore(self) -> bool:
        """Whether the store runs the optimizer."""
        return self.strategy.state_key == "kvstore"

    @property
    def _buckets(self) -> GradientBuckets | None:
        return getattr(self.strategy, "buckets", None)

    @property
    def rank(self) -> int:
        """This process's rank among the trainer's processes (0 when it trains alone)."""
        return self.processes.rank if self.processes is not None else 0

    @property
    def world(self) -> int:
        """How many processes train together (1 when this one trains alone)."""
        return self.processes.world if self.processes is not None else 1

    @property
    def total_devices(self) -> int:
        """The devices of every process together: the parts a global batch is split into."""
        return self.k * self.world

    # -- training ---------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The first replica (on ``devices[0]``): the trained model (the model given, before it is built)."""
        return self.replicas[0] if self._unbuilt is None else self._unbuilt[0]

    def train_step(self, X: Any, y: Any = None) -> torch.Tensor:
        """Forward, backward and update on every device at once; return the batch's mean loss.

        ``X`` and ``y`` are a whole batch (split here; ``y`` None for a mapping batch that carries its labels)
        or lists with one part per device, each a tensor or a structure of them (:mod:`dlperf.batch`). Each
        part's loss is weighted by its share, so the gradient is the whole batch's mean loss's. Across processes
        they are the global batch, and the loss returned is the batch's mean in every process.
        """
        self._check_open()
        if self._unbuilt is not None:
            self._plan_on(X, y)
        try:
            with self.planning.step_threads():
                return self._train_step(X, y)
        except Exception as exc:
            reference = self.planning.fall_back(exc)
            if reference is None:
                raise
            self._rebuild(reference)
        return self._train_step(X, y)

    def _train_step(self, X: Any, y: Any) -> torch.Tensor:
        if self._accumulate > 1:
            return self._micro_step(X, y)
        # one replica on the calling thread, whose engine would run the step inline: it is called directly
        direct = self._direct and not self.engine.tracing and _one_host_batch(X, y)
        Xs, ys, total = ([X], [y], 0) if direct else split_step(X, y, self.devices, self.world, self.rank)
        strategy, ctx = self.strategy, self._ctx
        strategy.begin_step()
        ops = [] if direct else [
            self.engine.push(self._replica_step, args=(i, Xs[i], ys[i], batch_size(Xs[i]) / total),
                             writes=(ctx.replica_vars[i], ctx.step_vars[i]), device=d, name=f"fwd+bwd {d}")
            for i, d in enumerate(self.devices)]
        try:
            losses = [self._replica_step(0, X, y, 1.0)] if direct else strategy.wait_replicas(ops)
            if self.check_finite:
                ctx.raise_if_nonfinite("loss", losses)
        except BaseException:
            strategy.abort_step()
            ctx.renew_failed_vars()
            raise
        finally:
            strategy.end_step()
        strategy.finish(1.0)
        self._after_update()
        loss = losses[0] if len(losses) == 1 else \
            torch.stack([part.to(self.devices[0].torch_device) for part in losses]).sum()
        # across processes each holds its part of the batch's mean: what a rank reports is their sum, the mean
        return loss if self.processes is None else self.sum_across_processes(loss)

    def _micro_step(self, X: Any, y: Any) -> torch.Tensor:
        """One micro-batch of ``accumulate``: its gradients are added to the others', and the last one sums them
        across the replicas (once, as DDP's ``no_sync`` does) and updates, the gradients scaled to the mean."""
        Xs, ys, total = split_step(X, y, self.devices, self.world, self.rank)
        ctx, first = self._ctx, self._micro == 0
        ops = [self.engine.push(self._micro_replica_step, args=(i, Xs[i], ys[i], batch_size(Xs[i]) / total, first),
                                writes=(ctx.replica_vars[i], ctx.step_vars[i]), device=d, name=f"fwd+bwd {d}")
               for i, d in enumerate(self.devices)]
        try:
            losses = ctx.wait_ops(ops)
            if self.check_finite:
                ctx.raise_if_nonfinite("loss", losses)
        except BaseException:
            ctx.renew_failed_vars()
            raise
        self._micro += 1
        if self._micro == self._accumulate:
            self.flush()
        loss = torch.stack([part.to(self.devices[0].torch_device) for part in losses]).sum()
        return loss if self.processes is None else self.sum_across_processes(loss)

    def _micro_replica_step(self, i: int, X: Any, y: Any, share: float, first: bool) -> torch.Tensor:
        rep = self.replicas[i]
        if not rep.training:
            rep.train()
        if first:
            self.strategy.zero_grad(i)
        with self.planning.precision(self.devices[i]):
            loss = call_loss(self.loss, call_model(self._forwards[i], self._layout(X)), y, X)
        (loss * (share / self._accumulate)).backward()
        return (loss * share).detach()

    def flush(self) -> None:
        """Update from the micro-batches accumulated so far (``accumulate`` > 1), if any: the end of an epoch whose
        batches do not divide evenly updates on what it has, scaled to their mean."""
        if self._micro == 0:
            return
        self.strategy.finish(self._accumulate / self._micro)  # each micro-batch's gradient was divided by all
        self._micro = 0
        self._after_update()

    def _replica_step(self, i: int, X: torch.Tensor, y: torch.Tensor, share: float) -> torch.Tensor:
        """Device ``i``'s forward and backward, an engine operation on its worker."""
        rep = self.replicas[i]
        if not rep.training:  # walking every submodule each step costs tens of microseconds
            rep.train()
        if self._whole_step is not None:  # the plan's captured step updates too (one replica: share is 1)
            return self._whole_step(self._layout(X), y).detach()
        self.strategy.zero_grad(i)
        if self._autocast:
            with self.planning.precision(self.devices[i]):
                loss = call_loss(self.loss, call_model(self._forwards[i], self._layout(X)), y, X)
        else:
            loss = call_loss(self.loss, call_model(self._forwards[i], self._layout(X)), y, X)
        if share != 1.0:  # one replica's loss is the batch's: no multiplication to run and differentiate
            loss = loss * share
        loss.backward()
        self.strategy.after_backward(i)
        return loss.detach()

    def _layout(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return map_tensors(self._layout, x) if self.channels_last else x
        if self.channels_last and x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x

    def _after_update(self) -> None:
        self._ctx.steps += 1
        for scheduler in self._schedulers:
            scheduler.step()
        if self._optimizer_group is not None:
            self._optimizer_group.mark_stepped()  # what a learning-rate scheduler checks before its first step
        if self.buffers == "broadcast" and self.k > 1:
            broadcast_buffers(self.replicas)

    def zero_grad(self) -> None:
        """Clear gradients on every replica (before a caller-driven backward and :meth:`step`)."""
        for i in range(self.k):
            self.strategy.zero_grad(i)

    # -- evaluation and state -----------------------------------------------------------------------
    def evaluate_accuracy(self, data: Iterable[Any], predictions: Any = None) -> float:
        """Accuracy over ``data`` (``(inputs, targets)`` pairs or mapping batches with their ``labels``): each
        batch split across the devices and run on all at once (:func:`~.evaluate.evaluate_accuracy`).

        Across processes every process passes the same ``data``; each evaluates every ``world``-th batch
        and the counts are summed, so all get the accuracy over all of ``data``.
        """
        self._check_open()
        if self.processes is None:
            return evaluate_accuracy(self.replicas, data, self.devices, self.engine, prepare=self._layout,
                                     predictions=predictions)
        seen = [0]

        def mine() -> Iterable[Any]:
            for i, batch in enumerate(data):
                if i % self.world == self.rank:
                    seen[0] += batch_size(batch if isinstance(batch, Mapping) else batch[0], "input")
                    yield batch

        acc = evaluate_accuracy(self.replicas, mine(), self.devices, self.engine, prepare=self._layout,
                                predictions=predictions)
        counts = self.sum_across_processes(torch.tensor([round(acc * seen[0]), seen[0]], dtype=torch.float64))
        return float(counts[0] / counts[1]) if counts[1] > 0 else 0.0

    def evaluate_loss(self, data: Iterable[Any]) -> float:
        """The mean loss over ``data`` (the metric of a model whose targets are not class labels, a regressor's),
        on the first replica in eval mode; across processes each takes every ``world``-th batch, as for accuracy."""
        self._check_open()
        model, device = self.replicas[0], self.devices[0].torch_device
        was = model.training
        model.eval()
        total, seen = 0.0, 0
        try:
            with torch.no_grad():
                for i, batch in enumerate(data):
                    if i % self.world != self.rank:
                        continue
                    X, y = (batch, None) if isinstance(batch, Mapping) else batch
                    X, y = map_tensors(lambda t: t.to(device), X), map_tensors(lambda t: t.to(device), y)
                    n = batch_size(X, "input")
                    total += float(call_loss(self.loss, call_model(model, self._layout(X)), y, X)) * n
                    seen += n
        finally:
            model.train(was)
        sums = self.sum_across_processes(torch.tensor([total, seen], dtype=torch.float64))
        return float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")

    def sum_across_processes(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the trainer's processes (``t`` itself when it trains alone).

        Every process must call it at the same point, e.g. after an epoch's steps.
        """
        self._check_open()
        if self.processes is None:
            return t
        flat = t.detach().to("cpu", copy=True).contiguous()
        op = self.engine.push(allreduce_across_processes, args=(flat, self.processes.group),
                              writes=(self._ctx.across_var,), device=self._ctx.process_lane(),
                              name="sum across processes")
        op.wait()
        return flat.to(t.device)

    def max_replica_difference(self) -> float:
        """Largest parameter difference between replicas (0.0 when they are identical)."""
        return max_replica_difference(self.replicas)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically: weights, per-device buffers, optimizer or store."""
        return {
            "model": {k: v.detach().cpu().clone() for k, v in self.replicas[0].state_dict().items()},
            "buffers": [{k: v.detach().cpu().clone() for k, v in r.named_buffers()} for r in self.replicas],
            "steps": self.steps,
            **self.strategy.state_dict(),
            **({"plan": self.plan.to_dict()} if self.plan is not None else {}),
            **({"schedule": self._schedulers[0].state_dict()} if self._schedulers else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into every replica and optimizer (or the store); a recorded plan is
        taken over unless this trainer was given another one."""
        if self._unbuilt is not None:  # plan="auto" not planned yet: a recorded plan is taken, else the reference
            module, devices = self._unbuilt
            plan = self.planning.recorded(state["plan"], devices, self.config.check_finite) if "plan" in state \
                else None
            self.planning.plan = plan or self.planning.reference
            self._build(module, *apply_plan(self.planning.plan, devices, self.config))
        elif "plan" in state and self.steps == 0 and self.processes is None:
            if self.planning.mode is None:
                self.planning.reference = reference_plan(self.replicas[0], self.devices, self.config)
            plan = self.planning.recorded(state["plan"], self.devices, self.config.check_finite)
            if plan is not None:
                self._rebuild(plan, carry=False)
        if len(state["buffers"]) != self.k:
            raise UsageError(f"the checkpoint holds {len(state['buffers'])} replicas but this trainer has "
                             f"{self.k} devices; resume on the same number of devices")
        with self.strategy.restoring():  # the store's state comes from the checkpoint too, just below
            for r, bufs in zip(self.replicas, state["buffers"]):
                r.load_state_dict(state["model"])
                with torch.no_grad():
                    for name, b in r.named_buffers():
                        b.copy_(bufs[name])
        self.strategy.load_state_dict(state)
        if self._schedulers and isinstance(state.get("schedule"), dict):
            for scheduler in self._schedulers:
                scheduler.load_state_dict(dict(state["schedule"]))
        self.steps = int(state["steps"])
        # a captured step holds the optimizer's state tensors, which loading replaced
        self._whole_step = self.planning.whole_step(self.replicas, self.optimizers, self.loss, self.world)

    def _rebuild(self, plan: Plan, carry: bool = True) -> None:
        """Build again on ``plan`` (after a failed step, or for a checkpoint's plan), carrying weights, buffers and
        optimizer state over unless the caller loads a state next."""
        carried = self.state_dict() if carry else None
        module = self.replicas[0].to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]
        self._teardown(abort=True)  # a failed step's operations may still hold their error
        self._build(module, *apply_plan(plan, self.devices, self.config))
        if carried is not None:
            self.load_state_dict(resize_state(carried, self.k))

    def plan_declined(self) -> str | None:
        """After a step: why this Trainer does not run what its plan's execution says (its captured step serves
        the eager one), else None."""
        return self.planning.declined(self._whole_step)

    # -- lifetime ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Trainer is closed")

    def start_trace(self) -> None:
        """Record the engine's timeline from now on (see :meth:`stop_trace`)."""
        self.engine.start_trace()

    def stop_trace(self, path: str | Path | None = None) -> Trace:
        """Stop recording; return the timeline, also written to ``path`` (Chrome trace JSON) if given."""
        trace = self.engine.stop_trace()
        if path is not None:
            trace.save(path)
        return trace

    def close(self, abort: bool = False) -> None:
        """Finish the engine's pending operations and stop its workers; the replicas stay usable.

        ``abort`` (used when an exception such as Ctrl-C leaves a step half done): errors of the
        abandoned operations are not raised. No operation waits for another one inside the engine, so
        closing never hangs on a step that will not complete. With ``trace=`` the timeline is written.
        """
        if self._closed:
            return
        self._closed = True
        if self._unbuilt is None:  # else nothing was built: plan="auto" saw no batch, or its build failed
            self._teardown(abort)

    def _teardown(self, abort: bool = False) -> None:
        try:
            self.strategy.close()
        finally:
            try:
                self.engine.close()  # waits for every pushed operation, then stops the workers
            except BaseException:
                if not abort:  # after an interrupt, errors of the abandoned step are not news
                    raise
            finally:
                if self._trace_path is not None:  # with the exchanges the strategy gathered as it closed
                    from .timeline import save_trace

                    save_trace(self.stop_trace(), self._trace_path, getattr(self.strategy, "exchange_report", None))
                if self.processes is not None:
                    self.processes.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(abort=exc_type is not None)


def _one_host_batch(X: Any, y: Any) -> bool:
    """Whether ``X`` and ``y`` are plain host tensors of one batch: the one replica takes them as they are."""
    # is_cpu and ndim: X.device would build a torch.device object per tensor and step
    return (type(X) is torch.Tensor and type(y) is torch.Tensor and X.is_cpu and y.is_cpu
            and X.ndim > 0 and y.ndim > 0 and X.shape[0] == y.shape[0] > 0)

"""``plan_for``: the planner on a model and an example batch, for callers that are not a Trainer yet.

``dlperf train --plan auto`` calls it before training, and a report (``dlperf bench --mode auto``, ``dlperf
profile``) can call it to suggest the plan a Trainer would take: all measure the same candidates the same way.

>>> import torch
>>> from torch import nn
>>> from dlperf.parallel.planner import PlannerOptions
>>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
>>> batch = (torch.randn(32, 8), torch.randint(0, 3, (32,)))
>>> decision = plan_for(net, batch, options=PlannerOptions(rounds=1, steps=2, use_cache=False))
>>> decision.plan in [m.plan for m in decision.measurements], decision.plan.measured_ms is not None
(True, True)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..devices import Device, DeviceLike, cpu
from ..errors import UsageError
from .optimizers import OptimizerLike
from .plan import Plan
from .plan_processes import measuring_processes
from .planner import CandidateRun, PlanDecision, PlannerOptions, search, usable_cores
from .split import check_devices
from .trainer import Trainer
from .trainer_config import Loss, TrainerConfig
from .trainer_plan import reference_plan

__all__ = ["plan_for", "candidate_builder"]


def candidate_builder(model: nn.Module, batch: tuple[Any, Any], devices: Sequence[Device], config: TrainerConfig):
    """``build(plan) -> CandidateRun``: a Trainer on its own copy of ``model``, stepping on ``batch``."""
    X, y = batch

    def build(plan: Plan) -> CandidateRun:
        if plan.launcher == "processes":
            from .process_candidates import candidate_run

            return candidate_run(plan, model, (X, y), config)
        copied = copy.deepcopy(model).to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]
        cfg = dataclasses.replace(config, plan=plan, trace=None, processes=None, check_finite=False)
        trainer = Trainer(copied, plan.devices_for(devices), config=cfg)
        trainer.planning.fallback = False  # a candidate that fails is dropped, not measured as another plan
        return CandidateRun(step=lambda: trainer.train_step(X, y), close=trainer.close,
                            threads=plan.replicas * plan.threads, declined=lambda: trainer.planning.declined(trainer))

    return build


def plan_for(model: nn.Module, example_batch: tuple[Any, Any], devices: Sequence[DeviceLike] | None = None, *,
             optimizer: OptimizerLike = "sgd", optimizer_params: dict[str, Any] | None = None,
             loss: Loss | None = None, options: PlannerOptions | None = None, processes: bool = False
             ) -> PlanDecision:
    """The plan to train ``model`` on batches like ``example_batch`` (``(inputs, targets)``), with what it measured.

    ``devices``: the devices the run was going to use (its reference is then the Trainer on them as it
    would train without a plan); None: this machine's CPU cores, the reference being one replica using
    them all, contiguous and eager (a plain PyTorch loop). The model's weights are never stepped: every
    candidate trains a copy. ``processes=True``: also plans whose replicas are processes (the caller can
    start them, as ``dlperf train`` does), each measured by launching them (:mod:`.plan_processes`).
    """
    if not isinstance(example_batch, (tuple, list)) or len(example_batch) != 2:
        raise UsageError(f"example_batch is a {type(example_batch).__name__}; give (inputs, targets) as one "
                         "training step takes them")
    config = TrainerConfig(optimizer, optimizer_params or {"lr": 0.01}, loss=loss, processes=None)
    if devices is None:
        options = options or PlannerOptions()
        cores = options.cores or usable_cores()
        placed = [cpu(0)]
        reference = Plan(replicas=1, threads=cores)
    else:
        placed = check_devices(devices)
        reference = reference_plan(model, placed, config)
    build = candidate_builder(model, (example_batch[0], example_batch[1]), placed, config)
    from .launchers import in_launched_worker

    with measuring_processes(processes and not in_launched_worker()):  # no launch from inside a launched job
        return search(model, tuple(example_batch), placed, build, reference, options)

"""``plan_for``: the one function that chooses a plan, for every caller (a Trainer told ``plan="auto"``, ``dlperf
train``, ``bench --mode auto``, ``profile``): the planner times candidate Trainers, each built from a pinned plan
on its own copy of the model, so all measure the same candidates the same way.

>>> import torch
>>> from torch import nn
>>> from dlperf.parallel.planning.planner import PlannerOptions
>>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
>>> batch = (torch.randn(32, 8), torch.randint(0, 3, (32,)))
>>> decision = plan_for(net, batch, options=PlannerOptions(rounds=1, steps=2, use_cache=False))
>>> decision.plan in [m.plan for m in decision.measurements], decision.plan.measured_ms is not None
(True, True)
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...devices import Device, DeviceLike, cpu
from ...errors import UsageError
from ...machine import usable_cores
from ..launchers import in_launched_worker, rank_info
from ..optimizers import OptimizerLike
from ..planning.plan import EXECUTIONS, Plan
from ..planning.planner import search
from ..planning.process_plans import START_TIMEOUT_S, ProcessCandidate, measuring_processes
from ..planning.records import CandidateRun, PlanDecision, PlannerOptions
from ..split import check_devices
from .trainer import Trainer
from .trainer_config import LossLike, TrainerConfig
from .trainer_plan import check_whole_step, reference_plan

__all__ = ["plan_for", "candidate_builder", "start_candidate"]


def candidate_builder(model: nn.Module, batch: tuple[Any, Any], devices: Sequence[Device],
                      config: TrainerConfig) -> Callable[[Plan], CandidateRun]:
    """``build(plan) -> CandidateRun``: a Trainer built from ``plan`` on its own copy of ``model``, stepping on
    ``batch`` (a processes plan: its processes, each such a Trainer)."""
    X, y = batch

    def build(plan: Plan) -> CandidateRun:
        if plan.launcher == "processes":
            run = start_candidate(plan, model, (X, y), config)
            return CandidateRun(step=run.step, close=run.close, threads=plan.replicas * plan.threads)
        if EXECUTIONS.get(plan.execution).whole_step:  # before check_finite is dropped below: the run keeps it
            check_whole_step(plan, config)
        copied = copy.deepcopy(model).to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]
        cfg = dataclasses.replace(config, plan=plan, trace=None, processes=None, check_finite=False)
        trainer = Trainer(copied, plan.devices_for(devices), config=cfg)
        trainer.planning.fallback = False  # a candidate that fails is dropped, not measured as another plan
        return CandidateRun(step=lambda: _quietly(trainer.train_step, X, y), close=trainer.close,
                            threads=plan.replicas * plan.threads, declined=trainer.plan_declined)

    return build


def _quietly(step: Callable[..., Any], X: Any, y: Any) -> Any:
    """A candidate's step with dlperf's capture warnings held back: a candidate that cannot capture is dropped
    with the reason in its note (the decision's table), not told on the user's terminal."""
    from ...hybrid import HybridizeWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HybridizeWarning)
        return step(X, y)


def plan_for(model: nn.Module, example_batch: tuple[Any, Any], devices: Sequence[DeviceLike] | None = None, *,
             optimizer: OptimizerLike = "sgd", optimizer_params: dict[str, Any] | None = None,
             loss: LossLike = None, config: TrainerConfig | None = None, options: PlannerOptions | None = None,
             processes: bool = False, reference: Plan | None = None, replan: bool = False) -> PlanDecision:
    """The plan to train ``model`` on batches like ``example_batch`` (``(inputs, targets)``), with what it measured.

    ``devices``: the devices the run was going to use (its reference is then the Trainer on them as it
    would train without a plan); None: this machine's CPU cores, the reference being one replica using
    them all, contiguous and eager (a plain PyTorch loop). ``config``: the Trainer's options the candidates
    share (else one from ``optimizer``, ``optimizer_params`` and ``loss``). The model's weights are never
    stepped: every candidate trains a copy. ``processes=True``: also plans whose replicas are processes (the
    caller can start them, as ``dlperf train`` does), each measured by launching them. ``replan=True``: measure
    again even where a decision is cached.
    """
    if not isinstance(example_batch, (tuple, list)) or len(example_batch) != 2:
        raise UsageError(f"example_batch is a {type(example_batch).__name__}; give (inputs, targets) as one "
                         "training step takes them")
    if config is None:
        config = TrainerConfig(optimizer, optimizer_params or {"lr": 0.01}, loss=loss, processes=None)
    config = dataclasses.replace(config, plan=None, planner=None)
    if replan:
        options = dataclasses.replace(options or PlannerOptions(), replan=True)
    if devices is None:
        options = options or PlannerOptions()
        placed = [cpu(0)]
        reference = reference or Plan(replicas=1, threads=options.cores or usable_cores())
    else:
        placed = check_devices(devices)
        reference = reference or reference_plan(model, placed, config)
    build = candidate_builder(model, (example_batch[0], example_batch[1]), placed, config)
    with measuring_processes(processes and not in_launched_worker()):  # no launch from inside a launched job
        return search(model, tuple(example_batch), placed, build, reference, options)


# -- a processes plan's candidate: what each of its processes runs ------------------------------------------------
def _candidate_worker(plan: Plan, model: nn.Module, batch: tuple[Any, Any], config: Any, port: int,
                      idle_timeout_s: float) -> None:
    """One process of a candidate: a Trainer across the processes, one step per command from the planner."""
    import torch.distributed as dist

    rank = rank_info().rank
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=idle_timeout_s))
    store.set(f"pid/{rank}", str(os.getpid()))
    trainer = None
    try:  # a failure here fails the launch, which answers the planner (ProcessCandidate._launch)
        cfg = dataclasses.replace(config, plan=plan, processes="auto")  # as dlperf train realises it
        trainer = Trainer(model, [cpu(0)], config=cfg)
        trainer.planning.fallback = False  # a candidate that fails is dropped, not measured as another plan
        X, y = batch
        store.set(f"ready/{rank}", "ok")
        n = 0
        while True:
            n += 1
            store.wait([f"cmd/{n}"])
            if store.get(f"cmd/{n}") != b"step":
                return
            trainer.train_step(X, y)
            store.set(f"done/{n}/{rank}", "ok")
    finally:
        if trainer is not None:
            trainer.close()


def start_candidate(plan: Plan, model: nn.Module, batch: tuple[Any, Any], config: Any, *,
                    start_timeout_s: float = START_TIMEOUT_S) -> ProcessCandidate:
    """``plan``'s processes started, each a Trainer under ``plan`` on ``batch``, waiting for ``step()``."""
    return ProcessCandidate(plan, model, batch, config, worker=_candidate_worker, start_timeout_s=start_timeout_s)

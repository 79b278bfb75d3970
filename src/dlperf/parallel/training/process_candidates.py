"""The processes of a planner's process-plan candidate: what each runs, and the candidate the planner times.

:mod:`~dlperf.parallel.planning.process_plans` starts and steps them; each process here builds the Trainer the plan
says (as ``dlperf train`` realises a processes plan) and takes one step per command. Kept apart because it
needs the Trainer, which itself follows plans.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

from torch import nn

from ...devices import cpu
from ..launchers import rank_info
from ..planning.plan import Plan
from ..planning.planner import CandidateRun
from ..planning.process_plans import START_TIMEOUT_S, ProcessCandidate
from .trainer import Trainer

__all__ = ["start_candidate", "candidate_run"]


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


def candidate_run(plan: Plan, model: nn.Module, batch: tuple[Any, Any], config: Any) -> CandidateRun:
    """The planner's :class:`~dlperf.parallel.planning.planner.CandidateRun` for a processes plan."""
    run = start_candidate(plan, model, batch, config)
    return CandidateRun(step=run.step, close=run.close, threads=plan.replicas * plan.threads)

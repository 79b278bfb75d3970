"""How a :class:`~dlperf.parallel.Trainer` follows a plan: none (as before plans), one pinned, or ``"auto"``.

With ``plan="auto"`` the Trainer asks :func:`~dlperf.parallel.training.planned.plan_for` for its plan before it
builds anything: at once when given an example batch, else on its first batch. A checkpoint holds the plan, and
loading one into a Trainer that was not given another plan takes it over. A step that fails under a plan
(memory, a lost device, a compiler error) falls back to the reference (what the Trainer does without a plan)
with one line, once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..._threads import intra_op_threads
from ...devices import Device
from ...errors import DlperfError, UsageError
from ..allreduce.lanes import thread_budget
from ..planning.plan import EXECUTIONS, Plan, parse_plan
from ..planning.plan_check import Here, resize_state, usable_here
from ..planning.process_plans import in_process_part, launch_hint
from ..planning.records import PlanDecision, PlannerOptions
from ..strategies import strategy_class
from .trainer_config import TrainerConfig

__all__ = ["Plan", "PlanDecision", "PlanState", "reference_plan", "apply_plan", "cpu_threads", "wants_channels_last",
           "resize_state", "check_whole_step"]

log = logging.getLogger(__name__)


def wants_channels_last(cfg: TrainerConfig, devices: Sequence[Device], module: nn.Module) -> bool:
    """The Trainer's layout rule without a plan: channels-last for 2-D convolutions on CPU devices."""
    return cfg.memory_format == "channels_last" or (
        cfg.memory_format == "auto" and not any(d.is_gpu for d in devices)
        and any(isinstance(m, nn.Conv2d) for m in module.modules()))


def cpu_threads(devices: Sequence[Device], threads: Sequence[int] | None, cores: int | None) -> int:
    """The one intra-op budget every CPU device worker gets (``threads`` checked, or the cores split evenly)."""
    if threads is None:
        return max(thread_budget(devices, cores))
    budget = list(threads)
    if len(budget) != len(devices) or any(not isinstance(t, int) or t < 1 for t in budget):
        raise UsageError(f"threads={budget!r} is not valid; expected one integer >= 1 per device "
                         f"({len(devices)} devices)")
    if len(set(budget)) != 1:
        raise UsageError(f"threads={budget!r} gives devices different budgets; the engine gives every CPU "
                         "device worker one budget: pass equal numbers, e.g. threads=[1, 1]")
    return budget[0]


def reference_plan(module: nn.Module, devices: Sequence[Device], cfg: TrainerConfig) -> Plan:
    """What the Trainer does with ``cfg`` and no plan, written as a plan (the one others must beat)."""
    if cfg.kvstore is not None and not isinstance(cfg.kvstore, str):
        raise UsageError("plan='auto' with a KVStore object: give the store's type name (kvstore='local') so "
                         "plans can be written down and cached")
    gpus = any(d.is_gpu for d in devices)
    threads = 1 if gpus else cpu_threads(devices, cfg.threads, None)
    algorithm = getattr(cfg.algorithm, "name", cfg.algorithm)
    strategy = strategy_class(cfg.strategy).name if cfg.strategy is not None else None
    return Plan(replicas=len(devices), threads=threads,
                memory_format="channels_last" if wants_channels_last(cfg, devices, module) else "contiguous",
                algorithm=str(algorithm), bucket_bytes=cfg.bucket_bytes, kvstore=cfg.kvstore, strategy=strategy)


def apply_plan(plan: Plan | None, devices: Sequence[Device], cfg: TrainerConfig) -> tuple[list[Device], TrainerConfig]:
    """The devices and config a Trainer builds itself from under ``plan`` (None: as ``cfg`` says; one error line
    when it cannot)."""
    if plan is None:
        return list(devices), cfg
    if plan.launcher == "processes":
        from ..launchers import rank_info

        world = rank_info().world_size
        if world != plan.replicas:
            where = f"this process is one of {world}" if world > 1 else "this Trainer runs in one process"
            raise UsageError(f"plan {plan.name!r} runs its replicas as {plan.replicas} processes but {where}; "
                             f"{launch_hint(plan)}")
        # each process of the launched job is one replica of the plan: it builds that one replica's part
        placed, part = apply_plan(in_process_part(plan), devices, cfg)
        return placed, dataclasses.replace(part, plan=plan)
    if plan.mixed_precision == "fp16":
        raise UsageError(f"plan {plan.name!r}: fp16 needs loss scaling, which the Trainer does not do; use bf16")
    placed = plan.devices_for(devices)
    gpus = any(d.is_gpu for d in placed)
    if plan.step_thread == "caller" and gpus:
        raise UsageError(f"plan {plan.name!r}: the calling thread runs CPU steps; drop caller on GPU devices")
    if plan.mixed_precision == "bf16" and not gpus:
        raise UsageError(f"plan {plan.name!r}: bf16 mixed precision is planned for GPUs; drop bf16 on CPU devices")
    if EXECUTIONS.get(plan.execution).whole_step:
        check_whole_step(plan, cfg)
    if plan.cudnn_benchmark and gpus:
        torch.backends.cudnn.benchmark = True  # process-wide: cuDNN keeps one algorithm cache
    return placed, dataclasses.replace(cfg, threads=None if gpus else [plan.threads] * len(placed),
                                       memory_format=plan.memory_format, algorithm=plan.algorithm,
                                       bucket_bytes=plan.bucket_bytes, kvstore=plan.kvstore,
                                       strategy=plan.strategy or cfg.strategy, plan=plan)


def check_whole_step(plan: Plan, cfg: TrainerConfig) -> None:
    """A step captured from forward to update replaces the strategy's update: only where there is none to keep."""
    why = ("check_finite=True (its update would have to wait for the check)" if cfg.check_finite else
           f"accumulate={cfg.accumulate} (its update runs every step)" if cfg.accumulate > 1 else
           f"clip_grad_norm={cfg.clip_grad_norm} (its update takes the gradients as they are)"
           if cfg.clip_grad_norm is not None else
           f"kvstore={cfg.kvstore!r} (the store runs the update)" if cfg.kvstore is not None else
           f"mixed precision {plan.mixed_precision}" if plan.mixed_precision != "off" else None)
    if why is not None:
        raise UsageError(f"plan {plan.name!r} with {why}: a {plan.execution} step runs forward to update in one "
                         f"piece; use {plan.name.replace(plan.execution, 'eager')}")


class PlanState:
    """A Trainer's plan: its mode (None, ``"pinned"`` or ``"auto"``), the plan in force, the reference (what the
    Trainer does without a plan), the decision that chose it, and how the plan's step runs. It holds no Trainer:
    the Trainer asks it what to build and how each step runs, and rebuilds itself when the plan changes."""

    def __init__(self, spec: object, options: PlannerOptions | None = None) -> None:
        self.mode: str | None = None
        self.plan: Plan | None = None
        if spec == "auto":
            self.mode = "auto"
        elif isinstance(spec, Plan):
            self.mode, self.plan = "pinned", spec
        elif isinstance(spec, str):
            self.mode, self.plan = "pinned", parse_plan(spec)
        elif spec is not None:
            raise UsageError(f"plan={spec!r}: expected None, 'auto', a Plan or a plan name such as '1x2'")
        self.options = options or PlannerOptions()
        self.reference: Plan | None = None
        self.decision: PlanDecision | None = None
        self.fell_back = False
        self.fallback = True
        """Whether a failed step may fall back (a candidate being measured must fail instead)."""

    @property
    def pending(self) -> bool:
        """Planning waits for the first batch."""
        return self.mode == "auto" and self.plan is None

    def forwards(self, replicas: Sequence[nn.Module]) -> list[Any]:
        """What each replica's step calls: the module, or its execution's (compiled) form."""
        if self.plan is None or self.plan.execution == "eager" or EXECUTIONS.get(self.plan.execution).whole_step:
            return list(replicas)
        return [EXECUTIONS.get(self.plan.execution).prepare(r) for r in replicas]

    def whole_step(self, replicas: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                   loss: Any, processes: int = 1) -> Any:
        """The one replica's whole step (forward to update) when the plan's execution runs one, else None."""
        if self.plan is None:
            return None
        execution = EXECUTIONS.get(self.plan.execution)
        if execution.make_step is None:
            return None
        if processes > 1:
            raise UsageError(f"plan {self.plan.name!r}: a {execution.name} step updates the weights in one piece, "
                             f"but {processes} processes sum their gradients before the update; use "
                             f"{self.plan.name.replace(execution.name, 'eager')}")
        assert len(replicas) == 1 and len(optimizers) == 1, "a whole-step plan has one replica (checked in Plan)"
        return execution.make_step(replicas[0], loss, optimizers[0])

    def declined(self, whole_step: Any) -> str | None:
        """Why a Trainer whose whole step is ``whole_step`` does not run what its plan's execution says."""
        if self.plan is None or whole_step is None:
            return None
        return EXECUTIONS.get(self.plan.execution).declined(whole_step)

    def engine_kind(self) -> str:
        """The engine a build uses: threaded (device workers), or naive when one replica runs on the caller."""
        return "naive" if self.plan is not None and self.plan.step_thread == "caller" else "threaded"

    def step_threads(self) -> contextlib.AbstractContextManager[Any]:
        """The plan's intra-op threads around a step the calling thread runs itself (given back after)."""
        if self.plan is None or self.plan.step_thread != "caller":
            return contextlib.nullcontext()
        return intra_op_threads(self.plan.threads)

    def precision(self, device: Device) -> contextlib.AbstractContextManager[Any]:
        if self.plan is None or self.plan.mixed_precision == "off":
            return contextlib.nullcontext()
        return torch.autocast(device.torch_device.type, dtype=torch.bfloat16)

    def decided(self, decision: PlanDecision) -> Plan:
        """Take ``decision`` (``plan_for``'s on the first batch) as the plan to build on."""
        self.decision, self.plan = decision, decision.plan
        if decision.faster_with_processes:
            log.warning(decision.faster_with_processes)
        return decision.plan

    def recorded(self, recorded: object, devices: Sequence[Device], check_finite: bool) -> Plan | None:
        """A checkpoint's plan: the plan to rebuild on, or None when the one in force stays (a pinned one is kept,
        with a note; one that cannot run on ``devices`` here is ignored with one line)."""
        plan = Plan.from_dict(recorded, "the checkpoint's plan")
        if plan == self.plan:
            return None
        here = Here(devices, check_finite=check_finite, allow_mixed_precision=True, can_launch=False)
        if usable_here(plan, here, "the state given to load_state_dict", "training without it") is None:
            return None
        if self.mode == "pinned":
            log.warning("plan: %s as given; the checkpoint's %s is not used", self.plan.name if self.plan else "?",
                        plan.name)
            return None
        self.mode, self.plan = "pinned", plan
        return plan

    def fall_back(self, exc: BaseException) -> Plan | None:
        """After a step failed under a plan: the reference to rebuild on (said once), or None to let it raise."""
        if (self.fell_back or not self.fallback or self.plan is None or self.reference is None
                or self.plan == self.reference
                or self.plan.launcher == "processes"  # one process alone cannot leave the others' plan
                or isinstance(exc, DlperfError) or not isinstance(exc, (RuntimeError, MemoryError))):
            return None
        self.fell_back = True
        text = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        log.warning("plan: %s failed (%s: %s); falling back to %s", self.plan.summary(), type(exc).__name__, text,
                    self.reference.summary())
        self.plan = self.reference
        return self.reference

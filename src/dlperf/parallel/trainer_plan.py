"""How a :class:`~dlperf.parallel.Trainer` follows a plan: none (as before plans), one pinned, or ``"auto"``.

With ``plan="auto"`` the Trainer starts as it would without a plan (the *reference*) and plans on its first
:meth:`~dlperf.parallel.Trainer.train_step`, when it has a batch to measure: the planner
(:mod:`~dlperf.parallel.planner`) times candidate Trainers, each on its own copy of the model, and the
Trainer rebuilds itself on the winner before taking its first step. A checkpoint holds the plan, and
loading one into a Trainer that was not given another plan takes it over. A step that fails under a plan
(memory, a lost device, a compiler error) falls back to the reference with one line, once.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._threads import intra_op_threads
from ..devices import Device
from ..errors import DlperfError, UsageError
from .lanes import thread_budget
from .plan import EXECUTIONS, Plan, parse_plan
from .plan_check import Here, usable_here
from .plan_processes import in_process_part, launch_hint
from .planner import CandidateRun, PlanDecision, PlannerOptions, search
from .trainer_config import TrainerConfig

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["Plan", "PlanDecision", "PlanState", "reference_plan", "apply_plan", "cpu_threads", "wants_channels_last",
           "resize_state"]


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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
    return Plan(replicas=len(devices), threads=threads,
                memory_format="channels_last" if wants_channels_last(cfg, devices, module) else "contiguous",
                algorithm=str(algorithm), bucket_bytes=cfg.bucket_bytes, kvstore=cfg.kvstore)


def apply_plan(plan: Plan, devices: Sequence[Device], cfg: TrainerConfig) -> tuple[list[Device], TrainerConfig]:
    """The devices and config a Trainer builds itself from under ``plan`` (one error line when it cannot)."""
    if plan.launcher == "processes":
        from .launchers import rank_info

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
        _check_whole_step(plan, cfg)
    if plan.cudnn_benchmark and gpus:
        torch.backends.cudnn.benchmark = True  # process-wide: cuDNN keeps one algorithm cache
    return placed, dataclasses.replace(cfg, threads=None if gpus else [plan.threads] * len(placed),
                                       memory_format=plan.memory_format, algorithm=plan.algorithm,
                                       bucket_bytes=plan.bucket_bytes, kvstore=plan.kvstore, plan=plan)


def _check_whole_step(plan: Plan, cfg: TrainerConfig) -> None:
    """A step captured from forward to update replaces the strategy's update: only where there is none to keep."""
    why = ("check_finite=True (its update would have to wait for the check)" if cfg.check_finite else
           f"kvstore={cfg.kvstore!r} (the store runs the update)" if cfg.kvstore is not None else
           f"mixed precision {plan.mixed_precision}" if plan.mixed_precision != "off" else None)
    if why is not None:
        raise UsageError(f"plan {plan.name!r} with {why}: a {plan.execution} step runs forward to update in one "
                         f"piece; use {plan.name.replace(plan.execution, 'eager')}")


def resize_state(state: dict[str, Any], replicas: int) -> dict[str, Any]:
    """``state`` (a Trainer's) for another number of replicas: weights and optimizer are the same; each
    replica's buffers start from the first's (plans with BatchNorm keep the count, so this is exact there)."""
    buffers = state["buffers"]
    if len(buffers) == replicas:
        return state
    return {**state, "buffers": [buffers[i] if i < len(buffers) else buffers[0] for i in range(replicas)]}


class PlanState:
    """A Trainer's plan: its mode, the plan in force, the reference, and the decision that chose it."""

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
        self.source: nn.Module | None = None
        self.fell_back = False
        self.fallback = True
        """Whether a failed step may fall back (a candidate being measured must fail instead)."""
        self.built: Plan | None = None
        """The plan the Trainer is built on now (None: no plan)."""

    @property
    def pending(self) -> bool:
        """Planning waits for the first batch."""
        return self.mode == "auto" and self.plan is None

    def start(self, module: nn.Module, devices: list[Device], cfg: TrainerConfig
              ) -> tuple[list[Device], TrainerConfig]:
        """The devices and config the Trainer first builds on."""
        if self.mode is None:
            return devices, cfg
        self.reference = self.built = reference_plan(module, devices, cfg)
        if self.mode == "auto":
            self.source = module
            return devices, cfg
        assert self.plan is not None
        self.built = self.plan
        return apply_plan(self.plan, devices, cfg)

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

    def declined(self, trainer: Trainer) -> str | None:
        """Why ``trainer`` does not run what its plan's execution says (see :attr:`CandidateRun.declined`)."""
        step = trainer._whole_step
        if self.plan is None or step is None:
            return None
        return EXECUTIONS.get(self.plan.execution).declined(step)

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

    # -- planning, adopting, falling back -------------------------------------------------------------
    def plan_now(self, trainer: Trainer, X: Any, y: Any) -> None:
        """Plan on this batch (the Trainer's first) and rebuild ``trainer`` on the winner."""
        assert self.source is not None and self.reference is not None
        if trainer.processes is not None:
            self.plan = self.reference
            say("plan: kept as given (a Trainer across processes plans in one process only)")
            return
        source, given = self.source, trainer.config

        def build(plan: Plan) -> CandidateRun:
            if EXECUTIONS.get(plan.execution).whole_step:  # candidates skip the finiteness check; the run will not
                _check_whole_step(plan, given)
            model = copy.deepcopy(source).to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]
            cfg = dataclasses.replace(given, plan=plan, trace=None, processes=None, check_finite=False)
            candidate = type(trainer)(model, plan.devices_for(trainer.devices), config=cfg)
            candidate.planning.fallback = False
            return CandidateRun(step=lambda: candidate.train_step(X, y), close=candidate.close,
                                threads=plan.replicas * plan.threads,
                                declined=lambda: candidate.planning.declined(candidate))

        self.decision = search(source, (X, y), trainer.devices, build, self.reference, self.options)
        if self.decision.faster_with_processes:
            say(self.decision.faster_with_processes)
        self.adopt(trainer, self.decision.plan)
        self.source = None

    def adopt(self, trainer: Trainer, plan: Plan) -> None:
        """Rebuild ``trainer`` on ``plan``, carrying its weights, buffers and optimizer state over."""
        self.plan = plan
        devices, cfg = apply_plan(plan, trainer.devices, trainer.config)
        if plan == self.built:
            return
        self.built = plan
        state = trainer.state_dict()
        module = trainer.replicas[0].to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]
        trainer._teardown(abort=True)  # a failed step's operations may still hold their error
        trainer._build(module, devices, cfg)
        trainer.load_state_dict(resize_state(state, len(devices)))

    def adopt_recorded(self, trainer: Trainer, recorded: object) -> None:
        """A checkpoint's plan: taken over unless this Trainer was given another one."""
        plan = Plan.from_dict(recorded, "the checkpoint's plan")
        if plan == self.plan:
            return
        here = Here(trainer.devices, check_finite=trainer.config.check_finite, allow_mixed_precision=True,
                    can_launch=False)
        if usable_here(plan, here, "the state given to load_state_dict", "training without it") is None:
            return
        if self.mode == "pinned" and plan != self.plan:
            say(f"plan: {self.plan.name if self.plan else '?'} as given; the checkpoint's {plan.name} is not used")
            return
        if self.mode is None:
            self.mode, self.reference = "pinned", reference_plan(trainer.replicas[0], trainer.devices,
                                                                 trainer.config)
        self.source = None
        self.adopt(trainer, plan)

    def fall_back(self, trainer: Trainer, exc: BaseException) -> bool:
        """After a step failed under a plan: rebuild on the reference and say so (True), or let it raise."""
        if (self.fell_back or not self.fallback or self.plan is None or self.reference is None
                or self.plan == self.reference
                or self.plan.launcher == "processes"  # one process alone cannot leave the others' plan
                or isinstance(exc, DlperfError) or not isinstance(exc, (RuntimeError, MemoryError))):
            return False
        self.fell_back = True
        text = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        say(f"plan: {self.plan.summary()} failed ({type(exc).__name__}: {text}); falling back to "
            f"{self.reference.summary()}")
        self.adopt(trainer, self.reference)
        return True

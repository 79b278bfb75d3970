"""Whether a plan can run here: the one check of every plan that comes from outside this run.

A plan read from the plan cache, from a checkpoint or given by name says how to lay a step out; its fields
are valid one by one (:class:`~dlperf.parallel.planning.plan.Plan` checks that), but it may still not fit this machine
and this run: more threads than the cores, more replicas than examples in a batch, another number of GPUs or
processes, a store that needs processes this run does not have, mixed precision on a CPU or not allowed.
:func:`plan_problem` says why in one phrase; :func:`usable_here` is what the cache and checkpoint readers
call: the plan, or None after one line naming where it came from (the run then goes on without it).

>>> from dlperf.devices import cpu
>>> from dlperf.parallel.planning.plan import parse_plan
>>> here = Here(devices=[cpu(0)], batch_size=64, cores=2)
>>> plan_problem(parse_plan("1x1024"), here)
'1024 threads for each replica, more than the 2 cores this process may use'
>>> plan_problem(parse_plan("1x2"), here) is None
True
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..._cliargs import one_line
from ...devices import Device
from ...errors import UsageError
from .plan import EXECUTIONS, Plan

__all__ = ["ANY", "Here", "plan_problem", "usable_here", "keep_usable_plan", "resize_state"]

log = logging.getLogger(__name__)

ANY = "<any>"


@dataclass(frozen=True)
class Here:
    """What a plan must fit: this machine and this run."""

    devices: Sequence[Device]
    """The devices the run was given."""
    batch_size: int | None = None
    """Examples in one (global) batch, when known: every replica needs at least one."""
    processes: int = 1
    """Processes this run trains as (1: this one)."""
    can_launch: bool = True
    """Whether a plan whose replicas are processes may start them (in one process that is not a launched one)."""
    cores: int | None = None
    """CPU cores this process may use (None: as :func:`~dlperf.machine.usable_cores` says)."""
    allow_mixed_precision: bool = False
    """Whether the run allows bf16, which changes the numerics."""
    check_finite: bool = False
    """The run checks every step's loss and gradients before the update (no whole-step execution then)."""
    executions: Sequence[str] | None = None
    """The executions this run may use (None: any registered one)."""
    kvstore: object = ANY
    """The store the run's state is laid out for, which the plan must keep (a checkpoint's); :data:`ANY`: any
    store that can run here."""


def plan_problem(plan: Plan, here: Here) -> str | None:
    """Why ``plan`` cannot run here (one phrase, the values named), or None when it can."""
    from ...machine import usable_cores

    cores = here.cores or usable_cores()
    gpus = [d for d in here.devices if d.is_gpu]
    processes = plan.replicas if plan.launcher == "processes" else 1
    if plan.threads > cores:
        return f"{plan.threads} threads for each replica, more than the {cores} cores this process may use"
    if here.batch_size is not None and plan.replicas > here.batch_size:
        return f"{plan.replicas} replicas, more than the {here.batch_size} examples of a batch"
    if plan.launcher == "processes":
        if here.processes not in (1, plan.replicas):
            return f"{plan.replicas} processes, but this run trains as {here.processes}"
        if here.processes != plan.replicas and not here.can_launch:
            return f"{plan.replicas} processes, which this run cannot start"
        if gpus:
            return "replicas as processes, which sum their gradients on host memory, on GPU devices"
    elif here.processes > 1:
        return f"replicas as threads of one process, but this run trains as {here.processes} processes"
    elif gpus and plan.replicas != len(gpus):
        return f"{plan.replicas} replicas, but {len(gpus)} GPUs were given (one replica a GPU)"
    return (_store_problem(plan, here, processes) or _device_problem(plan, here, bool(gpus))
            or _execution_problem(plan, here))


def _execution_problem(plan: Plan, here: Here) -> str | None:
    if here.executions is not None and plan.execution not in here.executions:
        return f"execution {plan.execution}, not one of those this run may use ({', '.join(here.executions)})"
    if EXECUTIONS.get(plan.execution).whole_step:
        if here.check_finite:
            return f"a {plan.execution} step, which cannot hold its update back for the finiteness check"
        if plan.kvstore is not None or plan.mixed_precision != "off":
            return f"a {plan.execution} step with a store or mixed precision, which it does not run"
    return None


def _store_problem(plan: Plan, here: Here, processes: int) -> str | None:
    from ...kvstore import kvstore_types
    from ..communication.servers import is_dist_kvstore

    # what no run could do is said before what this run's state rules out
    if plan.kvstore is not None:
        if plan.kvstore not in kvstore_types():
            return f"kvstore {one_line(plan.kvstore)[:40]!r}, not a store type here ({', '.join(kvstore_types())})"
        processes = max(processes, here.processes)
        if is_dist_kvstore(plan.kvstore) and processes == 1:
            return f"kvstore {plan.kvstore}, a distributed store, which needs several processes, in one"
        if not is_dist_kvstore(plan.kvstore) and processes > 1:
            return f"kvstore {plan.kvstore}, which sums one process's devices only, across {processes} processes"
    if here.kvstore != ANY and plan.kvstore != here.kvstore:
        return (f"kvstore {one_line(str(plan.kvstore))[:40]}, but this run's state is laid out for "
                f"{here.kvstore or 'allreduce (no store)'}")
    return None


def _device_problem(plan: Plan, here: Here, gpus: bool) -> str | None:
    if plan.mixed_precision == "fp16":
        return "fp16, which needs loss scaling the Trainer does not do"
    if plan.mixed_precision == "bf16" and not gpus:
        return "bf16 mixed precision, which is planned for GPUs, on CPU devices"
    if plan.mixed_precision != "off" and not here.allow_mixed_precision:
        return f"{plan.mixed_precision} mixed precision, which changes the numerics and this run does not allow"
    if not gpus and (plan.cudnn_benchmark or plan.pin_memory):
        return "cuDNN benchmark mode or pinned memory, which are for GPUs, on CPU devices"
    if gpus and plan.step_thread == "caller":
        return "a step on the calling thread, which runs CPU steps, on GPU devices"
    return None


_told: set[str] = set()


def usable_here(plan: Plan, here: Here, source: str, instead: str) -> Plan | None:
    """``plan`` when it can run here; else None, after one warning (once a process) naming ``source``
    (where the plan came from: ``"the plan cache PATH"``, ``"the checkpoint FILE"``), the plan, the problem
    and what the run does ``instead``."""
    problem = plan_problem(plan, here)
    if problem is None:
        return plan
    line = one_line(f"dlperf plan: ignoring the plan {plan.name} from {source}: {problem}; {instead}")
    if line not in _told:
        _told.add(line)
        log.warning(line)
    return None


def resize_state(state: dict[str, Any], replicas: int) -> dict[str, Any]:
    """``state`` (a Trainer's) for another number of replicas: weights and optimizer are the same; each
    replica's buffers start from the first's (plans with BatchNorm keep the count, so this is exact there)."""
    buffers = state["buffers"]
    if len(buffers) == replicas:
        return state
    return {**state, "buffers": [buffers[i] if i < len(buffers) else buffers[0] for i in range(replicas)]}


def keep_usable_plan(state: dict, here: Here, source: str) -> None:
    """Drop the plan recorded in a Trainer's ``state`` (a checkpoint's) when it cannot run here, after one line;
    the buffers are then laid out for the devices of ``here``, as a run without the plan keeps them (one per
    device; plans differ in replica count only for models without batch statistics, whose buffers are alike)."""
    recorded = state.get("plan")
    if recorded is None:
        return
    try:
        plan = Plan.from_dict(recorded, f"the plan of {source}")
    except (UsageError, TypeError):
        return  # not a plan at all: the checkpoint's own check names it
    if usable_here(plan, here, source, "training without it") is None:
        del state["plan"]
        if isinstance(state.get("buffers"), list) and state["buffers"]:
            state.update(resize_state(state, len(here.devices)))

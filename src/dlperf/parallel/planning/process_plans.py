"""Plans whose replicas are processes: enumerated, measured by launching them, realised by a launch.

A plan ``2x1,processes`` trains as 2 processes of 1 intra-op thread each, joined by gloo on this host (the
``processes`` strategy: each process takes its slice of the global batch, gradients are summed across
processes bucket by bucket while backward runs). The planner measures such a plan by starting the real
processes once (:class:`~dlperf.parallel.launchers.ProcessLauncher`, gloo on 127.0.0.1) and keeping them
up across its rounds: a :class:`ProcessCandidate`'s ``step()`` asks every process for one training step on
the whole batch (each trains on its slice, as ``dlperf train --nproc-per-node`` would) and returns when the
last one has finished, so its time is the same step the in-process candidates are timed on, plus one
round trip through a local TCP store (tens of microseconds; it counts against the processes). Between
its turns the processes sleep in a blocking wait, so they leave the cores to the other candidates.

Starting the processes costs seconds (spawned interpreters import torch): :data:`START_S` is that cost,
which the planner weighs against its budget before building the candidate (:attr:`setup_s`). A candidate
whose processes fail is dropped with the failure's line, and every process it started is stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

from torch import nn

from ..._threads import ServiceThread
from ...devices import Device
from ...errors import UsageError
from .plan import Plan, has_batch_statistics

__all__ = ["START_S", "START_TIMEOUT_S", "ProcessCandidate", "process_plans", "measuring_processes",
           "processes_measurable", "in_process_part", "launch_hint", "setup_s"]

START_S = 6.0
"""Seconds to start a candidate's processes and build their Trainers (spawned interpreters import torch;
measured 4-10 s on 2 shared cores), counted against the planner's budget before a processes plan is built;
once a start has been timed in this process, the slower of the two counts."""
_last_start_s = 0.0
START_TIMEOUT_S = 60.0
"""The longest a planner's candidate may take to start its processes before it is dropped."""
STEP_TIMEOUT_S = 120.0
"""The longest one candidate step may take before the candidate is dropped."""
IDLE_TIMEOUT_S = 300.0
"""A candidate process that hears nothing from the planner this long stops by itself."""
_MAX_PROCESSES = 8
_WAIT_SLICE_S = 0.2  # the planner's waits on its candidates' processes, in slices of this (signals run between)

_MEASURABLE: ContextVar[bool] = ContextVar("dlperf_measure_processes", default=False)


@contextlib.contextmanager
def measuring_processes(on: bool = True) -> Iterator[None]:
    """Within it the planner also enumerates plans whose replicas are processes (the caller can launch them:
    ``dlperf train`` and :func:`~dlperf.parallel.training.planned.plan_for`, not a Trainer already in one process)."""
    token = _MEASURABLE.set(on)
    try:
        yield
    finally:
        _MEASURABLE.reset(token)


def processes_measurable() -> bool:
    return _MEASURABLE.get()


def process_plans(model: nn.Module, devices: Sequence[Device], reference: Plan, cores: int, examples: int,
                  layouts: Sequence[str], notes: list[str]) -> list[Plan]:
    """``RxT,processes`` plans that fill ``cores`` (R >= 2), each layout; none where they cannot be measured."""
    if not processes_measurable():
        return []
    if reference.kvstore is not None:
        notes.append(f"processes: not measured with kvstore {reference.kvstore!r} (its store lives in one process)")
        return []
    if any(d.is_gpu for d in devices):
        notes.append("processes: not measured on GPUs (one process per GPU is dlperf launch's choice)")
        return []
    counts = [r for r in range(2, min(cores, examples, _MAX_PROCESSES) + 1) if cores % r == 0]
    if has_batch_statistics(model):
        counts = [r for r in counts if r == reference.replicas]
        if not counts:
            notes.append(f"processes: not measured (BatchNorm's statistics depend on the split; the reference has "
                         f"{reference.replicas} replica{'s' * (reference.replicas > 1)})")
    plans = []
    for r in counts:
        # one replica per process: the sums across processes are procs' own choice (measured per group), and no
        # allreduce among one process's devices is left to choose
        for layout in layouts:
            plans.append(Plan(replicas=r, threads=cores // r, launcher="processes", memory_format=layout,
                              algorithm=reference.algorithm, bucket_bytes=reference.bucket_bytes))
    return plans


def in_process_part(plan: Plan) -> Plan:
    """What one process of a processes plan runs: one replica with the plan's threads, layout and execution."""
    return dataclasses.replace(plan, replicas=1, launcher="threads", step_thread="worker")


def launch_hint(plan: Plan) -> str:
    """How a user gets ``plan`` (a processes plan) from one process."""
    return (f"run under dlperf launch --nproc-per-node {plan.replicas} (or dlperf train --nproc-per-node "
            f"{plan.replicas} --plan {plan.name})")


# -- the candidate processes (their worker is planned._candidate_worker: it needs the Trainer) ------
class ProcessCandidate:
    """A processes plan's processes, started once and stepping when asked (see the module's notes).

    ``step()`` runs one training step on the whole batch in every process; ``close()`` stops them and waits
    for them to go. ``worker(plan, model, batch, config, port, idle_timeout_s)`` is what each process runs
    (:func:`~dlperf.parallel.training.planned.start_candidate` gives the Trainer's). Any failure (a process
    that dies, a step past ``STEP_TIMEOUT_S``) raises one RuntimeError naming it, after which ``close()``
    leaves nothing running.
    """

    def __init__(self, plan: Plan, model: nn.Module, batch: tuple[Any, Any], config: Any, *,
                 worker: Callable[..., None], start_timeout_s: float = 120.0) -> None:
        import torch.distributed as dist

        from ..launchers import ProcessLauncher, free_port

        if plan.launcher != "processes":
            raise UsageError(f"plan {plan.name!r} does not run as processes")
        self.plan = plan
        self.world = plan.replicas
        port = free_port()
        self.store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=STEP_TIMEOUT_S))
        self._n = 0
        self._failure: BaseException | None = None
        self._launcher = ProcessLauncher(self.world, backend="gloo", join_timeout_s=IDLE_TIMEOUT_S * 4,
                                         collective_timeout_s=STEP_TIMEOUT_S)
        cfg = dataclasses.replace(config, plan=None, trace=None, check_finite=False)
        self._worker = worker
        self._thread = ServiceThread(self._launch, model, batch, cfg, port, name="dlperf-plan-processes")
        self._thread.start()
        started = time.perf_counter()
        try:
            self._wait([f"ready/{r}" for r in range(self.world)], start_timeout_s, "start")
        except BaseException:
            self.close()
            raise
        global _last_start_s
        _last_start_s = time.perf_counter() - started

    def _launch(self, model: nn.Module, batch: tuple[Any, Any], cfg: Any, port: int) -> None:
        try:
            self._launcher.launch(self._worker, self.plan, model, batch, cfg, port, IDLE_TIMEOUT_S)
            failure: BaseException = RuntimeError("its processes ended")
        except BaseException as exc:  # noqa: BLE001 - handed to the planner's thread by the keys below
            failure = exc
        self._failure = failure
        # the planner's thread waits on these keys without polling: answer them with the failure, for the
        # step it may be waiting on now and the one it may start next (it checks _failure before each)
        n = self._n
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            # its own connection: the planner's thread holds the first one while it waits
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
            for key in ([f"ready/{r}" for r in range(self.world)]
                        + [f"done/{i}/{r}" for i in (n, n + 1) for r in range(self.world)]):
                store.set(key, "failed")

    def _wait(self, keys: list[str], timeout_s: float, what: str) -> None:
        # in slices: a signal's handler (Ctrl-C, SIGTERM) runs only between them, and must not wait for the start
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.store.wait(keys, datetime.timedelta(seconds=max(0.001, min(_WAIT_SLICE_S,
                                                                                 deadline - time.monotonic()))))
                break
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"{self.plan.name}: its processes did not {what} within {timeout_s:.0f} s"
                                       ) from None
        if any(self.store.get(k) != b"ok" for k in keys):
            why = self._failure
            text = str(why).strip().splitlines()[0][:200] if why is not None and str(why).strip() else "it failed"
            raise RuntimeError(f"{self.plan.name}: a process failed to {what}: {text}")

    def step(self) -> None:
        self._n += 1
        if self._failure is not None:
            raise RuntimeError(f"{self.plan.name}: its processes ended ({str(self._failure)[:200]})")
        self.store.set(f"cmd/{self._n}", "step")
        self._wait([f"done/{self._n}/{r}" for r in range(self.world)], STEP_TIMEOUT_S, "step")

    def close(self) -> None:
        """Stop the processes (they finish their step, then leave) and wait until they are gone."""
        with contextlib.suppress(Exception):
            self.store.set(f"cmd/{self._n + 1}", "stop")
        self._thread.join(timeout=30.0)
        if self._thread.is_alive():  # pragma: no cover - a process stuck in a collective: its group is killed
            for r in range(self.world):
                with contextlib.suppress(Exception):
                    if self.store.check([f"pid/{r}"]):  # each worker leads its own process group
                        os.killpg(int(self.store.get(f"pid/{r}")), signal.SIGKILL)
            self._thread.join(timeout=10.0)


def setup_s(plan: Plan) -> float:
    """The one-off seconds building ``plan``'s candidate costs before its first step (what the budget must hold)."""
    return max(START_S, _last_start_s) if plan.launcher == "processes" else 0.0

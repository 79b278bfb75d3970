"""What a gradient synchronization strategy works on: the trainer's replicas and the engine of their steps.

The Trainer makes one :class:`StepContext` and hands it to its strategy's
:meth:`~dlperf.parallel.strategies.strategy.Strategy.attach`. It holds the replicas, their devices, the
engine with its communication lanes, the engine variables that order a step's operations, and the
few mechanics every strategy shares: waiting for a group of operations, renewing the variables a
failed operation left poisoned, and the finiteness check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...devices import Device, cpu
from ...engine import Engine, Op, Var
from ...errors import DlperfError
from ..allreduce import AllreduceAlgorithm
from ..allreduce.lanes import EngineLanes
from ..communication.process_group import ProcessAxis
from ..optimizers import optimizer_name

__all__ = ["StepContext", "NonFiniteError", "wait_each"]


class NonFiniteError(DlperfError, FloatingPointError):
    """A training step produced a NaN or infinite loss or gradient; the weights were not updated."""


def _no_result() -> None:
    return None


def wait_each(ops: Sequence[Op]) -> list[Any]:
    """Wait for every operation (even after a failure, so none still runs); return the results or raise once."""
    results, first = [], None
    for op in ops:
        try:
            results.append(op.wait())
        except BaseException as exc:
            if first is None:
                first = exc
    if first is not None:
        raise first
    return results


@dataclass(eq=False)
class StepContext:
    """The replicas a strategy keeps identical, the engine their steps run on, and the step's variables."""

    replicas: list[nn.Module]
    """One copy of the model per device, in device order."""
    devices: list[Device]
    """This process's devices."""
    engine: Engine
    """The engine every operation of a step runs on."""
    lanes: EngineLanes
    """The communication lanes reductions are pushed to."""
    processes: ProcessAxis | None
    """The processes the trainer spans (None: this one alone)."""
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    """Builds one optimizer over the parameters given (one per replica, or per store key)."""
    algorithm: AllreduceAlgorithm
    """The allreduce algorithm for gradient buckets."""
    bucket_bytes: int | None = None
    """Gradient bucket size (None: the buckets' default)."""
    check_finite: bool = False
    """Check the loss and gradients for NaN/inf before every update."""
    clip_grad_norm: float | None = None
    """Scale the summed gradients down to this total 2-norm before every update (None: never)."""
    steps: int = 0
    """Finished steps (the trainer's counter)."""
    replica_vars: list[Var] = field(init=False)
    """Per replica: written by each of its steps (weights, buffers, gradients), so they run in order."""
    step_vars: list[Var] = field(init=False)
    """Per replica: written by its forward and backward only; updates pushed during backward read them all,
    so a replica whose step failed leaves every replica's weights as they were."""
    across_var: Var = field(init=False)
    """Written by every operation that talks to the other processes: they run in the order pushed, the same
    order in every process."""

    def __post_init__(self) -> None:
        self.replica_vars = [self.engine.new_var(f"replica {d}") for d in self.devices]
        self.step_vars = [self.engine.new_var(f"step {d}") for d in self.devices]
        self.across_var = self.engine.new_var("across processes")

    @property
    def update_waits(self) -> bool:
        """Whether an update must wait for every gradient first (a finiteness check, the total norm to clip): no
        update is pushed from backward then."""
        return self.check_finite or self.clip_grad_norm is not None

    def clip_(self, grads: Sequence[Sequence[torch.Tensor]]) -> None:
        """Scale ``grads`` (per replica, each the same sums) so their total 2-norm is at most ``clip_grad_norm``:
        the norm from the first replica's, the factor applied to every replica's, as
        ``torch.nn.utils.clip_grad_norm_`` does for one."""
        if self.clip_grad_norm is None or not grads or not grads[0]:
            return
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach()) for g in grads[0]]))
        factor = torch.clamp(self.clip_grad_norm / (norm + 1e-6), max=1.0)
        for row in grads:
            torch._foreach_mul_(list(row), factor.to(row[0].device))

    @property
    def k(self) -> int:
        """How many devices (replicas) this process trains on."""
        return len(self.devices)

    def process_lane(self) -> Device:
        """The engine device for collectives across processes.

        A logical device of its own after the communication lanes: a collective waiting for the other
        processes blocks this worker only, not the local reductions.
        """
        return cpu(max(lane.index for lane in self.lanes.lanes) + 1)

    def wait_ops(self, ops: Sequence[Op]) -> list[Any]:
        """Wait for every operation (even after a failure, so none still runs), then return or raise once.

        The wait is on one joining operation that reads every replica's variable, not on the operations
        themselves: a thread waiting on a queued operation of an idle worker runs it itself, and the
        caller's thread would then run replica 0's step (measured 25-35% slower here than on its worker,
        and serial with replica 1's when both are taken).
        """
        # Across processes it is different. With one device per process the caller waits on the replica's
        # operation itself, and usually runs it: on a machine whose cores are shared by the processes
        # every hand-off between threads waits for a core, and the slower process holds back the sum of
        # both (LeNet, 2 processes: 10-35% slower per step with the hand-off than PyTorch DDP, on par
        # without it). Otherwise the join waits on the processes' lane, behind the step's sums there.
        lane, kind = (self.process_lane(), "compute") if self.processes is not None else \
            (self.lanes.lanes[0], self.lanes.kind)
        if len(ops) == 1 and self.processes is not None:
            join = ops[0]
        else:
            join = self.engine.push(_no_result, reads=tuple(self.replica_vars), device=lane, kind=kind, name="join")
        try:
            join.wait()
        except Exception:  # an operation failed: each one's error is reported through its own handle below
            pass
        return wait_each(ops)

    def renew_failed_vars(self) -> None:
        """Replace every variable a failed operation wrote.

        Such a variable carries its error to every later operation on it; the error has been raised to
        the caller now, so the next step starts on a clean variable.
        """
        for i, v in enumerate(self.replica_vars):
            if v.exc is not None:
                self.replica_vars[i] = self.engine.new_var(f"replica {self.devices[i]}")
        for i, v in enumerate(self.step_vars):
            if v.exc is not None:
                self.step_vars[i] = self.engine.new_var(f"step {self.devices[i]}")

    def push_optimizer_steps(self, optimizers: Sequence[torch.optim.Optimizer],
                             reads: tuple[Var, ...] = ()) -> list[Op]:
        """Push each replica's optimizer step on its device after ``reads``; the operations, not waited for."""
        return [self.engine.push(opt.step, reads=reads, writes=(self.replica_vars[i],), device=d,
                                 name=f"{optimizer_name(opt)} {d}")
                for i, (d, opt) in enumerate(zip(self.devices, optimizers))]

    def step_optimizers(self, optimizers: Sequence[torch.optim.Optimizer], reads: tuple[Var, ...] = ()) -> None:
        """Push each replica's optimizer step on its device after ``reads``, and wait for them all."""
        ops = self.push_optimizer_steps(optimizers, reads)
        try:
            self.wait_ops(ops)
        except BaseException:
            self.renew_failed_vars()
            raise

    def replica_grads(self) -> list[torch.Tensor]:
        """Every replica's gradients (those that exist)."""
        return [p.grad for r in self.replicas for p in r.parameters() if p.grad is not None]

    def raise_if_nonfinite(self, what: str, tensors: Sequence[torch.Tensor]) -> None:
        """Raise :class:`NonFiniteError` naming the step when any of ``tensors`` holds a NaN or inf."""
        if not tensors:
            return
        first = self.devices[0].torch_device
        # one host read per step for all tensors together
        ok = torch.stack([torch.isfinite(t).all().to(first) for t in tensors]).all()
        if bool(ok):
            return
        detail = ""
        if what == "loss":
            detail = " (" + ", ".join(f"{d}: {float(t.sum()):g}" for d, t in zip(self.devices, tensors)) + ")"
        raise NonFiniteError(f"step {self.steps + 1}: the {what} is not finite{detail}; the weights were not "
                             "updated. Look for NaN/inf in the batch's inputs, or lower the learning rate")

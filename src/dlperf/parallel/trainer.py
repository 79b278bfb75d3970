"""Trainer: data-parallel training of one model on k devices (d2l 12.6, concisely).

Every step runs on one asynchronous dependency engine (d2l 12.2): each replica's forward and backward
is an engine operation on its device's worker, each gradient bucket's reduction is pushed by backward
hooks as soon as the bucket is full (operations on communication lanes, see
:mod:`dlperf.parallel.lanes`), and the optimizer steps are pushed from backward too, right after the
last bucket's reduction, as operations that read the buckets' variables (one per GPU; on logical CPU
devices one that steps every replica's optimizer). The caller pushes the replicas' operations and is
woken once, when the last replica ends. ``trace=`` or :meth:`Trainer.start_trace` records the engine's
timeline.

>>> import torch
>>> from torch import nn
>>> from dlperf.devices import cpu
>>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
>>> X, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
>>> with Trainer(net, [cpu(0), cpu(1)], "sgd", {"lr": 0.1}) as trainer:
...     loss = trainer.train_step(X, y)
...     trainer.max_replica_difference()
0.0

Started as several processes (``dlperf launch``, ``torchrun``), a Trainer spans them all: every process
passes the same global batch, trains on its slice, and gradients are summed within each process and
then across processes, bucket by bucket while backward runs (:mod:`dlperf.parallel.procs`).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..devices import Device, DeviceLike, cpu
from ..engine import Engine, Op, Trace, create_engine
from ..engine.var import DONE
from ..errors import DlperfError, UsageError, unknown_choice
from ..kvstore import KVStore, create_kvstore
from .allreduce import DEFAULT_ALGORITHM, AllreduceAlgorithm, get_algorithm
from .buckets import Across, GradientBuckets
from .evaluate import evaluate_accuracy
from .lanes import EngineLanes, comm_lanes, thread_budget
from .procs import ProcessAxis, allreduce_across_processes, broadcast_from_first, join_processes, local_parts
from .replicas import broadcast_buffers, max_replica_difference, replicate
from .servers import is_dist_kvstore, open_dist_kvstore
from .split import check_devices, check_placed, place_parts, split_batch, split_sizes

__all__ = ["Trainer", "make_optimizer", "OPTIMIZERS", "NonFiniteError"]

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}
BUFFER_MODES = ("per-device", "broadcast")
MEMORY_FORMATS = ("auto", "contiguous", "channels_last")

OptimizerLike = str | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def make_optimizer(optimizer: OptimizerLike, params: Iterable[nn.Parameter],
                   optimizer_params: dict[str, Any] | None = None) -> torch.optim.Optimizer:
    """Build an optimizer from a name (``sgd``, ``adam``, ``adamw``) or a factory ``params -> optimizer``.

    Named SGD updates all parameters with one multi-tensor (``foreach``) call unless the parameters
    say otherwise: on CPU PyTorch's default loops over the tensors in Python, which costs LeNet's
    update 55 us instead of 37 us, and the update runs on the critical path between two steps.
    """
    if callable(optimizer):
        return optimizer(params)
    try:
        cls = OPTIMIZERS[str(optimizer).lower()]
    except KeyError:
        raise unknown_choice("optimizer", optimizer, OPTIMIZERS) from None
    kwargs = dict(optimizer_params or {})
    if cls is torch.optim.SGD and "foreach" not in kwargs and not kwargs.get("fused") \
            and not kwargs.get("differentiable"):
        kwargs["foreach"] = True
    return cls(params, **kwargs)


class NonFiniteError(DlperfError, FloatingPointError):
    """A training step produced a NaN or infinite loss or gradient; the weights were not updated."""


def _no_result() -> None:
    return None


def _wait_each(ops: Sequence[Op]) -> list[Any]:
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


def _optimizer_name(opt: torch.optim.Optimizer) -> str:
    return type(opt).__name__.lower()


def _default_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


class Trainer:
    """Keeps one replica per device identical while training them on the parts of each batch.

    Args:
        module: the model; it is copied onto every device (``trainer.module`` is the first copy).
        devices: distinct, available devices, e.g. ``[cpu(0), cpu(1)]`` or ``try_all_gpus()``.
        optimizer: a name from :data:`OPTIMIZERS` or a factory ``params -> torch.optim.Optimizer``;
            every replica gets its own instance, and identical gradients keep them identical.
        optimizer_params: keyword arguments for a named optimizer, e.g. ``{"lr": 0.1}``.
        loss: ``loss(output, target)`` averaged over the examples it sees (cross-entropy by default).
        algorithm: the allreduce algorithm for gradients (ignored when a kvstore aggregates).
        kvstore: ``None``, ``"local"``, ``"device"`` or a :class:`~dlperf.kvstore.KVStore`; across processes
            a distributed one, ``"dist_sync"`` or ``"dist_device_sync"`` (see below).
        update_on_kvstore: let the store run the optimizer and pull the new weights (implied by a
            distributed store).
        bucket_bytes: gradient bucket size for overlapping communication with backward (default: 1 MiB,
            or larger so that the model's gradients form at most 16 buckets).
        buffers: ``"per-device"`` BatchNorm statistics (default) or ``"broadcast"`` the first one's.
        threads: intra-op threads per device worker (default: the cores split evenly); the engine
            gives every CPU worker one budget, so the entries must be equal.
        memory_format: layout of 4-D activations and conv weights. ``"auto"`` picks channels-last
            for models with 2-D convolutions on CPU devices: oneDNN's convolutions and PyTorch's
            pooling then skip layout reorders (LeNet, batch 128, one core: 71 -> 46 ms per step).
        check_finite: before each update, check that the loss and the aggregated gradients are
            finite and raise :class:`NonFiniteError` naming the step if not, so one bad example
            cannot turn every replica's weights into NaN. It reads one flag per step on the host,
            so it is off by default.
        trace: a path: record the engine's timeline of the whole run and write it there (Chrome
            trace JSON, ``dlperf trace FILE`` summarises it) when the trainer closes.
        processes: ``"auto"`` (default): train together with the other processes of the job when this
            process was started as one of several (``dlperf launch``, ``torchrun``: ``WORLD_SIZE`` > 1),
            joining their gloo process group if none exists yet; ``None``: this process alone; or a
            ``torch.distributed`` process group to span. Across processes, :meth:`train_step` takes the
            global batch, the same in every process, and ``devices`` are this process's own.

    Across processes: the first process's weights are copied to the others when the trainer starts;
    a batch with fewer examples than the devices of all processes together is refused in every
    process alike (so no process waits for another); a parameter that gets no gradient in some
    process contributes zeros there, as in one process. Gradient summation across processes needs
    CPU devices (gloo on host memory).

    With a distributed store (d2l 12.7) the processes push their gradients to the parameter servers,
    which sum them, run the optimizer and answer the pulls with the new weights. The servers are the
    job's last ``num_servers`` ranks (``dlperf launch --num-servers``; they run
    :func:`~dlperf.parallel.servers.serve_kvstore`, not a Trainer), or, with none, every process hosts
    one for its share of the weights. The Trainer then spans the worker ranks only.
    """

    def __init__(self, module: nn.Module, devices: Sequence[DeviceLike], optimizer: OptimizerLike = "sgd",
                 optimizer_params: dict[str, Any] | None = None, *,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 algorithm: str | AllreduceAlgorithm = DEFAULT_ALGORITHM,
                 kvstore: str | KVStore | None = None, update_on_kvstore: bool = False,
                 bucket_bytes: int | None = None, buffers: str = "per-device",
                 threads: Sequence[int] | None = None, memory_format: str = "auto",
                 check_finite: bool = False, trace: str | Path | None = None,
                 processes: Any = "auto") -> None:
        self.devices = check_devices(devices)
        self.check_finite = check_finite
        if memory_format not in MEMORY_FORMATS:
            raise unknown_choice("memory format", memory_format, MEMORY_FORMATS)
        self.algorithm = get_algorithm(algorithm)
        if buffers not in BUFFER_MODES:
            raise unknown_choice("buffer mode", buffers, BUFFER_MODES)
        if update_on_kvstore and kvstore is None:
            raise UsageError("update_on_kvstore=True needs a kvstore, e.g. kvstore='local'")
        self.buffers = buffers
        self.loss = loss or _default_loss
        self._kv: KVStore | None = None
        self._own_kv = False
        self.processes: ProcessAxis | None = self._join(processes, kvstore)
        if self._kv is not None:
            kvstore, update_on_kvstore = self._kv, True
        if self.processes is not None:  # every process starts from the first one's weights
            broadcast_from_first([*module.parameters(), *module.buffers()], self.processes.group)
        self.replicas = replicate(module, self.devices)
        self.channels_last = memory_format == "channels_last" or (
            memory_format == "auto" and not any(d.is_gpu for d in self.devices)
            and any(isinstance(m, nn.Conv2d) for m in module.modules()))
        if self.channels_last:
            for r in self.replicas:
                r.to(memory_format=torch.channels_last)
        self.k = len(self.devices)
        self._factory = optimizer
        self._optimizer_params = dict(optimizer_params or {})
        self.steps = 0
        self._closed = False
        self._buckets: GradientBuckets | None = None
        self._trace_path = Path(trace) if trace is not None else None
        self.engine: Engine = create_engine("threaded", cpu_threads=self._cpu_threads(threads),
                                            trace=trace is not None)
        # one variable per replica for its weights, buffers and gradients: its steps run in order
        self._replica_vars = [self.engine.new_var(f"replica {d}") for d in self.devices]
        # one variable per replica written by its forward+backward only: updates pushed during backward
        # read all of them, so a replica whose step failed leaves every replica's weights as they were
        self._step_vars = [self.engine.new_var(f"step {d}") for d in self.devices]
        self._update_ops: list[Op] = []
        self._updates_pushed = threading.Event()
        lanes, kind = comm_lanes(self.devices)
        self.lanes = EngineLanes(self.engine, lanes, kind)
        # one variable written by every operation that talks to the other processes: they run in the
        # order pushed, the same order in every process
        self._across_var = self.engine.new_var("across processes")
        try:
            self._setup_sync(kvstore, update_on_kvstore, bucket_bytes)
        except BaseException:
            self.close()
            raise

    def _join(self, processes: Any, kvstore: Any) -> ProcessAxis | None:
        if processes is None:
            return None
        axis = join_processes(None if processes == "auto" else processes)
        if axis is None:
            return None
        if kvstore is not None and not is_dist_kvstore(kvstore):
            axis.close()
            raise UsageError(f"kvstore={kvstore!r} in a trainer of {axis.world} processes: the local stores "
                             "aggregate one process's devices only; use 'dist_sync' or 'dist_device_sync', or "
                             "drop the kvstore (gradients are then summed across processes by allreduce)")
        if any(d.is_gpu for d in self.devices):
            axis.close()
            raise UsageError(f"devices {self.devices} in a trainer of {axis.world} processes: gradients are "
                             "summed across processes by gloo on host memory; use CPU devices")
        if kvstore is None:
            return axis
        if axis.group is not None:
            axis.close()
            raise UsageError(f"kvstore={kvstore!r} with processes={processes!r}: a distributed store spans the "
                             "default process group; pass processes='auto'")
        try:
            kv, group = open_dist_kvstore(kvstore)
        except BaseException:
            axis.close()
            raise
        self._kv, self._own_kv = kv, isinstance(kvstore, str)
        return ProcessAxis(kv.rank, kv.num_workers, axis.local_world, group, axis.owns_default_group)

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

    def _process_lane(self) -> Device:
        # a logical device of its own after the communication lanes: a collective waiting for the other
        # processes blocks this worker only, not the local reductions
        return cpu(max(lane.index for lane in self.lanes.lanes) + 1)

    def _cpu_threads(self, threads: Sequence[int] | None) -> int:
        if threads is None:
            cores = self.processes.cores() if self.processes is not None else None
            return max(thread_budget(self.devices, cores))
        budget = list(threads)
        if len(budget) != len(self.devices) or any(not isinstance(t, int) or t < 1 for t in budget):
            raise UsageError(f"threads={budget!r} is not valid; expected one integer >= 1 per device "
                             f"({len(self.devices)} devices)")
        if len(set(budget)) != 1:
            raise UsageError(f"threads={budget!r} gives devices different budgets; the engine gives every CPU "
                             "device worker one budget: pass equal numbers, e.g. threads=[1, 1]")
        return budget[0]

    def _setup_sync(self, kvstore, update_on_kvstore: bool, bucket_bytes: int | None) -> None:
        self.update_on_kvstore = update_on_kvstore
        if kvstore is not None:
            if self._kv is None:  # (a distributed store is opened with the processes, in _join)
                self._kv = create_kvstore(kvstore) if isinstance(kvstore, str) else kvstore
                self._own_kv = isinstance(kvstore, str)
            # the store's asynchronous calls run on this engine, on the first communication lane
            self._kv.bind_engine(self.engine, self.lanes.lanes[0], self.lanes.kind)
        if update_on_kvstore:
            self.optimizers = []
            self._kv.set_optimizer(lambda ps: make_optimizer(self._factory, ps, self._optimizer_params))
            for i, p in enumerate(self.replicas[0].parameters()):
                self._kv.init(i, p.detach())
            return
        self.optimizers = [make_optimizer(self._factory, r.parameters(), self._optimizer_params)
                           for r in self.replicas]
        if self.k > 1 or self.processes is not None:
            across = None
            if self.processes is not None:
                group = self.processes.group
                across = Across(lambda flat: allreduce_across_processes(flat, group), self._process_lane(),
                                self._across_var)
            self._buckets = GradientBuckets(self.replicas, self.algorithm, bucket_bytes, lanes=self.lanes,
                                            across=across)
            if self._kv is not None:
                for b, row in enumerate(self._buckets.flats):
                    self._kv.init(b, torch.zeros_like(row[0], device="cpu"))
                self._buckets.reduce = self._pushpull_bucket

    def _pushpull_bucket(self, b: int) -> list:
        row = self._buckets.flats[b]
        op = self._kv.pushpull_async(b, row, out=row, priority=self._buckets.priorities[b])
        return list(op.writes)

    # -- training ---------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The first replica (on ``devices[0]``): the trained model."""
        return self.replicas[0]

    def _split(self, X, y) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        """This process's part for each of its devices, and the examples of the whole batch."""
        if self.processes is not None:
            return self._split_global(X, y)
        if isinstance(X, (list, tuple)):
            check_placed(X, self.devices, "input")
            check_placed(y, self.devices, "label")
            return list(X), list(y), sum(int(t.shape[0]) for t in X)
        if isinstance(X, torch.Tensor) and isinstance(y, torch.Tensor) and X.dim() > 0 and \
                X.shape[0] == y.shape[0] >= self.k:  # the common case: devices checked once, in __init__
            sizes = split_sizes(X.shape[0], self.k)
            return place_parts(X, self.devices, sizes), place_parts(y, self.devices, sizes), int(X.shape[0])
        Xs, ys = split_batch(X, y, self.devices, even_split=False)  # losses are weighted by share; or one error
        return Xs, ys, int(X.shape[0])

    def _split_global(self, X, y) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        if not isinstance(X, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise UsageError(f"a trainer of {self.world} processes takes the global batch as two tensors, the "
                             f"same in every process, not per-device parts ({type(X).__name__})")
        if X.shape[0] != y.shape[0]:
            raise UsageError(f"features have {X.shape[0]} examples but labels have {y.shape[0]}; they must match")
        n = int(X.shape[0])
        # the same check, on the same global batch, fails in every process: none is left waiting
        start, sizes = local_parts(n, self.world, self.rank, self.k)
        end = start + sum(sizes)
        Xs, ys = split_batch(X[start:end], y[start:end], self.devices, even_split=False)
        return Xs, ys, n

    def train_step(self, X: torch.Tensor | Sequence[torch.Tensor],
                   y: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """Forward, backward and update on every device at once; return the batch's mean loss.

        ``X`` and ``y`` are a whole batch (split here) or lists with one part per device. Device i's
        loss is weighted by its share of the batch, so the summed gradients are the gradient of the
        mean loss over the whole batch whatever the split. Across processes ``X`` and ``y`` are the
        global batch, and the loss returned is this process's part of the mean
        (:meth:`sum_across_processes` of it is the batch's mean loss).
        """
        self._check_open()
        Xs, ys, total = self._split(X, y)
        overlapped = self._buckets is not None
        # one device and no store: update inside the same operation, saving a second push per step;
        # a finiteness check must see every replica's loss first, so it updates after them
        update_here = self.k == 1 and self._kv is None and not self.check_finite and self.processes is None
        # one device per process: the last bucket's sum across processes updates the weights too
        update_across = self.k == 1 and self.processes is not None and self._kv is None and not self.check_finite
        # several devices in this process alone: the updates are pushed from backward, right after the
        # last bucket's reduction, and run on the device workers as soon as the sums are there
        update_pushed = overlapped and self.processes is None and self._kv is None and not self.check_finite \
            and bool(self._buckets.buckets)  # (no bucket: nothing in backward would push them)
        losses = self._run_replicas(Xs, ys, total, update_here, update_across, update_pushed)
        if update_across:
            try:
                self._buckets.wait()
            except BaseException:
                self._renew_failed_vars()
                raise
        elif not update_here and not update_pushed:
            self._aggregate_and_update(scale=1.0, reduced=overlapped)
        self._after_update()
        if len(losses) == 1:
            return losses[0]
        first = self.devices[0].torch_device
        return torch.stack([loss.to(first) for loss in losses]).sum()

    def _run_replicas(self, Xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], total: int, update_here: bool,
                      update_across: bool, update_pushed: bool) -> list[torch.Tensor]:
        """Push every replica's forward and backward (and, with ``update_pushed``, its update); wait; the losses."""
        buckets = self._buckets
        overlapped = buckets is not None
        if overlapped:
            if buckets.across is not None:
                buckets.across.then = self.optimizers[0].step if update_across else None
            if update_pushed:
                self._update_ops = []
                self._updates_pushed.clear()
                buckets.then_all = self._push_updates
            buckets.arm()
        ops = [self.engine.push(self._replica_step, args=(i, Xs[i], ys[i], Xs[i].shape[0] / total, overlapped,
                                                          update_here),
                                writes=(self._replica_vars[i], self._step_vars[i]), device=d, name=f"fwd+bwd {d}")
               for i, d in enumerate(self.devices)]
        try:
            losses = self._wait_replicas(ops, update_pushed)
            if self.check_finite:
                self._raise_if_nonfinite("loss", losses)
            return losses
        except BaseException:
            if overlapped:  # no reduction still running may write into buffers the next step zeroes
                buckets.drain()
            self._drain_updates()
            self._renew_failed_vars()
            raise
        finally:
            self._update_ops = []
            if overlapped:
                buckets.disarm()
                buckets.then_all = None
                if buckets.across is not None:
                    buckets.across.then = None

    def _wait_replicas(self, ops: Sequence[Op], update_pushed: bool) -> list[torch.Tensor]:
        """Wait for the replicas' operations (and the updates pushed from them); their losses."""
        if update_pushed and self._await_update_push(ops):
            # Every replica's operation has ended its work, so waiting on them cannot run one in this thread.
            # The updates come first: a queued one is run here, which saves waking its worker. (They read
            # every replica's step variable: done, they imply the replicas' operations are.)
            try:
                _wait_each(self._update_ops)
            except Exception as exc:
                _wait_each(ops)  # a replica's own error comes first
                raise exc from None
            return _wait_each(ops)
        return self._wait_ops(ops)

    def _push_updates(self) -> None:
        """Push the optimizer steps behind the reductions (runs inside a replica's backward).

        On logical CPU devices one operation steps every replica's optimizer in turn: an update is mostly
        Python, so two run side by side hand the GIL back and forth at every tensor call (LeNet: two
        updates side by side took 0.5-1.3 ms each on a busy machine, one after the other 0.25 ms each).
        GPU updates stay one operation per device, each on its own worker and stream.
        """
        reads = (*self._buckets.done_vars(), *self._step_vars)
        push, name = self.engine.push, _optimizer_name(self.optimizers[0])
        if any(d.is_gpu for d in self.devices):
            self._update_ops = [push(opt.step, reads=reads, writes=(self._replica_vars[i],), device=d,
                                     name=f"{_optimizer_name(opt)} {d}")
                                for i, (d, opt) in enumerate(zip(self.devices, self.optimizers))]
        else:
            # on the worker of the replica that ended last (this thread): it runs right after, unwoken
            place = self.engine.running_on()
            device = place[0] if place is not None and place[0] in self.devices else self.devices[0]
            self._update_ops = [push(self._step_every_optimizer, reads=reads, writes=tuple(self._replica_vars),
                                     device=device, name=f"{name} {','.join(map(str, self.devices))}")]

    def _step_every_optimizer(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def _await_update_push(self, ops: Sequence[Op]) -> bool:
        """Wait until the last replica ended backward with the updates pushed (True), or every replica's
        operation ended without that (False).

        The updates are pushed from inside a replica's operation, so this thread cannot wait on them before;
        the last replica says so as it ends (one wake-up of this thread per step, after the replicas' work).
        One that failed says nothing, so the operations' states are looked at now and then.
        """
        while not self._updates_pushed.wait(0.02):
            if all(op.state == DONE for op in ops):
                return self._updates_pushed.is_set()
        return True

    def _drain_updates(self) -> None:
        # after a failed step: wait for updates already pushed, so none writes after the caller saw the error
        for op in self._update_ops:
            try:
                op.wait()
            except BaseException:
                pass
        self._update_ops = []

    def _renew_failed_vars(self) -> None:
        # A variable written by a failed operation carries its error to every later operation on it;
        # the error has been raised to the caller now, so the next step starts on a clean variable.
        for i, v in enumerate(self._replica_vars):
            if v.exc is not None:
                self._replica_vars[i] = self.engine.new_var(f"replica {self.devices[i]}")
        for i, v in enumerate(self._step_vars):
            if v.exc is not None:
                self._step_vars[i] = self.engine.new_var(f"step {self.devices[i]}")

    def _wait_ops(self, ops: Sequence[Op]) -> list[Any]:
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
        lane, kind = (self._process_lane(), "compute") if self.processes is not None else \
            (self.lanes.lanes[0], self.lanes.kind)
        if len(ops) == 1 and self.processes is not None:
            join = ops[0]
        else:
            join = self.engine.push(_no_result, reads=tuple(self._replica_vars), device=lane, kind=kind, name="join")
        try:
            join.wait()
        except Exception:  # an operation failed: each one's error is reported through its own handle below
            pass
        return _wait_each(ops)

    def _replica_step(self, i: int, X: torch.Tensor, y: torch.Tensor, share: float, overlapped: bool,
                      update_here: bool) -> torch.Tensor:
        """Device ``i``'s forward and backward, an engine operation on its worker."""
        rep = self.replicas[i]
        if not rep.training:  # walking every submodule each step costs tens of microseconds
            rep.train()
        if self._buckets is not None:
            self._buckets.bind(i)
            self._buckets.zero_(i)
        else:
            rep.zero_grad(set_to_none=True)
        loss = self.loss(rep(self._layout(X)), y) * share
        loss.backward()
        if overlapped and self._buckets.replica_done() and self._update_ops:
            self._updates_pushed.set()  # the last replica: every update is pushed (see _await_update_push)
        if update_here:
            self.optimizers[i].step()
        return loss.detach()

    def _layout(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last and x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x

    def step(self, batch_size: int) -> None:
        """Aggregate gradients the caller computed on the replicas, divide by ``batch_size``, update.

        The caller's losses are sums over examples (as in Gluon's ``Trainer.step``); across processes
        ``batch_size`` counts the examples of every process.
        """
        self._check_open()
        if batch_size < 1:
            raise UsageError(f"batch_size must be >= 1, got {batch_size}")
        self._aggregate_and_update(scale=1.0 / batch_size)
        self._after_update()

    def _aggregate_and_update(self, scale: float, reduced: bool = False) -> None:
        """Sum the replicas' gradients (unless ``reduced`` already), scale them, step every optimizer."""
        if self.update_on_kvstore:
            if self.check_finite:
                self._raise_if_nonfinite("gradient", self._grads(all_replicas=True))
            self._update_on_store(scale)
            return
        if self._buckets is not None and not reduced:
            self._buckets.allreduce_all()
        if self._buckets is not None and (scale != 1.0 or self.check_finite):
            self._buckets.wait()
            if scale != 1.0:
                self._buckets.scale_(scale)
        elif self._buckets is None and scale != 1.0:
            for p in self.replicas[0].parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        if self.check_finite:
            self._raise_if_nonfinite("gradient", self._grads(all_replicas=self._buckets is None))
        reads = tuple(self._buckets.done_vars()) if self._buckets is not None else ()
        ops = [self.engine.push(opt.step, reads=reads, writes=(self._replica_vars[i],), device=d,
                                name=f"{_optimizer_name(opt)} {d}")
               for i, (d, opt) in enumerate(zip(self.devices, self.optimizers))]
        try:
            self._wait_ops(ops)
        except BaseException:
            self._renew_failed_vars()
            raise

    def _grads(self, all_replicas: bool) -> list[torch.Tensor]:
        if self._buckets is not None and not all_replicas:
            return [row[0] for row in self._buckets.flats]  # reduced: every replica holds the same sums
        return [p.grad for r in self.replicas for p in r.parameters() if p.grad is not None]

    def _raise_if_nonfinite(self, what: str, tensors: Sequence[torch.Tensor]) -> None:
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

    @torch.no_grad()
    def _update_on_store(self, scale: float) -> None:
        params = [list(r.parameters()) for r in self.replicas]
        if self.processes is not None:  # a distributed store: one request per server for every key
            grads = [[ps[i].grad if ps[i].grad is not None else torch.zeros_like(ps[i]) for ps in params]
                     for i in range(len(params[0]))]
            if scale != 1.0:
                grads = [[g * scale for g in row] for row in grads]
            keys = list(range(len(grads)))
            self._kv.pushpull(keys, grads, out=[[ps[i] for ps in params] for i in keys])
            for r in self.replicas:
                r.zero_grad(set_to_none=True)
            return
        for i in range(len(params[0])):
            grads = [ps[i].grad if ps[i].grad is not None else torch.zeros_like(ps[i]) for ps in params]
            if scale != 1.0:
                grads = [g * scale for g in grads]
            # Keys are pushed in layer order. The priority (first layers first: the next forward needs them
            # first) is for a store that queues traffic; the single-process stores run each call at once
            # and ignore it.
            self._kv.push(i, grads, priority=-i)
            self._kv.pull(i, out=[ps[i] for ps in params], priority=-i)
        for r in self.replicas:
            r.zero_grad(set_to_none=True)

    def _after_update(self) -> None:
        self.steps += 1
        if self.buffers == "broadcast" and self.k > 1:
            broadcast_buffers(self.replicas)

    def zero_grad(self) -> None:
        """Clear gradients on every replica (before a caller-driven backward and :meth:`step`)."""
        if self._buckets is not None:
            for i in range(self.k):
                self._buckets.bind(i)
                self._buckets.zero_(i)
        else:
            for r in self.replicas:
                r.zero_grad(set_to_none=True)

    # -- evaluation and state -----------------------------------------------------------------------
    def evaluate_accuracy(self, data: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Accuracy over ``data``: each batch split across the devices and run on all at once.

        Across processes every process passes the same ``data``; each evaluates every ``world``-th batch
        and the counts are summed, so all get the accuracy over all of ``data``.
        """
        self._check_open()
        if self.processes is None:
            return evaluate_accuracy(self.replicas, data, self.devices, self.engine, prepare=self._layout)
        seen = [0]

        def mine() -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
            for i, (X, y) in enumerate(data):
                if i % self.world == self.rank:
                    seen[0] += int(X.shape[0])
                    yield X, y

        acc = evaluate_accuracy(self.replicas, mine(), self.devices, self.engine, prepare=self._layout)
        counts = self.sum_across_processes(torch.tensor([round(acc * seen[0]), seen[0]], dtype=torch.float64))
        return float(counts[0] / counts[1]) if counts[1] > 0 else 0.0

    def sum_across_processes(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the trainer's processes (``t`` itself when it trains alone).

        Every process must call it at the same point, e.g. after an epoch's steps.
        """
        self._check_open()
        if self.processes is None:
            return t
        flat = t.detach().to("cpu", copy=True).contiguous()
        group = self.processes.group
        op = self.engine.push(allreduce_across_processes, args=(flat, group), writes=(self._across_var,),
                              device=self._process_lane(), name="sum across processes")
        op.wait()
        return flat.to(t.device)

    def max_replica_difference(self) -> float:
        """Largest parameter difference between replicas (0.0 when they are identical)."""
        return max_replica_difference(self.replicas)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically: weights, per-device buffers, optimizer."""
        state: dict[str, Any] = {
            "model": {k: v.detach().cpu().clone() for k, v in self.replicas[0].state_dict().items()},
            "buffers": [{k: v.detach().cpu().clone() for k, v in r.named_buffers()} for r in self.replicas],
            "steps": self.steps,
        }
        if self.update_on_kvstore:
            state["kvstore"] = copy.deepcopy(self._kv.state_dict())
        else:
            # deep copy: an optimizer's state_dict holds its live buffers (momentum), which later steps change
            state["optimizer"] = copy.deepcopy(self.optimizers[0].state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into every replica and optimizer."""
        if len(state["buffers"]) != self.k:
            raise UsageError(f"the checkpoint holds {len(state['buffers'])} replicas but this trainer has "
                             f"{self.k} devices; resume on the same number of devices")
        for r, bufs in zip(self.replicas, state["buffers"]):
            r.load_state_dict(state["model"])
            with torch.no_grad():
                for name, b in r.named_buffers():
                    b.copy_(bufs[name])
        if self.update_on_kvstore:
            self._kv.load_state_dict(state["kvstore"])
        else:
            for opt in self.optimizers:
                # one copy per replica: load_state_dict keeps tensors that are already on the right
                # device, and two optimizers sharing a momentum buffer would update it twice per step
                opt.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.steps = int(state["steps"])

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
        try:
            if self._buckets is not None:
                self._buckets.close()
            if self._kv is not None:
                if self._own_kv:
                    self._kv.close()
                else:
                    self._kv.bind_engine(None)
        finally:
            try:
                self.engine.close()  # waits for every pushed operation, then stops the workers
            except BaseException:
                if not abort:  # after an interrupt, errors of the abandoned step are not news
                    raise
            finally:
                if self._trace_path is not None:
                    self.stop_trace(self._trace_path)
                if self.processes is not None:
                    self.processes.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(abort=exc_type is not None)

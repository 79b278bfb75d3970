"""Your own training loop at dlperf's speed: wrap the model and optimizer, keep the loop as you wrote it.

:class:`Loop` has Lightning Fabric's and Accelerate's shape: ``loop.setup(model, optimizer)`` gives back objects
that behave like yours, ``loop.backward(loss)`` replaces ``loss.backward()``, and a plan (pinned, or
``plan="auto"``, :mod:`~dlperf.parallel.training.own_loop_tuning`) chooses threads, layout and execution; across
processes (:mod:`~dlperf.parallel.training.own_loop_processes`) it trains as one data-parallel job. The guide:
docs/own-loop.md.

>>> import torch
>>> from torch import nn
>>> _ = torch.manual_seed(0)
>>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
>>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
>>> with Loop(plan="1x1") as loop:
...     model, optimizer = loop.setup(model, optimizer)
...     for _ in range(3):
...         x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
...         optimizer.zero_grad()
...         loss = nn.functional.cross_entropy(model(x), y)
...         loop.backward(loss)
...         optimizer.step()
...     loop.plan.name, float(loop.all_mean(loss)) == float(loss.detach())
('1x1,contiguous,eager,caller', True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ...batch import map_tensors
from ...devices import Device, device_of
from ...errors import UsageError
from ..communication.process_group import join_processes
from ..planning.plan import EXECUTIONS, Plan, parse_plan
from ..planning.planner import usable_cores
from .own_loop_processes import ProcessSums, RankRows, mean_over
from .own_loop_tuning import LoopTuning, OnlineTuner, loop_candidates

__all__ = ["Loop", "LoopModule", "LoopTuning"]

log = logging.getLogger(__name__)


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 and t.is_floating_point() else t


class _Route:
    """How the wrapped model's forward runs under the plan in force (the loop sets it; the module reads it)."""

    __slots__ = ("plain", "channels_last", "run", "captured", "autocast", "signature")

    def __init__(self, module: nn.Module) -> None:
        self.plain = True
        """No plan touches the forward: the module is called as it is."""
        self.channels_last = False
        self.run: Any = module
        """What a forward calls: the module, or its compiled form."""
        self.captured: Any = None
        """The module hybridized (training calls replay its captured graph), else None."""
        self.autocast: str | None = None
        self.signature: inspect.Signature | None = None


class LoopModule(nn.Module):
    """Your model as :meth:`Loop.setup` gives it back: calls run under the loop's plan; everything else is yours.

    ``parameters()``, ``named_parameters()``, ``state_dict()`` and ``load_state_dict()`` are the model's own (no
    ``module.`` prefix: a checkpoint loads into the bare model), ``train()``/``eval()``/``to()`` reach it, and
    attributes it has (``model.config``, a layer) are read through. The bare model is ``.module``.
    """

    def __init__(self, module: nn.Module, route: _Route) -> None:
        super().__init__()
        self.module = module
        self.__dict__["_inner"] = module  # a plain attribute too: the registered child costs a lookup per call
        self.__dict__["_route"] = route

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        route: _Route = self.__dict__["_route"]
        if route.plain:
            return self.__dict__["_inner"](*args, **kwargs)
        if route.channels_last:
            args, kwargs = map_tensors(_channels_last, (args, kwargs))
        if route.captured is not None and torch.is_grad_enabled() and self.__dict__["_inner"].training:
            positional = _positional(route, args, kwargs)
            if positional is not None:
                return route.captured(*positional)
        if route.autocast is not None:
            with torch.autocast(route.autocast, dtype=torch.bfloat16):
                return route.run(*args, **kwargs)
        return route.run(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_inner")
            if inner is None:
                raise
            return getattr(inner, name)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix, recurse, remove_duplicate)


def _positional(route: _Route, args: tuple, kwargs: dict) -> tuple | None:
    """The call's inputs as positional tensors for the captured forward (a HuggingFace-style ``model(**batch)``
    names its parameters), or None when they cannot be (the call then runs as written)."""
    if kwargs:
        if route.signature is None:
            return None
        try:
            bound = route.signature.bind(*args, **kwargs)
        except TypeError:
            return None
        if bound.kwargs:
            return None
        args = bound.args
    return args if args and all(isinstance(a, torch.Tensor) for a in args) else None


def _signature(module: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None


def _layout_of(module: nn.Module) -> str:
    """``channels_last`` when the model's 4-D weights are already in that layout (the user converted it)."""
    weights = [p for p in module.parameters() if p.dim() == 4]
    if weights and all(p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
                       for p in weights):
        return "channels_last"
    return "contiguous"


def _set_layout(module: nn.Module, layout: str) -> None:
    """Convert ``module``'s 4-D parameters and buffers to ``layout``, keeping each gradient tensor as it is (a
    gradient may be a view of a bucket that must stay one)."""
    grads = {p: p.grad for p in module.parameters() if p.grad is not None}
    for p in grads:
        p.grad = None
    module.to(memory_format=torch.channels_last if layout == "channels_last" else torch.contiguous_format)  # type: ignore[call-overload]  # torch's stubs lack it
    for p, g in grads.items():
        p.grad = g


class Loop:
    """Run your own training loop under a plan: threads, layout, capture, and processes when launched as several.

    Args:
        plan: None (your loop as written; across processes when launched as several), ``"auto"`` (chosen by
            timing your loop's first steps under each candidate, then kept; one ``logging`` line says what),
            a plan name such as ``"1x2,channels-last"``, or a :class:`~dlperf.parallel.planning.plan.Plan`.
        tuning: how ``plan="auto"`` measures (:class:`LoopTuning`).
        bucket_bytes: across processes, the gradient bucket size (None: the buckets' default).

    Call :meth:`close` (or use ``with``) when done: it gives the thread count back and, across processes,
    ends the process group it started.
    """

    def __init__(self, plan: str | Plan | None = None, *, tuning: LoopTuning | None = None,
                 bucket_bytes: int | None = None) -> None:
        self._mode, self._pinned = _plan_mode(plan)
        if tuning is not None and self._mode != "auto":
            raise UsageError("tuning= is how plan='auto' measures; give plan='auto' with it, or drop tuning=")
        self._tuning_options = tuning or LoopTuning()
        self._bucket_bytes = bucket_bytes if bucket_bytes is not None else (
            self._pinned.bucket_bytes if self._pinned is not None else None)
        self._threads_before = torch.get_num_threads()
        self._closed = False
        self._module: LoopModule | None = None
        self._route: _Route | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        self._tuning_hook: Any = None
        self._sync = True
        self._synced = False
        self._layout = "contiguous"
        self._devices: list[Device] = []
        self.plan: Plan | None = None
        """The plan in force (None without one; while ``plan="auto"`` tunes, the candidate running)."""
        self.reference: Plan | None = None
        """Your loop as written, as a plan (what ``plan="auto"`` must beat)."""
        self.tuner: OnlineTuner | None = None
        """``plan="auto"``'s schedule and measurements (``loop.tuner.table()``), once set up."""
        axis = join_processes()
        self._sums = ProcessSums(axis) if axis is not None else None

    # -- who we are ---------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank (0 in one process)."""
        return self._sums.axis.rank if self._sums is not None else 0

    @property
    def world(self) -> int:
        """How many processes run the loop (1 in one process)."""
        return self._sums.axis.world if self._sums is not None else 1

    @property
    def tuning(self) -> bool:
        """Whether ``plan="auto"`` is still timing candidates on the loop's steps."""
        return self.tuner is not None and self.tuner.tuning

    # -- setup --------------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer) -> Any:
        """Wrap ``model`` (a :class:`LoopModule`) and watch ``optimizers`` (given back as they are): ``model`` or
        ``(model, *optimizers)``.

        Across processes every process starts from the first one's weights, as DDP does.
        """
        self._check_open()
        if not isinstance(model, nn.Module):
            raise UsageError(f"setup: model is a {type(model).__name__}; expected a torch.nn.Module")
        if self._module is not None:
            raise UsageError("setup: this Loop already wraps a model; one Loop runs one model (make another Loop)")
        if isinstance(model, LoopModule):
            raise UsageError("setup: the model is already wrapped by a Loop; pass the bare model (model.module)")
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise UsageError(f"setup: {type(opt).__name__} is not a torch.optim.Optimizer; pass the model, "
                                 "then its optimizers")
        self._devices = [device_of(model)]
        self._layout = _layout_of(model)
        self.reference = self._reference_plan()
        if self._sums is not None:
            self._sums.attach(model, self._bucket_bytes)
        self._route = _Route(model)
        self._module = LoopModule(model, self._route)
        self._optimizers = list(optimizers)
        if self._sums is not None:
            self._hooks += [opt.register_step_pre_hook(self._before_update) for opt in optimizers]
        if self._mode == "pinned":
            assert self._pinned is not None
            self._switch(self._in_force(self._pinned))
        elif self._mode == "auto":
            self._start_tuning(model)
        return (self._module, *optimizers) if optimizers else self._module

    def _reference_plan(self) -> Plan:
        world = self.world
        return Plan(replicas=world, threads=torch.get_num_threads(), launcher="processes" if world > 1 else "threads",
                    step_thread="worker" if world > 1 else "caller", memory_format=self._layout)

    def _in_force(self, plan: Plan) -> Plan:
        """``plan`` as this loop runs it (one error line when it cannot)."""
        world, name = self.world, plan.name
        if plan.kvstore is not None:
            raise UsageError(f"plan {name!r}: a loop of your own sums gradients across processes by allreduce; "
                             "drop the kvstore part")
        if plan.launcher == "processes" and plan.replicas != world:
            where = f"this loop runs as {world} processes" if world > 1 else "this loop runs in one process"
            raise UsageError(f"plan {name!r} runs its replicas as {plan.replicas} processes but {where}; run the "
                             f"script under dlperf launch --nproc-per-node {plan.replicas} (or torchrun)")
        if plan.launcher == "threads" and plan.replicas > 1:
            raise UsageError(f"plan {name!r}: a loop of your own runs one replica per process (its backward runs on "
                             f"your thread); use 1x{plan.replicas * plan.threads} in one process, or "
                             f"{plan.replicas}x{plan.threads},processes under dlperf launch --nproc-per-node "
                             f"{plan.replicas}")
        gpu = any(d.is_gpu for d in self._devices)
        if plan.mixed_precision == "fp16":
            raise UsageError(f"plan {name!r}: fp16 needs loss scaling, which the loop does not do; use bf16")
        if plan.mixed_precision == "bf16" and not gpu:
            raise UsageError(f"plan {name!r}: bf16 mixed precision is planned for GPUs; drop bf16 on CPU")
        if world > 1 and plan.execution == "captured":
            raise UsageError(f"plan {name!r}: a loop across processes runs its forward eagerly or compiled; "
                             f"use {name.replace('captured', 'eager')}")
        if world > 1 and plan.launcher != "processes":  # each process runs the plan's one replica
            plan = dataclasses.replace(plan, replicas=world, launcher="processes", step_thread="worker")
        if world == 1 and plan.step_thread != "caller":
            plan = dataclasses.replace(plan, step_thread="caller")  # your thread runs the step, whatever it says
        return plan

    def _start_tuning(self, model: nn.Module) -> None:
        assert self.reference is not None
        options = self._tuning_options
        cores = options.cores or (self._sums.axis.cores() if self._sums is not None else usable_cores())
        candidates, notes = loop_candidates(model, self.reference, self._devices, cores, options)
        sync = torch.cuda.synchronize if any(d.is_gpu for d in self._devices) else (lambda: None)
        self.plan = self.reference
        self.tuner = OnlineTuner(candidates, options, self._switch, self._declined, notes=notes,
                                 share=self._sums.sum_ if self._sums is not None else None, synchronize=sync)
        if self.tuner.tuning:
            if not self._optimizers:
                raise UsageError("plan='auto' times the loop's steps where its optimizer steps: pass the optimizer "
                                 "to setup(model, optimizer)")
            self._tuning_hook = self._optimizers[0].register_step_post_hook(self._after_update)
        else:
            self._decided()

    # -- what a plan changes ------------------------------------------------------------------------------
    def _switch(self, plan: Plan) -> None:
        """Put the loop under ``plan`` (at a step's end, or at setup)."""
        route, module = self._route, self._module
        assert route is not None and module is not None
        inner = module.module
        gpu = any(d.is_gpu for d in self._devices)
        if not gpu and torch.get_num_threads() != plan.threads:
            torch.set_num_threads(plan.threads)
        if plan.memory_format != self._layout:
            _set_layout(inner, plan.memory_format)
            self._layout = plan.memory_format
        route.channels_last = plan.memory_format == "channels_last"
        route.captured = None
        route.run = inner
        if plan.execution == "captured":
            route.captured = self._captured(inner)
            if route.signature is None:
                route.signature = _signature(inner)
        elif plan.execution != "eager":
            route.run = EXECUTIONS.get(plan.execution).prepare(inner)
        route.autocast = self._devices[0].torch_device.type if plan.mixed_precision == "bf16" else None
        if plan.cudnn_benchmark and gpu:
            torch.backends.cudnn.benchmark = True  # process-wide: cuDNN keeps one algorithm cache
        route.plain = not route.channels_last and route.captured is None and route.run is inner and \
            route.autocast is None
        self.plan = plan

    def _captured(self, inner: nn.Module) -> Any:
        found = getattr(self, "_hybrid", None)
        if found is None:
            from ...hybrid import backend_names, get_backend, hybridize

            # not the native backend: its first build on a machine takes a minute or more (then cached), which
            # a plan tried on the loop's own steps would spend inside one of them
            names = [n for n in backend_names() if get_backend(n).in_auto and n != "native"]
            found = self._hybrid = hybridize(inner, candidates=names)
        return found

    def _declined(self, plan: Plan) -> str | None:
        """After a candidate's first steps: why it does not run what it says, or None."""
        if plan.execution != "captured":
            return None
        hybrid = getattr(self, "_hybrid", None)
        if hybrid is None:
            return "nothing was captured"
        if hybrid.state == "eager":
            return f"its forward runs eagerly ({(hybrid.fallback_reason or '')[:100]})"
        choices = hybrid.choices
        if not choices:
            return "no call could be captured (inputs that are not tensors, or keywords it cannot name)"
        if {c.backend for c in choices.values()} == {"eager"}:
            return "its replay was slower than the eager forward, which it serves instead"
        return None

    # -- the step -----------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward(...)``, and across processes the gradients averaged over them as backward runs.

        Returns once they are: the gradients are then the processes' mean (DDP's), ready for clipping and
        ``optimizer.step()``. Inside :meth:`no_backward_sync` they only accumulate here.
        """
        self._check_open()
        sums = self._sums
        if sums is None:
            loss.backward(*args, **kwargs)
            return
        if self._module is None:
            raise UsageError("backward: call loop.setup(model, optimizer) first; across processes the loop sums "
                             "the gradients of the model it wraps")
        weight = sums.weight()
        if weight != 1.0:  # this rank's rows are not 1/world of the batch: weigh its gradient by its share
            gradient = kwargs.pop("gradient", args[0] if args else None)
            args = args[1:]
            kwargs["gradient"] = (gradient if gradient is not None else torch.ones_like(loss)) * weight
        if not self._sync:
            sums.bind()
            loss.backward(*args, **kwargs)
            return
        sums.backward(lambda: loss.backward(*args, **kwargs))
        self._synced = True

    @contextlib.contextmanager
    def no_backward_sync(self, enabled: bool = True) -> Iterator[None]:
        """Backward inside this block accumulates gradients without averaging them across processes (DDP's
        ``no_sync``): for gradient accumulation, the micro-batches but the last backward here, the last outside.

        In one process (or with ``enabled=False``) it changes nothing.
        """
        if not enabled or self._sums is None:
            yield
            return
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _before_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._synced:
            raise UsageError("optimizer.step() after no backward that was averaged across the processes: call "
                             "loop.backward(loss) instead of loss.backward(), and the last micro-batch's backward "
                             "outside loop.no_backward_sync()")
        self._synced = False

    def _after_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        tuner = self.tuner
        assert tuner is not None
        tuner.step_ended()
        if not tuner.tuning:
            self._decided()

    def _decided(self) -> None:
        tuner = self.tuner
        assert tuner is not None and tuner.plan is not None
        if self._tuning_hook is not None:
            self._tuning_hook.remove()
            self._tuning_hook = None
        if self.rank == 0:
            log.info("loop %s; tuned on its first %d steps in %.1f s%s", tuner.plan.line(), tuner.steps_seen,
                     tuner.seconds, "; every round contended: decided for this run only" if tuner.contended else "")

    # -- data and figures ---------------------------------------------------------------------------------
    def setup_data(self, data: Iterable[Any]) -> Iterable[Any]:
        """``data`` (a DataLoader or any iterable of batches) for this process: across processes each batch cut
        to this rank's rows, so the loader's batch is the global batch; in one process ``data`` itself."""
        self._check_open()
        if self._sums is None:
            return data
        return RankRows(data, self._sums)

    def all_mean(self, value: Any) -> Any:
        """``value`` (a loss, a metric: a tensor, a number or a mapping of numbers) averaged over the processes,
        the same on every rank; in one process, the value itself (a tensor detached, numbers as floats).

        Every process must call it at the same point of the loop.
        """
        self._check_open()
        return mean_over(self._sums, value)

    # -- lifetime -----------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("this Loop is closed")

    def close(self) -> None:
        """Stop watching the optimizers, give the thread count back and, across processes, stop the sums and the
        process group the loop started; the model and optimizers stay usable as plain PyTorch objects."""
        if self._closed:
            return
        self._closed = True
        for hook in [*self._hooks, *([self._tuning_hook] if self._tuning_hook is not None else [])]:
            hook.remove()
        self._hooks, self._tuning_hook = [], None
        if torch.get_num_threads() != self._threads_before:
            torch.set_num_threads(self._threads_before)
        if self._sums is not None:
            self._sums.close()

    def __enter__(self) -> Loop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plan_mode(plan: object) -> tuple[str | None, Plan | None]:
    if plan is None:
        return None, None
    if plan == "auto":
        return "auto", None
    if isinstance(plan, Plan):
        return "pinned", plan
    if isinstance(plan, str):
        return "pinned", parse_plan(plan)
    raise UsageError(f"plan={plan!r}: expected None, 'auto', a Plan or a plan name such as '1x2,channels-last'")

"""A training plan: every choice that changes how fast a step runs but not what it computes.

A :class:`Plan` names how one step is laid out on this machine: how many replicas share the batch and
how many intra-op threads each gets, whether replicas are threads of one process or processes, the
activations' memory layout, how the step executes (eager, ``torch.compile``, or for one replica the
whole training step captured and replayed by :func:`dlperf.hybrid.train_step`), how gradients are
synchronised (allreduce algorithm and bucket size, or a KVStore), and on GPUs the precision, cuDNN's
benchmark mode and pinned host memory. Only
mixed precision changes the numerics beyond float rounding, so a plan uses it only when the user allows.

A plan is written as a short name, ``1x2,channels-last,eager``; :func:`parse_plan` reads one back:

>>> p = parse_plan("1x2,channels-last")
>>> p.name, p.replicas, p.threads, p.memory_format
('1x2,channels-last,eager', 1, 2, 'channels_last')
>>> parse_plan("2x1").summary()
'2 replicas x 1 thread, contiguous, eager'
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...devices import Device, cpu
from ...errors import UsageError, unknown_choice
from ...registry import Registry
from ..allreduce import DEFAULT_ALGORITHM, algorithm_names

__all__ = ["Plan", "Execution", "EXECUTIONS", "register_execution", "parse_plan", "LAYOUTS", "PRECISIONS",
           "LAUNCHERS", "STEP_THREADS", "has_batch_statistics", "uses_conv2d", "layer_count"]

LAYOUTS = ("contiguous", "channels_last")
PRECISIONS = ("off", "bf16", "fp16")
LAUNCHERS = ("threads", "processes")
STEP_THREADS = ("worker", "caller")
MAX_REPLICAS = 1024
MAX_THREADS = 1024
MAX_LOADER_WORKERS = 256


@dataclass(frozen=True)
class Execution:
    """One way to run a replica's forward (and with it its backward); entries of :data:`EXECUTIONS`.

    ``prepare(module)`` returns the callable a step calls instead of the module (sharing its parameters,
    so the optimizer and checkpoints see the same weights); ``unavailable(module, devices)`` says why
    it cannot run here, or None; ``setup_s`` and ``setup_per_layer_s`` make the first guess of its one-off
    cost (compilation) for a module (:meth:`setup_guess_s`), used to decide whether measuring it fits the
    planner's time budget until a first setup has been measured for that model (the planner records it).

    An execution with ``make_step`` replaces the whole step of a single replica instead: ``make_step(module,
    loss, optimizer)`` returns ``step(x, y) -> loss`` that runs forward, loss, backward and the update of
    that optimizer, keeping weights and optimizer state in those same objects. A forward alone cannot say
    that, and the replicas of a split exchange gradients between backward and update, so such an execution
    only serves plans of one replica.
    """

    name: str
    prepare: Callable[[nn.Module], Callable[..., Any]]
    unavailable: Callable[[nn.Module, Sequence[Device]], str | None] = lambda module, devices: None
    setup_s: float = 0.0
    """The least one-off setup guessed for any module (0: none)."""
    setup_per_layer_s: float = 0.0
    """The one-off setup guessed per layer of the module (:func:`layer_count`), when that is more."""
    description: str = ""
    make_step: Callable[[nn.Module, Callable[..., Any], torch.optim.Optimizer], Callable[..., Any]] | None = None
    declined: Callable[[Any], str | None] = lambda step: None
    """Given ``make_step``'s step after its first call: why it serves the plain eager step instead, or None."""

    @property
    def has_setup(self) -> bool:
        """Whether it costs a one-off setup (which only a run of known length can be weighed against)."""
        return self.setup_s > 0 or self.setup_per_layer_s > 0

    def setup_guess_s(self, module: nn.Module) -> float:
        """The one-off setup guessed for ``module`` before any has been measured."""
        return max(self.setup_s, self.setup_per_layer_s * layer_count(module))

    @property
    def whole_step(self) -> bool:
        """Whether it runs the whole step (forward to update) of a one-replica plan."""
        return self.make_step is not None


EXECUTIONS: Registry[Execution] = Registry("execution")
"""How a planned step may run: ``eager``, ``compile`` and ``captured`` are built in; others join by
:func:`register_execution`."""


def register_execution(execution: Execution, *, replace: bool = False) -> Execution:
    """Make ``execution`` available to plans (and to the planner, which measures every available one)."""
    EXECUTIONS.register(execution.name, execution, replace=replace)
    return execution


def _compile_unavailable(module: nn.Module, devices: Sequence[Device]) -> str | None:
    try:
        import torch._dynamo  # noqa: F401  (present in every CPU build, but may be stripped)
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        return f"torch.compile is not available ({exc})"
    return None


register_execution(Execution("eager", lambda module: module, description="the module as written"))
def layer_count(module: nn.Module) -> int:
    """The layers of ``module``: its modules without children (what a compiler traces one by one)."""
    return sum(1 for m in module.modules() if next(m.children(), None) is None)


# The first compile of a training step's forward (inductor, backward included), guessed per layer. Calibrated
# on the three first compiles measured on the development VM's 2 shared vCPUs (2026-11-26, loaded, under nice):
# LeNet b256 (10 layers) 156 s, the Transformer encoder b64 (18) 77 s, the LSTM b128 (3) 5 s, i.e. 15.6, 4.3
# and 1.7 s a layer; 5 s a layer is their geometric mean, which puts each within about 3x of its guess (LeNet
# 50 s, Transformer 90 s, LSTM 15 s). Operator and parameter counts fit them worse (the LSTM has the most of
# both and compiled fastest). A rough first guess: the planner uses a measured setup once it has one.
register_execution(Execution("compile", lambda module: torch.compile(module), _compile_unavailable, setup_s=5.0,
                             setup_per_layer_s=5.0,
                             description="torch.compile of each replica's forward (inductor); chosen only when "
                                         "its compile time fits the run"))


def has_batch_statistics(module: nn.Module) -> bool:
    """Whether a layer's output depends on the other examples of its batch (BatchNorm in training):
    splitting the batch over another number of replicas would change what such a model computes."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def uses_conv2d(module: nn.Module) -> bool:
    """Whether the activations' layout matters: 2-D convolutions (channels-last helps oneDNN)."""
    return any(isinstance(m, nn.Conv2d) for m in module.modules())


def _captured_step(module: nn.Module, loss: Callable[..., Any], optimizer: torch.optim.Optimizer
                   ) -> Callable[..., Any]:
    from ...hybrid.train_step import make_train_step

    # captured on its first call, where the batch's shapes are known; a model or optimizer it cannot
    # capture runs the eager step instead, with the reason in the step's repr and one warning
    return make_train_step(module, loss, optimizer)


def _captured_declined(step: Any) -> str | None:
    if step.fallback_reason:
        return f"its step runs eagerly ({step.fallback_reason[:100]})"
    if step.choices and set(step.choices.values()) == {"eager"}:
        return "its replay was slower than the eager step, which it serves instead"
    return None


def _captured_unavailable(module: nn.Module, devices: Sequence[Device]) -> str | None:
    if uses_conv2d(module) and not any(d.is_gpu for d in devices):
        # measured (BENCHMARKS.md, hybridized training): on CPU the captured step of LeNet and ResNet-56 runs
        # the convolutions' kernels as eager does and its choice among replays costs seconds per model
        return "not tried on 2-D convolutions on CPU (their captured step measured no faster than eager)"
    return None


register_execution(Execution("captured", lambda module: module, _captured_unavailable, make_step=_captured_step,
                             declined=_captured_declined,
                             description="the whole training step (forward, loss, backward, update) captured once "
                                         "and replayed (dlperf.hybrid.train_step); one replica only"))


def _int_in(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UsageError(f"plan {name}={value!r}: expected an integer from {low} to {high}")
    return value


@dataclass(frozen=True)
class Plan:
    """How a :class:`~dlperf.parallel.Trainer` lays a step out on the machine; checked when made.

    The figures it was chosen on (``measured_ms``, ``alternatives``, ``reasons``) ride along and do not
    take part in comparisons: two plans are equal when they make the same choices.
    """

    replicas: int = 1
    """Model replicas sharing each batch (logical CPU devices ``cpu(0..r-1)``, or the GPUs given)."""
    threads: int = 1
    """Intra-op threads each CPU replica's worker gets."""
    launcher: str = "threads"
    """``threads``: replicas are engine workers of one process; ``processes``: one process each (realised
    only by ``dlperf launch`` / ``dlperf train --nproc-per-node``)."""
    step_thread: str = "worker"
    """``worker``: each replica's step runs on its device's engine worker; ``caller``: one replica's step runs
    on the calling thread with the plan's threads (no hand-off to a worker and back: ~0.1-0.5 ms a step)."""
    memory_format: str = "contiguous"
    """4-D activations' layout: ``contiguous`` (NCHW) or ``channels_last`` (NHWC)."""
    execution: str = "eager"
    """An entry of :data:`EXECUTIONS`."""
    algorithm: str = DEFAULT_ALGORITHM
    """Allreduce algorithm for the gradients (``auto``: the cost model's pick for the links)."""
    bucket_bytes: int | None = None
    """Gradient bucket size (None: the Trainer's default)."""
    kvstore: str | None = None
    """Aggregate through a KVStore of this type instead of allreduce."""
    strategy: str | None = None
    """The gradient synchronization strategy by name (None: inferred from the replicas, processes and store)."""
    mixed_precision: str = "off"
    """``off``, ``bf16`` (autocast), or ``fp16`` (needs loss scaling); changes the numerics."""
    cudnn_benchmark: bool = False
    """Let cuDNN time its convolution algorithms on the first step (GPUs)."""
    pin_memory: bool = False
    """Pin each host batch so copies to a GPU run without blocking the host (GPUs)."""
    loader_workers: int = 0
    """Worker processes a data loader may use to prepare batches (0: in the training process)."""
    measured_ms: float | None = field(default=None, compare=False)
    """Median ms per step this plan took when it was chosen."""
    alternatives: tuple[tuple[str, float], ...] = field(default=(), compare=False)
    """(short name, ms per step) of the other plans measured beside it."""
    reasons: tuple[str, ...] = field(default=(), compare=False)
    """One line per choice made without measuring (the cost model's, the rules')."""

    def __post_init__(self) -> None:
        _int_in("replicas", self.replicas, 1, MAX_REPLICAS)
        _int_in("threads", self.threads, 1, MAX_THREADS)
        _int_in("loader_workers", self.loader_workers, 0, MAX_LOADER_WORKERS)
        if self.launcher not in LAUNCHERS:
            raise unknown_choice("plan launcher", self.launcher, LAUNCHERS)
        if self.step_thread not in STEP_THREADS:
            raise unknown_choice("plan step thread", self.step_thread, STEP_THREADS)
        if self.step_thread == "caller" and (self.replicas != 1 or self.launcher != "threads"):
            raise UsageError(f"plan {self.replicas}x{self.threads},caller: the calling thread runs one replica; "
                             "give 1xT,caller or drop caller")
        if self.memory_format not in LAYOUTS:
            raise unknown_choice("plan memory format", self.memory_format, LAYOUTS)
        if self.mixed_precision not in PRECISIONS:
            raise unknown_choice("plan mixed precision", self.mixed_precision, PRECISIONS)
        if EXECUTIONS.get(self.execution).whole_step and (self.replicas != 1 or self.launcher != "threads"):
            raise UsageError(f"plan {self.replicas}x{self.threads},{self.execution}: a {self.execution} step runs "
                             f"one replica in this process; give 1xT,{self.execution} or another execution")
        if self.algorithm not in algorithm_names():
            raise unknown_choice("plan allreduce algorithm", self.algorithm, algorithm_names())
        if self.bucket_bytes is not None:
            _int_in("bucket_bytes", self.bucket_bytes, 1, 2**40)
        if self.kvstore is not None and not isinstance(self.kvstore, str):
            raise UsageError(f"plan kvstore={self.kvstore!r}: expected a store type name or None")
        self._check_strategy()
        for name in ("cudnn_benchmark", "pin_memory"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"plan {name}={getattr(self, name)!r}: expected True or False")

    def _check_strategy(self) -> None:
        if self.strategy is None:
            return
        from ..strategies import STRATEGIES

        if not isinstance(self.strategy, str):
            raise UsageError(f"plan strategy={self.strategy!r}: expected a strategy name or None")
        STRATEGIES.get(self.strategy)  # a miss lists what exists

    # -- names --------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The short name :func:`parse_plan` reads back (defaults beyond layout and execution left out)."""
        parts = [f"{self.replicas}x{self.threads}", self.memory_format.replace("_", "-"), self.execution]
        if self.launcher == "processes":
            parts.append("processes")
        if self.step_thread == "caller":
            parts.append("caller")
        if self.kvstore:
            parts.append(f"kvstore-{self.kvstore}")
        if self.strategy:
            parts.append(f"strategy-{self.strategy}")
        if self.algorithm != DEFAULT_ALGORITHM:
            parts.append(f"allreduce-{self.algorithm}")
        if self.mixed_precision != "off":
            parts.append(self.mixed_precision)
        return ",".join(parts)

    def summary(self) -> str:
        """``1 replica x 2 threads, channels-last, eager`` (and the GPU choices that are on)."""
        r, t = self.replicas, self.threads
        text = f"{r} replica{'s' * (r > 1)} x {t} thread{'s' * (t > 1)}"
        if self.launcher == "processes":
            text += " (processes)"
        if self.step_thread == "caller":
            text += " on the calling thread"
        text += f", {self.memory_format.replace('_', '-')}, {self.execution}"
        if self.kvstore:
            text += f", kvstore {self.kvstore}"
        if self.strategy:
            text += f", strategy {self.strategy}"
        extras = [label for on, label in ((self.mixed_precision != "off", self.mixed_precision),
                                          (self.cudnn_benchmark, "cudnn benchmark"), (self.pin_memory, "pinned"))
                  if on]
        return text + (", " + ", ".join(extras) if extras else "")

    def line(self) -> str:
        """The one line ``dlperf train`` prints at start: the plan, its step time and the others'."""
        text = f"plan: {self.summary()}"
        if self.measured_ms is not None:
            text += f": {self.measured_ms:.1f} ms/step"
        if self.alternatives:
            text += " (" + "; ".join(f"{name}: {ms:.1f}" for name, ms in self.alternatives) + ")"
        return text

    def describe(self) -> str:
        """Every choice, with the figures and reasons it was chosen on (several lines)."""
        lines = [self.line()]
        for f in dataclasses.fields(self):
            if f.compare:
                lines.append(f"  {f.name:<16} {getattr(self, f.name)!r}")
        lines += [f"  because: {reason}" for reason in self.reasons]
        return "\n".join(lines)

    # -- where it runs --------------------------------------------------------------------------------
    def devices_for(self, devices: Sequence[Device]) -> list[Device]:
        """The devices a trainer given ``devices`` uses under this plan: the GPUs given, or
        ``cpu(0..replicas-1)`` (logical CPU devices share the cores; the plan says how many)."""
        gpus = [d for d in devices if d.is_gpu]
        if gpus:
            if len(gpus) != self.replicas:
                raise UsageError(f"plan {self.name!r} has {self.replicas} replicas but {len(gpus)} GPUs were given; "
                                 "on GPUs a plan keeps one replica per GPU")
            return gpus
        return [cpu(i) for i in range(self.replicas)]

    def to_dict(self) -> dict[str, Any]:
        """The choices as plain data (for a checkpoint or the plan cache)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare}

    @classmethod
    def from_dict(cls, data: object, where: str = "plan") -> Plan:
        """A plan from :meth:`to_dict`'s data, every field checked (the data may come from a file)."""
        if not isinstance(data, Mapping):
            raise UsageError(f"{where} is a {type(data).__name__}, not a dict of plan fields")
        known = {f.name for f in dataclasses.fields(cls) if f.compare}
        extra = sorted(map(str, set(data) - known))
        if extra:
            raise UsageError(f"{where} has unexpected fields {extra[:5]}; known: {', '.join(sorted(known))}")
        return cls(**dict(data))

    def filled(self, *, algorithm: str | None = None, bucket_bytes: int | None = None,
               kvstore: str | None = None) -> Plan:
        """This plan with the run's own options where the plan leaves them at their defaults (a plan named
        ``1x2`` says nothing about the store, so ``--kvstore local`` still holds)."""
        return dataclasses.replace(
            self, algorithm=algorithm if algorithm and self.algorithm == DEFAULT_ALGORITHM else self.algorithm,
            bucket_bytes=self.bucket_bytes if self.bucket_bytes is not None else bucket_bytes,
            kvstore=self.kvstore if self.kvstore is not None else kvstore)

    def with_figures(self, measured_ms: float | None, alternatives: Sequence[tuple[str, float]],
                     reasons: Sequence[str] = ()) -> Plan:
        return dataclasses.replace(self, measured_ms=measured_ms, alternatives=tuple(alternatives),
                                   reasons=tuple(reasons) or self.reasons)


_SIZE = re.compile(r"(\d{1,4})x(\d{1,4})")


def parse_plan(text: str) -> Plan:
    """A plan from its short name: ``RxT`` (replicas x threads) then any of ``contiguous``/``channels-last``,
    an execution name, ``processes``, ``kvstore-TYPE``, ``strategy-NAME``, ``allreduce-NAME``, ``bf16``/``fp16``."""
    if not isinstance(text, str) or len(text) > 200:
        raise UsageError(f"plan {str(text)[:40]!r}: expected a short name such as 1x2,channels-last")
    tokens = [t.strip().lower() for t in text.split(",") if t.strip()]
    size = _SIZE.fullmatch(tokens[0]) if tokens else None
    if size is None:
        raise UsageError(f"plan {text!r} does not start with REPLICASxTHREADS; give e.g. 1x2 or 2x1,channels-last")
    fields: dict[str, Any] = {"replicas": int(size[1]), "threads": int(size[2])}
    for token in tokens[1:]:
        if token.replace("-", "_") in LAYOUTS:
            fields["memory_format"] = token.replace("-", "_")
        elif token in EXECUTIONS:
            fields["execution"] = token
        elif token in LAUNCHERS:
            fields["launcher"] = token
        elif token in STEP_THREADS:
            fields["step_thread"] = token
        elif token in ("bf16", "fp16"):
            fields["mixed_precision"] = token
        elif token.startswith("kvstore-"):
            fields["kvstore"] = token.removeprefix("kvstore-")
        elif token.startswith("allreduce-"):
            fields["algorithm"] = token.removeprefix("allreduce-")
        elif token.startswith("strategy-"):
            fields["strategy"] = token.removeprefix("strategy-")
        else:
            raise UsageError(f"plan {text!r}: unknown part {token!r}; expected contiguous, channels-last, "
                             f"{', '.join(EXECUTIONS.names())}, processes, caller, kvstore-TYPE, strategy-NAME, "
                             "allreduce-NAME, "
                             "bf16 or fp16")
    return Plan(**fields)

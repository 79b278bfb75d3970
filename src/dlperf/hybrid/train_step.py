"""``train_step(module, loss_fn, optimizer)``: a whole training step captured once, replayed without autograd.

The first call traces forward, loss and backward into one joint graph of ATen operations (``make_fx`` on fake
tensors: nothing runs while tracing); later calls replay it under ``no_grad`` and hand the gradients to a
functional update of the optimizer (SGD, Adam, AdamW) that keeps its state in the optimizer's own ``state``. The
mathematics is eager's, checked on the first step of each signature; what a graph cannot replay runs the eager
step, with the reason in ``repr`` and one warning. How it is built: docs/design/hybridize.md.

>>> import torch
>>> from torch import nn
>>> net = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
>>> opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
>>> step = train_step(net, nn.functional.cross_entropy, opt)
>>> loss = step(torch.randn(16, 8), torch.randint(0, 2, (16,)))
>>> step.state
'replay'
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .. import batch as batches
from ..steps import eager_step
from ..timing import time_steps
from ._warn import warn_at_caller
from .capture import ModuleState, same_change
from .hybridize import CHECK_ATOL, CHECK_RTOL, HybridizeWarning, HybridModule
from .optim_update import OptimizerUpdate, UnsupportedOptimizer, functional_update
from .train_graph import JointGraph, TrainCaptureError, capture_joint

__all__ = ["TrainStep", "make_train_step", "train_step"]

EAGER, CAPTURE, REPLAY = "eager", "capture", "replay"
BACKENDS = ("auto", "graph", "native", "cuda_graphs", "compile", "eager")
# Steps per candidate when ``auto`` times the training path: steps, not calls, are what it is judged on.
AUTO_STEPS, AUTO_BUDGET_S = 20, 0.3


@dataclass
class _Runner:
    """How one input signature is stepped, and why (shown by ``repr``)."""

    backend: str
    step: Callable[..., torch.Tensor]
    reason: str


class TrainStep:
    """A captured training step; call it as ``step(x, y) -> loss``. See the module docstring.

    States: ``capture`` (the next call traces), ``replay`` and ``eager`` (for good, ``fallback_reason`` says
    why). Each input signature (structure, shapes, dtypes, devices, ``module.training``) gets its own graph.
    """

    def __init__(self, module: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer, *,
                 backend: str = "auto", keep_grads: bool = False, max_signatures: int = 8):
        if backend not in BACKENDS:
            from ..errors import UsageError

            raise UsageError(f"train_step backend {backend!r} is not one of {', '.join(BACKENDS)}; "
                             "pick one of those (auto times the applicable ones)")
        self.module = module.module if isinstance(module, HybridModule) else module
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.backend = backend
        self.keep_grads = keep_grads
        self.max_signatures = max_signatures
        self.state = CAPTURE
        self.fallback_reason: str | None = None
        self._eager = _without_history(eager_step(self.module, loss_fn, optimizer))
        self._runners: dict[tuple, _Runner] = {}
        self._update: OptimizerUpdate | None = None
        # Seconds of the first signature: tracing and preparing the runners; and the whole first call,
        # which adds auto's timing of the candidates (a few steps each) and the step itself.
        self.capture_s: float | None = None
        self.first_call_s: float | None = None

    # --- calling --------------------------------------------------------------------------
    def __call__(self, x, y) -> torch.Tensor:
        if self.state is REPLAY:
            key = _signature(x, y, self.module.training)
            runner = self._runners.get(key) if key is not None else None
            if runner is not None:
                return runner.step(x, y)
        return self._slow_call(x, y)

    def _slow_call(self, x, y) -> torch.Tensor:
        if self.state is EAGER:
            return self._eager(x, y)
        key = _signature(x, y, self.module.training)
        if key is None:
            return self._fall_back(f"inputs {batches.describe(x)} / {batches.describe(y)} hold no tensor", x, y)
        if len(self._runners) >= self.max_signatures:
            return self._eager(x, y)
        t0 = time.perf_counter()
        try:
            if self._update is None:
                self._update = functional_update(self.optimizer, self.module)
            joint = capture_joint(self.module, self.loss_fn, x, y)
        except TrainCaptureError as exc:
            return self._fall_back(str(exc), x, y, exc.line)
        except UnsupportedOptimizer as exc:
            return self._fall_back(str(exc), x, y)
        ready = self._candidates(joint, x, y)
        if self.capture_s is None:
            self.capture_s = time.perf_counter() - t0
        runner = self._choose(ready, x, y)
        self._runners[key] = runner
        self.state = REPLAY
        loss = runner.step(x, y)
        if self.first_call_s is None:
            self.first_call_s = time.perf_counter() - t0
        return loss

    def _fall_back(self, reason: str, x, y, line: str | None = None) -> torch.Tensor:
        self.state, self.fallback_reason, self._runners = EAGER, reason, {}
        warn_at_caller(f"cannot capture the training step of {type(self.module).__name__}: {reason}; "
                       "running it eagerly", HybridizeWarning, line)
        return self._eager(x, y)

    # --- choosing how to replay -----------------------------------------------------------
    def _candidates(self, joint: JointGraph, x, y) -> list[_Runner]:
        from .train_replay import prepare_runner

        names = [self.backend] if self.backend != "auto" else ["native", "graph", "cuda_graphs"]
        ready, skipped = [], []
        first_step = _FirstStep(self, x, y)
        assert self._update is not None
        # parameters the loss does not reach keep no gradient, and the optimizer leaves them alone, as in eager
        update = self._update if joint.used is None else self._update.only(joint.used)
        for name in names:
            if name == "eager":
                ready.append(_Runner("eager", self._eager, "requested"))
                continue
            step, why_not = prepare_runner(name, joint, update, x, y, keep_grads=self.keep_grads)
            if step is not None:
                why_not = first_step.differences(step)
                step = None if why_not else step
            if step is None:
                skipped.append(f"{name}: {why_not}")
                if self.backend != "auto":
                    warn_at_caller(f"train_step backend {name!r} cannot serve this step ({why_not}); "
                                   "running eagerly", HybridizeWarning)
            else:
                ready.append(_Runner(name, step, getattr(step, "detail", name)))
        if not ready:
            ready.append(_Runner("eager", self._eager, "no backend could serve: " + "; ".join(skipped)))
        elif skipped:
            for r in ready:
                r.reason += "; skipped " + "; ".join(skipped)
        return ready

    def _choose(self, ready: list[_Runner], x, y) -> _Runner:
        if self.backend != "auto":
            return ready[0]
        ready.append(_Runner("eager", self._eager, "the eager step"))
        timed = sorted(((self._time(r, x, y), r) for r in ready), key=lambda t: t[0])
        best_s, best = timed[0]
        others = ", ".join(f"{r.backend} {s * 1e6:.0f} us" for s, r in timed[1:])
        best.reason = f"fastest step: {best_s * 1e6:.0f} us vs {others} ({best.reason})"
        return best

    def _time(self, runner: _Runner, x, y) -> float:
        """Median seconds per step of ``runner``; the steps are undone (weights, buffers, optimizer, RNG)."""
        saved = _Saved(self.module, self.optimizer)
        try:
            on_gpu = any(p.is_cuda for p in self.module.parameters())
            timing = time_steps(lambda: runner.step(x, y), warmup=1, steps=AUTO_STEPS, min_steps=3,
                                max_seconds=AUTO_BUDGET_S,
                                synchronize=torch.cuda.synchronize if on_gpu else _no_sync)
        finally:
            saved.restore(runner.step)
        return timing.median_s

    # --- reports --------------------------------------------------------------------------
    @property
    def choices(self) -> dict[tuple, str]:
        """Signature -> backend stepping it."""
        return {k: r.backend for k, r in self._runners.items()}

    @property
    def runs_on(self) -> str:
        """What steps the model: the backend(s) replaying its signatures, else the state (``eager``, ``capture``)."""
        chosen = sorted(set(self.choices.values()))
        return ",".join(chosen) if chosen else self.state

    @property
    def eager_reason(self) -> str | None:
        """Why the model is stepped eagerly, in one line; None while a captured graph steps it.

        Either the step could not be captured (``fallback_reason``) or ``auto`` timed the eager step
        fastest for every signature it prepared (the runner's reason gives the figures).
        """
        runners = list(self._runners.values())
        if self.fallback_reason is not None:
            why = self.fallback_reason
        elif runners and all(r.backend == "eager" for r in runners):
            why = runners[0].reason
        else:
            return None
        return " ".join(why.split())

    def __repr__(self) -> str:
        lines = [f"TrainStep({type(self.module).__name__}, {type(self.optimizer).__name__}, "
                 f"backend={self.backend!r}, state={self.state!r})"]
        if self.fallback_reason:
            lines.append(f"  eager because: {self.fallback_reason}")
        for key, runner in self._runners.items():
            lines.append(f"  {_describe_key(key)} -> {runner.backend}: {runner.reason}")
        return "\n".join(lines)


def train_step(module: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer, *,
               backend: str = "auto", keep_grads: bool = False) -> TrainStep:
    """A training step (forward, loss, backward, optimizer update) captured on its first call.

    Args:
        backend: ``native`` (C++ plan: forward, backward and a fused SGD update), ``graph`` (the joint ATen
            graph replayed without autograd), ``cuda_graphs`` (the graph step recorded as one CUDA graph),
            ``compile`` (the joint graph through ``torch.compile``; seconds to compile, never tried by
            ``auto``), ``eager``, or ``auto``, which times the applicable ones against the eager step and
            keeps the fastest (``repr`` says which and by how much).
        keep_grads: leave each step's gradients in ``.grad`` (eager does; skipping it saves a pass).

    >>> import torch
    >>> net = torch.nn.Linear(4, 2)
    >>> step = train_step(net, torch.nn.functional.mse_loss, torch.optim.Adam(net.parameters()))
    >>> float(step(torch.randn(8, 4), torch.randn(8, 2))) >= 0
    True
    """
    return TrainStep(module, loss_fn, optimizer, backend=backend, keep_grads=keep_grads)


def make_train_step(model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer, example_x=None,
                    example_y=None, *, backend: str = "auto") -> TrainStep:
    """:data:`dlperf.steps.MakeStep` for the captured step: captured now when an example batch is given."""
    step = TrainStep(model, loss_fn, optimizer, backend=backend)
    if example_x is not None and example_y is not None:
        saved = _Saved(step.module, optimizer)
        try:
            step(example_x, example_y)  # capture and choose now, not in the first timed step
        finally:
            saved.restore()
            for runner in step._runners.values():
                _reset(runner.step)
    return step


def _no_sync() -> None:
    return None


def _without_history(step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``step`` returning its loss detached, as every captured step does: holding it keeps no graph alive."""

    def detached(x, y) -> torch.Tensor:
        return step(x, y).detach()

    return detached


class _Saved:
    """What a step changes (module state and RNG, the optimizer's state, ``.grad``), to put back after trial steps."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer):
        self.module, self.optimizer = module, optimizer
        self.state = ModuleState(module)
        self.optimizer_state = _snapshot_optimizer(optimizer)
        self.grads = [(p, p.grad) for p in module.parameters()]

    def restore(self, runner: Callable | None = None) -> None:
        self.state.restore()
        _restore_optimizer(self.optimizer, self.optimizer_state)
        for p, g in self.grads:
            p.grad = g
        if runner is not None:
            _reset(runner)


def _reset(runner: Callable) -> None:
    reset = getattr(runner, "reset", None)
    if reset is not None:  # a runner that keeps steps of its own (a recorded CUDA graph) starts afresh
        reset()


@dataclass
class _Outcome:
    """What one step from the saved state left: its loss, module tensors changed, optimizer state, gradients."""

    loss: torch.Tensor
    changed: dict[str, torch.Tensor]
    optimizer_state: dict
    grads: list[torch.Tensor | None]


class _FirstStep:
    """Eager's first step on ``(x, y)``, and the check of another backend's first step against it.

    Both start from the same state and are undone, so the caller's step that follows is the first for real.
    """

    def __init__(self, owner: TrainStep, x, y):
        self.owner, self.x, self.y = owner, x, y
        self._reference: _Outcome | None = None

    def differences(self, step: Callable[..., torch.Tensor]) -> str | None:
        """Why ``step``'s first step is not eager's (None when it is, within float tolerance)."""
        if self._reference is None:
            # the user's own step: an error in it is theirs, raised as eager raises it
            self._reference = self._run(self.owner._eager)
        reference = self._reference
        saved = _Saved(self.owner.module, self.owner.optimizer)
        try:
            loss = step(self.x, self.y)
            differ = saved.state.step_differences(reference.changed)
            differ += _optimizer_differences(self.owner.optimizer, saved.optimizer_state[0], reference.optimizer_state)
            if not _close(loss, reference.loss):
                differ.append("the loss")
            if self.owner.keep_grads:
                differ += [f"{name}.grad" for (name, p), g in zip(self.owner.module.named_parameters(), reference.grads)
                           if not _close(p.grad, g)]
        except Exception as exc:  # noqa: BLE001 (a backend that cannot run the step does not serve it)
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return f"its first step failed ({type(exc).__name__}: {text[:200]})"
        finally:
            saved.restore(step)
        if differ:
            return f"its first step differs from eager's ({', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''})"
        return None

    def _run(self, step: Callable[..., torch.Tensor]) -> _Outcome:
        saved = _Saved(self.owner.module, self.owner.optimizer)
        try:
            loss = step(self.x, self.y).detach().clone()
            grads = [None if p.grad is None else p.grad.detach().clone() for p in self.owner.module.parameters()]
            return _Outcome(loss, saved.state.changed_tensors(), _snapshot_optimizer(self.owner.optimizer)[0], grads)
        finally:
            saved.restore(step)


def _close(got, expected) -> bool:
    if got is None or expected is None:
        return got is None and expected is None
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return False
    if not expected.is_floating_point():
        return torch.equal(got, expected)
    return bool(torch.allclose(got.detach().float(), expected.float(), CHECK_RTOL, CHECK_ATOL, equal_nan=True))


def _optimizer_differences(optimizer: torch.optim.Optimizer, before: dict, expected: dict) -> list[str]:
    """The optimizer's per-parameter state that did not change as it did in ``expected`` (from ``before``)."""
    names = {id(p): f"param {i}" for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    differ = []
    for p in set(optimizer.state) | set(expected):
        got, want, was = optimizer.state.get(p, {}), expected.get(p, {}), before.get(p, {})
        for key in set(got) | set(want):
            a, b = got.get(key), want.get(key)
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                start = was.get(key)
                same = same_change(start if isinstance(start, torch.Tensor) and start.shape == b.shape
                                   else torch.zeros_like(b), a, b)
            else:
                same = type(a) is type(b) and a == b
            if not same:
                differ.append(f"optimizer state[{names.get(id(p), '?')}][{key!r}]")
    return sorted(differ)


def _signature(x, y, training: bool) -> tuple | None:
    leaves, spec = tree_flatten((x, y))
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append((leaf.shape, leaf.dtype, leaf.device))
        else:
            parts.append(leaf)
    if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return None
    return (spec, *parts, training)


def _describe_key(key: tuple) -> str:
    parts = [f"{str(p[1]).removeprefix('torch.')}{list(p[0])}" for p in key[1:-1] if isinstance(p, tuple)]
    return f"({', '.join(parts)}; {'train' if key[-1] else 'eval'})"


def _snapshot_optimizer(opt: torch.optim.Optimizer) -> tuple[dict, list[dict]]:
    state = {p: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
             for p, s in opt.state.items()}
    return state, [dict(g) for g in opt.param_groups]


def _restore_optimizer(opt: torch.optim.Optimizer, saved: tuple[dict, list[dict]]) -> None:
    state, groups = saved
    with torch.no_grad():
        for p in list(opt.state):
            if p not in state:
                del opt.state[p]
        for p, s in state.items():
            live = opt.state[p]
            for k in list(live):
                if k not in s:
                    del live[k]
            for k, v in s.items():
                if isinstance(v, torch.Tensor) and isinstance(live.get(k), torch.Tensor) \
                        and live[k].shape == v.shape:
                    live[k].copy_(v)  # in place: a native plan holds these very tensors
                else:
                    live[k] = v
    for g, saved_g in zip(opt.param_groups, groups):
        g.update(saved_g)



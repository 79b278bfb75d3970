"""``hybridize(module)``: develop eagerly, then replay a captured graph without the Python.

A :class:`HybridModule` is an explicit state machine: ``capture`` (the next call traces ``forward``,
:mod:`dlperf.hybrid.capture`; what cannot be traced warns with the user's line and goes ``eager``, or raises with
``strict=True``), ``replay`` (each call's signature, the inputs' shapes, dtypes, devices and ``requires_grad``, the
grad mode and ``module.training``, picks a runner, prepared and checked against eager on the first call of each
signature, up to ``max_signatures``) and ``eager`` (``reset()`` goes back to ``capture``). Replays do not run
forward's Python; each call changes the caller's tensors and the module's buffers exactly once, as eager does. The
states, the checks and what runs forward's Python when: docs/design/hybridize.md.

>>> import torch
>>> from dlperf.models import get_model
>>> net = hybridize(get_model("mlp"), backend="graph")
>>> x = torch.randn(1, 512)
>>> with torch.no_grad():
...     y = net(x)
>>> net.state
'replay'
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from ..batch import describe, tensors_of
from ..engine.array import Array, call_module
from ..errors import UsageError
from ..timing import time_steps
from ._warn import warn_at_caller
from .backends.registry import Backend, BackendUnsupported, get_backend
from .capture import Captured, CaptureError, ModuleState, capture

log = logging.getLogger("dlperf.hybrid")

EAGER, CAPTURE, REPLAY = "eager", "capture", "replay"
STALE = "stale"  # replay, but the module's structure changed since capture: the next call captures again
_grad_enabled = torch.is_grad_enabled

# Trial calls per candidate when backend="auto": enough for a stable median on small models,
# bounded in time for big ones (a 100 ms forward gets the minimum).
AUTO_MIN_TRIALS, AUTO_MAX_TRIALS, AUTO_BUDGET_S = 3, 200, 0.05
# Backends whose runner is forward's own Python (eager) are timed with this many runs and no
# warm-up (the eager reference run just warmed it): each run repeats forward's side effects.
AUTO_PYTHON_TRIALS = 3
# A runner whose output differs from eager's beyond this is never used (float32 reassociation
# in fused kernels moves results by ~1e-6 relative; anything larger is a bug).
CHECK_RTOL, CHECK_ATOL = 1e-4, 1e-5


class _Unreplayable(Exception):
    """The forward does something no replay reproduces; the module runs eagerly from now on."""


@dataclass
class _Observed:
    """One run's result: output, gradients, the inputs after it, and what it changed on the module."""

    output: object
    grads: tuple
    inputs: tuple
    modifies_inputs: bool
    state: dict[str, torch.Tensor]  # tensors changed in place -> their new values
    rebound: list[str]  # attributes rebound or Python values changed


class HybridizeWarning(UserWarning):
    """A hybridized module did something other than replay: re-prepared, or fell back to eager."""


@dataclass
class Choice:
    """The runner serving one signature, and why it was picked (shown by ``repr``)."""

    backend: str
    run: Callable
    reason: str


class HybridModule(nn.Module):
    """A module whose calls replay a captured graph; see the module docstring for the states.

    Parameters, buffers and ``state_dict`` are the wrapped module's own, so an optimizer built on
    either sees the same tensors and checkpoints are interchangeable.
    """

    _inner: nn.Module  # the wrapped module, also as a plain attribute (see __init__)

    def __init__(self, module: nn.Module, backend: str = "auto", *, strict: bool = False,
                 max_signatures: int = 8, candidates: Sequence[str] | None = None):
        super().__init__()
        if backend != "auto":
            get_backend(backend)  # fail now on a typo, listing what exists
        if max_signatures < 1:
            raise UsageError(f"max_signatures must be >= 1, got {max_signatures}")
        self.module = module
        # A plain attribute too: nn.Module.__getattr__ (for registered children) costs ~0.3 us.
        self.__dict__["_inner"] = module
        self.backend = backend
        self.strict = strict
        self.max_signatures = max_signatures
        self.candidates = tuple(candidates) if candidates is not None else None
        for name in self.candidates or ():
            get_backend(name)
        self._state = CAPTURE
        self._captured: Captured | None = None
        self._captures: dict[int, Captured] = {}  # by number of inputs: defaulted parameters make several
        self._change: str | None = None  # what changed the structure since capture (state STALE)
        self._preparing = False
        self._choices: dict[tuple, Choice] = {}
        self._runs: dict[tuple, Callable] = {}  # signature -> runner, the hot path's view of _choices
        self._fallback_reason: str | None = None
        self._warned_full = False
        # Calls with tuples/lists/dicts of tensors: one flat-input hybrid per structure (see _structured_call).
        self._structured: dict[tuple, HybridModule] = {}

    # --- state machine --------------------------------------------------------------------
    @property
    def state(self) -> str:
        """``capture``, ``replay`` or ``eager`` (``capture`` again once the module's structure changed)."""
        return CAPTURE if self._state is STALE else self._state

    @property
    def fallback_reason(self) -> str | None:
        """Why calls run the original module (None while capturing or replaying)."""
        return self._fallback_reason

    @property
    def choices(self) -> dict[tuple, Choice]:
        """Signature -> the backend serving it and the reason (structured inputs: their flat tensors)."""
        merged = dict(self._choices)
        for structure, sub in self._structured.items():
            merged.update({(structure, *key): choice for key, choice in sub._choices.items()})
        return merged

    def reset(self) -> HybridModule:
        """Forget the captured graph and runners; the next call captures again.

        Not needed after a change of structure (a layer added or replaced, a parameter or buffer
        assigned anew): that is noticed, and the next call captures again by itself, saying so.
        Needed after a change of a plain Python value forward reads (``self.scale = 2.0``).
        """
        self._state, self._captured, self._captures, self._choices, self._runs = CAPTURE, None, {}, {}, {}
        self._fallback_reason, self._warned_full, self._structured, self._change = None, False, {}, None
        return self

    def eager(self) -> HybridModule:
        """Switch hybridization off: calls run the original module."""
        self._state, self._choices, self._runs, self._structured = EAGER, {}, {}, {}
        self._fallback_reason = "switched off by eager()"
        return self

    def capture(self, *example_args) -> HybridModule:
        """Capture the graph now, from example inputs, without running the model (no side effects).

        Moves ``capture`` to ``replay`` (or to ``eager`` with a warning if it cannot be captured);
        runners are still prepared on the first real call of each signature.
        """
        if self._state is CAPTURE:
            self._capture_or_fallback(example_args)
        return self

    def _capture_or_fallback(self, args: tuple) -> bool:
        try:
            self._captured = capture(self.module, args)
        except CaptureError as exc:
            if self.strict:
                raise
            self._state, self._fallback_reason = EAGER, str(exc)
            self._warn(f"cannot hybridize {type(self.module).__name__}: {exc}; running eagerly", exc.line)
            return False
        self._captures[len(args)] = self._captured
        _watch_structure(self, self.module)
        self._state = REPLAY
        return True

    def _structure_changed(self, module: nn.Module, name: str, kind: str) -> None:
        """A submodule, parameter or buffer was registered on ``module``, part of the captured module."""
        if self._state is not REPLAY or self._preparing:  # a trial run's own assignments are undone after it
            return
        path = next((p for p, m in self.module.named_modules() if m is module), None)
        self._change = f"{kind} {f'{path}.{name}' if path else name} set"
        self._state = STALE

    def __call__(self, *args, **kwargs):
        # The hot path, a few hundred nanoseconds: no nn.Module.__call__, one key tuple, one dict
        # lookup. The key is _signature()'s single-input form, spelled out to save a call.
        if self._state is REPLAY and len(args) == 1 and not kwargs:
            x = args[0]
            try:
                key = (x.shape, x.dtype, x.device, x.requires_grad, _grad_enabled(), self._inner.training)
            except AttributeError:
                key = None
            run = self._runs.get(key)
            if run is not None:
                return run(x)
        return self._slow_call(args, kwargs)

    forward = __call__

    def _signature(self, args: tuple) -> tuple:
        if len(args) == 1:
            x = args[0]
            # A non-tensor input raises AttributeError -> the slow path sorts it out.
            try:
                return (x.shape, x.dtype, x.device, x.requires_grad, _grad_enabled(), self._inner.training)
            except AttributeError:
                return (None,)
        parts = []
        for x in args:
            if not isinstance(x, torch.Tensor):
                return (None,)
            parts.append((x.shape, x.dtype, x.device, x.requires_grad))
        return (*parts, _grad_enabled(), self._inner.training)

    def _slow_call(self, args: tuple, kwargs: dict):
        if not kwargs and any(type(a) is Array for a in args):
            # Engine arrays: the whole call is one engine operation, prepared or replayed on a worker.
            return call_module(self, args)
        if self._state is EAGER:
            return self.module(*args, **kwargs)
        if self._state is STALE:
            # MXNet clears a block's cached graph when a child is registered on it, and the next call builds
            # it anew; the graph here holds the old layers, so it is dropped the same way, once per change
            change = self._change
            self.reset()
            self._warn(f"{type(self.module).__name__} changed since it was captured ({change}); capturing it again")
        if not kwargs and args and not all(isinstance(a, torch.Tensor) for a in args) and tensors_of(args):
            return self._structured_call(args)
        why_not = _uncapturable_call(args, kwargs)
        if why_not:
            self._warn(f"{why_not}; this call runs eagerly")
            return self.module(*args, **kwargs)
        if self._state is CAPTURE and not self._capture_or_fallback(args):
            return self.module(*args)
        key = self._signature(args)
        run = self._runs.get(key)
        if run is not None:  # a known signature of a multi-input call (single inputs hit __call__)
            return run(*args)
        if len(args) not in self._captures and not self._capture_arity(args, key):
            return self.module(*args)
        return self._new_signature(args, key)

    def _new_signature(self, args: tuple, key: tuple):
        """Prepare and cache the runner of a signature not seen yet (or run eagerly past ``max_signatures``)."""
        if len(self._choices) >= self.max_signatures:
            if not self._warned_full:
                self._warned_full = True
                self._warn(f"{len(self._choices)} input signatures are already prepared "
                           f"(max_signatures={self.max_signatures}); new signatures run eagerly")
            return self.module(*args)
        if self._choices:
            known = ", ".join(_format_signature(k) for k in self._choices)
            self._warn(f"input signature changed to {_format_signature(key)} (prepared: {known}); "
                       "preparing a replay for it")
        try:
            choice, output = self._prepare(args)
        except _Unreplayable as exc:
            if self.strict:
                raise CaptureError(str(exc)) from None
            self._state, self._fallback_reason, self._choices, self._runs = EAGER, str(exc), {}, {}
            self._warn(f"cannot hybridize {type(self.module).__name__}: {exc}; running eagerly")
            return self.module(*args)
        self._choices[key] = choice
        self._runs[key] = choice.run
        log.info("dlperf.hybrid: %s for %s: %s", choice.backend, _format_signature(key), choice.reason)
        return output

    def _capture_arity(self, args: tuple, key: tuple) -> bool:
        """Capture the graph of a call with this many inputs (a defaulted parameter given, or left out).

        If it cannot be captured, calls of this signature run eagerly from now on, saying so once.
        """
        self._preparing = True  # a failed capture undoes the state its tracing changed
        try:
            self._captures[len(args)] = capture(self.module, args)
        except CaptureError as exc:
            if self.strict:
                raise
            self._warn(f"cannot hybridize a call of {type(self.module).__name__} with {len(args)} inputs: {exc}; "
                       "such calls run eagerly", exc.line)
            choice = Choice("eager", self.module, f"not captured with {len(args)} inputs: {exc}")
            self._choices[key], self._runs[key] = choice, choice.run
            return False
        finally:
            self._preparing = False
        return True

    def _structured_call(self, args: tuple):
        """A call whose inputs are tuples, lists or dicts of tensors (and plain values).

        The tensors are passed flat to a hybrid of :class:`_FlatInputs`, which rebuilds the structure and
        calls the module: capture, checks and backends all see plain tensors. Plain values (a string, a
        flag) are part of the structure, so a new value is a new graph, as a new shape is.
        """
        leaves, spec = tree_flatten(args)
        constants = tuple((i, leaf) for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor))
        try:
            key = (spec, constants)
            hash(key)
        except TypeError:
            self._warn(f"inputs {describe(args)} hold an unhashable plain value; this call runs eagerly")
            return self.module(*args)
        sub = self._structured.get(key)
        if sub is None:
            if len(self._structured) >= self.max_signatures:
                return self.module(*args)
            sub = HybridModule(_FlatInputs(self.module, spec, leaves), self.backend, strict=self.strict,
                               max_signatures=self.max_signatures, candidates=self.candidates)
            self._structured[key] = sub
        return sub(*[leaf for leaf in leaves if isinstance(leaf, torch.Tensor)])

    # --- choosing a runner for a new signature --------------------------------------------
    def _prepare(self, args: tuple) -> tuple[Choice, object]:
        """Pick the runner for this signature; returns it and this call's output.

        The eager reference, every trial and every timing run work on copies of the inputs and
        are undone on the module (parameters, buffers, attributes, RNG) afterwards, so only the
        final call, on the caller's tensors, has side effects: exactly one call's worth, as eager.
        """
        assert len(args) in self._captures
        device = args[0].device if args else torch.device("cpu")
        needs_grad = torch.is_grad_enabled()
        self._preparing = True
        try:
            return self._choose(args, device, needs_grad)
        finally:
            self._preparing = False

    def _choose(self, args: tuple, device: torch.device, needs_grad: bool) -> tuple[Choice, object]:
        state = ModuleState(self.module)
        try:
            reference = self._observe(self.module, args, needs_grad, state)
        finally:
            state.restore()
        if reference.rebound:
            raise _Unreplayable(f"forward rebinds module attributes ({_attrs(reference.rebound)}), "
                                "which a replayed graph would not")
        names = self._candidate_names() if self.backend == "auto" else [self.backend]
        ready: list[tuple[Backend, Callable]] = []
        rejected: list[str] = []
        for name in names:
            backend = get_backend(name)
            run, why_not = self._try_backend(backend, args, device, needs_grad, reference, state)
            if run is None:
                if backend.unsupported_reason(device, False) is None or self.backend != "auto":
                    rejected.append(f"{name}: {why_not}")  # device mismatches are not news
                if self.backend != "auto":
                    self._warn(f"backend {name!r} cannot serve this call ({why_not}); running eagerly")
            else:
                ready.append((backend, run))
        if not ready:
            return Choice("eager", self.module, "no backend could serve: " + "; ".join(rejected)), \
                self.module(*args)
        if len(ready) == 1:
            backend, run = ready[0]
            detail = getattr(run, "detail", backend.description)
            reason = f"requested ({detail})" if self.backend != "auto" else f"only candidate ({detail})"
            if rejected:
                reason += "; skipped " + "; ".join(rejected)
            return Choice(backend.name, run, reason), run(*args)
        timed = [(self._time_runner(run, args, device, state, reference.modifies_inputs, backend.runs_python),
                  backend, run) for backend, run in ready]
        timed.sort(key=lambda t: t[0])
        best_s, backend, run = timed[0]
        others = ", ".join(f"{b.name} {s * 1e6:.1f} us" for s, b, _ in timed[1:])
        detail = getattr(run, "detail", backend.description)
        what = "forward+backward" if torch.is_grad_enabled() else "call"
        reason = f"fastest: {best_s * 1e6:.1f} us/{what} vs {others} ({detail})"
        if rejected:
            reason += "; skipped " + "; ".join(rejected)
        return Choice(backend.name, run, reason), run(*args)

    def _candidate_names(self) -> list[str]:
        from .backends.registry import backend_names

        if self.candidates is not None:
            return list(self.candidates)
        return [n for n in backend_names() if get_backend(n).in_auto]

    def _try_backend(self, backend: Backend, args, device, needs_grad, reference: _Observed,
                     state: ModuleState):
        why_not = backend.unsupported_reason(device, needs_grad)
        if why_not:
            return None, why_not
        captured = self._captures.get(len(args))
        assert captured is not None, "backends are tried on a captured graph"
        try:
            # prepare() may run the graph (CUDA graph warm-up): copies, and undone like a trial.
            run = backend.prepare(captured, _copies(args)[0])
            if run is self.module:  # the reference itself: a trial would only repeat forward's side effects
                return run, None
            why_not = _differences(self._observe(run, args, needs_grad, state), reference, state)
        except BackendUnsupported as exc:
            return None, str(exc)
        except Exception as exc:  # a backend bug must not take the user's model down
            return None, f"failed: {type(exc).__name__}: {exc}"
        finally:
            state.restore()
        return (None, why_not) if why_not else (run, None)

    def _observe(self, run: Callable, args: tuple, needs_grad: bool, state: ModuleState) -> _Observed:
        """Run ``run`` on copies of ``args`` and record all that eager's result consists of."""
        copies, leaves = _copies(args)
        versions = [c._version for c in copies]
        output, grads = self._forward_backward(run, copies, leaves, needs_grad)
        modifies_inputs = versions != [c._version for c in copies]
        return _Observed(output, grads, copies, modifies_inputs, state.changed_tensors(), state.replaced())

    def _forward_backward(self, run: Callable, args: tuple, arg_leaves: list, needs_grad: bool):
        """Output of ``run(*args)`` and, when autograd records, the gradients of its sum.

        torch.autograd.grad returns gradients without touching ``.grad``, so trial runs leave
        the user's accumulated gradients alone.
        """
        out = run(*args)
        if not needs_grad:
            return out, ()
        leaves = [p for p in self.module.parameters() if p.requires_grad] + arg_leaves
        total = [o.float().sum() for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        if not total or not leaves:
            return out, ()
        grads = torch.autograd.grad(cast(torch.Tensor, sum(total)), leaves, allow_unused=True)
        return out, tuple(g if g is not None else torch.zeros(()) for g in grads)

    def _time_runner(self, run: Callable, args: tuple, device: torch.device, state: ModuleState,
                     modifies_inputs: bool, runs_python: bool = False) -> float:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        needs_grad = torch.is_grad_enabled()
        # With autograd on, a trial is forward and backward: a backend that speeds up the forward
        # but slows down the backward must not win a training run.
        inputs = [_copies(args)]  # a forward that mutates its input mutates these, not the caller's

        def trial() -> None:
            self._forward_backward(run, *inputs[0], needs_grad)

        def fresh_inputs() -> None:  # runs between steps, untimed: x.mul_(0.5) 200 times would time denormals
            inputs[0] = _copies(args)

        try:
            # One untimed warm-up for lazy allocations and algorithm choices; the budget bounds the rest.
            if runs_python:
                timing = time_steps(trial, warmup=0, steps=AUTO_PYTHON_TRIALS, synchronize=sync,
                                    on_step=fresh_inputs if modifies_inputs else None)
            else:
                timing = time_steps(trial, warmup=1, steps=AUTO_MAX_TRIALS, synchronize=sync,
                                    on_step=fresh_inputs if modifies_inputs else None,
                                    max_seconds=AUTO_BUDGET_S, min_steps=AUTO_MIN_TRIALS)
        finally:
            state.restore()
        return timing.median_s

    def _warn(self, message: str, line: str | None = None) -> None:
        # At the user's offending line when capture found one, else at the user's call: never in dlperf.
        warn_at_caller(message, HybridizeWarning, line)

    # --- plumbing --------------------------------------------------------------------------
    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            # New Parameter objects would leave the captured graph pointing at the old ones.
            self.reset()
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def extra_repr(self) -> str:
        lines = [f"backend={self.backend!r}, state={self._state!r}"]
        if self._fallback_reason:
            lines.append(f"eager because: {self._fallback_reason}")
        for key, choice in self._choices.items():
            lines.append(f"{_format_signature(key)} -> {choice.backend}: {choice.reason}")
        for (_, constants), sub in self._structured.items():
            flat = cast(_FlatInputs, sub.module)
            values = f" with {', '.join(f'#{i}={v!r}' for i, v in constants)}" if constants else ""
            lines.append(f"inputs {flat.structure}{values}: state={sub.state!r}")
            if sub._fallback_reason:
                lines.append(f"  eager because: {sub._fallback_reason}")
            lines += [f"  {_format_signature(k)} -> {c.backend}: {c.reason}" for k, c in sub._choices.items()]
        return "\n".join(lines)


class _FlatInputs(nn.Module):
    """``module`` called on a structure rebuilt from flat tensors: what a graph of structured inputs captures."""

    def __init__(self, module: nn.Module, spec, example_leaves: list):
        super().__init__()
        self.module = module
        self._spec = spec
        self.structure = describe(tree_unflatten(example_leaves, spec))
        self._tensor_at = [i for i, leaf in enumerate(example_leaves) if isinstance(leaf, torch.Tensor)]
        # Plain values stay; tensor places are filled on each call (no example tensor is kept alive).
        self._leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in example_leaves]

    def forward(self, *tensors):
        leaves = list(self._leaves)
        for i, t in zip(self._tensor_at, tensors):
            leaves[i] = t
        return self.module(*tree_unflatten(leaves, self._spec))


# Structure changes. torch calls its global registration hooks whenever a submodule, parameter or buffer is
# set on any module (nn.Module.__setattr__, add_module, register_parameter, register_buffer): for a module that
# is part of a captured hybrid, that hybrid's graph holds what was there before. The hooks are installed with
# the first capture and kept (a dictionary lookup per registration); a replay itself costs nothing more.
_watched: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[HybridModule]] = weakref.WeakKeyDictionary()
_watch_hooks: list[Any] = []
_watch_lock = threading.Lock()


def _watch_structure(hybrid: HybridModule, module: nn.Module) -> None:
    with _watch_lock:
        for m in module.modules():
            owners = _watched.get(m)
            if owners is None:
                owners = _watched[m] = weakref.WeakSet()
            owners.add(hybrid)
        if not _watch_hooks:
            registry = nn.modules.module
            _watch_hooks.extend([
                registry.register_module_module_registration_hook(_on_module),
                registry.register_module_parameter_registration_hook(_on_parameter),
                registry.register_module_buffer_registration_hook(_on_buffer),
            ])


def _changed(module: nn.Module, name: str, kind: str) -> None:
    owners = _watched.get(module)
    if owners:
        for hybrid in list(owners):
            hybrid._structure_changed(module, name, kind)


def _on_module(module: nn.Module, name: str, value: Any) -> None:
    _changed(module, name, "layer")


def _on_parameter(module: nn.Module, name: str, value: Any) -> None:
    _changed(module, name, "parameter")


def _on_buffer(module: nn.Module, name: str, value: Any) -> None:
    _changed(module, name, "buffer")


def hybridize(module: nn.Module, backend: str = "auto", *, strict: bool = False,
              max_signatures: int = 8, candidates: Sequence[str] | None = None) -> HybridModule:
    """Wrap ``module`` so that its calls replay a captured graph.

    Args:
        backend: a registered backend name (``dlperf.hybrid.backend_names()``) or ``"auto"``,
            which times every applicable candidate on the first call of each signature and keeps
            the fastest, saying so in ``repr`` and a log line.
        strict: raise :class:`CaptureError` instead of warning and running eagerly.
        max_signatures: how many input signatures get their own runner before calls run eagerly.
        candidates: backends ``auto`` chooses from (default: those marked for auto).

    >>> import torch
    >>> from torch import nn
    >>> net = hybridize(nn.Sequential(nn.Linear(4, 2), nn.ReLU()), backend="graph")
    >>> net(torch.ones(3, 4)).shape
    torch.Size([3, 2])
    """
    if isinstance(module, HybridModule):
        module = module.module
    return HybridModule(module, backend, strict=strict, max_signatures=max_signatures,
                        candidates=candidates)


def _copies(args: tuple) -> tuple[tuple, list]:
    """Stand-ins for the caller's inputs, and those whose gradient the checks compare.

    An input that is not a leaf stays one, so a forward that modifies it in place runs as in eager
    (autograd refuses in-place changes of a leaf that requires grad).
    """
    copies, leaves = [], []
    for a in args:
        c = a.detach().clone()
        if a.requires_grad:
            c.requires_grad_(True)
            if a.is_leaf:
                leaves.append(c)
            else:
                c = c.clone()
        copies.append(c)
    return tuple(copies), leaves


def _differences(trial: _Observed, reference: _Observed, state: ModuleState) -> str | None:
    """Why a trial run is not eager's reference run (None when it is, within float tolerance)."""
    for what, got, expected in (("output", trial.output, reference.output),
                                ("gradients", trial.grads, reference.grads),
                                ("the inputs after the call", trial.inputs, reference.inputs)):
        mismatch = _mismatch(got, expected)
        if mismatch:
            return f"{what} differ{'s' if what == 'output' else ''} from eager ({mismatch})"
    if trial.rebound:
        return f"rebinds module attributes ({_attrs(trial.rebound)})"
    differ = state.differences(reference.state, CHECK_RTOL, CHECK_ATOL)
    if differ:
        return f"module state after the call differs from eager ({_attrs(differ)})"
    return None


def _attrs(names: list[str]) -> str:
    return ", ".join(f"self.{n}" for n in names)


def _uncapturable_call(args: tuple, kwargs: dict) -> str | None:
    if kwargs:
        return f"keyword arguments ({', '.join(kwargs)}) are not captured; pass inputs positionally"
    if not args:
        return "a call without inputs is not captured"
    if not all(isinstance(a, torch.Tensor) for a in args):
        kinds = ", ".join(type(a).__name__ for a in args)
        return f"only tensor inputs are captured, got ({kinds})"
    return None


def _format_signature(key: tuple) -> str:
    if key == (None,):
        return "(non-tensor inputs)"
    *inputs, grad, training = key
    if len(inputs) == 4 and isinstance(inputs[0], torch.Size):  # the single-input fast form
        inputs = [tuple(inputs)]
    parts = [f"{str(dt).replace('torch.', '')}{list(shape)}@{dev}{'+grad' if rg else ''}"
             for shape, dt, dev, rg in inputs]
    mode = ("train" if training else "eval") + (", autograd" if grad else ", no_grad")
    return f"({', '.join(parts)}; {mode})"


def _mismatch(out, ref) -> str | None:
    """Why ``out`` is not eager's ``ref`` (None when they agree within float tolerance).

    Outputs may be any pytree (dicts, nested tuples and lists, namedtuples) of tensors and values.
    """
    out_leaves, out_spec = tree_flatten(out)
    ref_leaves, ref_spec = tree_flatten(ref)
    if out_spec != ref_spec:
        return "output structure differs"
    for o, r in zip(out_leaves, ref_leaves):
        why = _leaf_mismatch(o, r)
        if why:
            return why
    return None


def _leaf_mismatch(out, ref) -> str | None:
    if isinstance(ref, torch.Tensor):
        if not isinstance(out, torch.Tensor):
            return f"got {type(out).__name__}, expected a tensor"
        if out.shape != ref.shape or out.dtype != ref.dtype:
            return f"got {out.dtype}{list(out.shape)}, expected {ref.dtype}{list(ref.shape)}"
        if ref.is_floating_point() and not torch.allclose(out.detach(), ref.detach(), CHECK_RTOL, CHECK_ATOL,
                                                          equal_nan=True):
            diff = (out.detach() - ref.detach()).abs().max().item()
            return f"max abs difference {diff:.3g}"
        if not ref.is_floating_point() and not torch.equal(out, ref):
            return "values differ"
        return None
    if isinstance(out, torch.Tensor):
        return f"got a tensor, expected {type(ref).__name__}"
    try:
        return None if type(out) is type(ref) and bool(out == ref) else "non-tensor outputs differ"
    except Exception:  # an object whose == is not a truth value
        return None if out is ref else "non-tensor outputs differ"

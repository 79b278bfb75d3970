"""Capture a module's forward as a graph, and refuse what a graph cannot express.

Capture runs ``forward`` once with symbolic stand-ins for the inputs (torch.fx), so every operation on them is
recorded instead of executed. What the stand-ins cannot answer is what a replay would get wrong, and capture stops
there with the user's line: control flow on tensor values, values leaving the graph (``x.item()``), updates of
module state outside it (``self.calls += 1``). Control flow on Python values is unrolled. Each node keeps the grad
mode it was recorded in (:meth:`Captured.grad_mode_changes`); a module that already is a graph
(:class:`GraphSource`) is copied in, not traced. The rules and their reasons: docs/design/hybridize.md.

>>> import torch
>>> from torch import nn
>>> cap = capture(nn.Sequential(nn.Linear(4, 3), nn.ReLU()), (torch.randn(2, 4),))
>>> [n.op for n in cap.graph_module.graph.nodes]
['placeholder', 'get_attr', 'get_attr', 'call_function', 'call_function', 'output']
"""

from __future__ import annotations

import inspect
import linecache
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import fx, nn
from torch.nn import functional as F

from ..errors import DlperfError

# Methods whose result leaves the graph: a replay cannot run the Python that consumes it.
ESCAPING_METHODS = frozenset({"numpy", "item", "tolist", "__bool__", "data_ptr", "__array__"})

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(os.path.abspath(__file__))


class CaptureError(DlperfError, RuntimeError):
    """The forward cannot be captured as a graph; ``line`` is the offending source line."""

    def __init__(self, message: str, line: str | None = None):
        super().__init__(message if line is None else f"{message} at {line}")
        self.line = line


@dataclass
class Captured:
    """A forward captured as a torch.fx graph that shares the module's parameters."""

    module: nn.Module  # the original module (eager replays call it)
    graph_module: fx.GraphModule
    num_inputs: int
    grad_mode: tuple[bool, bool] = (True, False)
    """(grad enabled, inference mode) when forward was traced."""

    def nodes_of(self, op: str) -> list[fx.Node]:
        return [n for n in self.graph_module.graph.nodes if n.op == op]

    def grad_mode_changes(self) -> list[str]:
        """Where forward changed the autograd mode: ``"file:line: source"`` of each first node recorded in a
        mode other than the call's (``no_grad``, ``inference_mode``), which a replayed graph would not keep."""
        lines: list[str] = []
        for node in self.graph_module.graph.nodes:
            mode = node.meta.get("grad_mode")
            if mode is not None and mode != self.grad_mode:
                line = node_source_line(node) or f"node {node.name}"
                if line not in lines:
                    lines.append(line)
        return lines


@runtime_checkable
class GraphSource(Protocol):
    """A module that already is a graph (:class:`~dlperf.hybrid.ExportedModule`): capture copies it in."""

    def graph_of_call(self, args: tuple) -> tuple[fx.Graph, list, Callable[[list], Any]]:
        """The graph of ``self(*args)``, the values its placeholders take in order, and the function
        building the call's result from the graph's flat outputs; ``get_attr`` targets are this module's."""
        ...


def grad_mode() -> tuple[bool, bool]:
    """The autograd mode now: (grad enabled, inference mode)."""
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


class _Tracer(fx.Tracer):
    """torch.fx's tracer, except that a :class:`GraphSource` layer's own graph is copied in, not its forward,
    and that each node keeps the autograd mode it was recorded in."""

    def create_node(self, *args, **kwargs) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta["grad_mode"] = grad_mode()
        return node

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        if isinstance(m, GraphSource) and not kwargs:
            return _copy_graph_in(self, m, self.path_of_module(m), args)
        return super().call_module(m, forward, args, kwargs)


class _Calls(nn.Module):
    """``module(*args)``: a root to trace a :class:`GraphSource` through, so that its call is a layer call."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)


def _copy_graph_in(tracer: fx.Tracer, source: GraphSource, path: str, args: tuple) -> Any:
    graph, flat, result = source.graph_of_call(args)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(flat) or not all(isinstance(v, fx.Proxy) for v in flat):
        raise CaptureError(f"{type(source).__name__} at {path or 'the root'} is called on values computed outside "
                           "the graph; pass it the model's inputs or the results of traced layers")
    val_map: dict[fx.Node, fx.Node] = {ph: v.node for ph, v in zip(placeholders, flat)}
    outputs = cast(tuple, tracer.graph.graph_copy(graph, val_map))  # the source's output is a flat tuple
    for old, new in val_map.items():
        if old.op == "get_attr":  # the source's attribute, seen from the root being traced
            new.target = f"{path}.{old.target}"
    return result([fx.Proxy(o, tracer) if isinstance(o, fx.Node) else o for o in outputs])


def capture(module: nn.Module, example_args: tuple) -> Captured:
    """Trace ``module.forward`` into a lowered fx graph, or raise :class:`CaptureError`.

    ``example_args`` fixes how many positional inputs the graph takes.
    """
    tracer = _Tracer()
    tracer.record_stack_traces = True
    mode = grad_mode()
    root = _Calls(module) if _called_as_a_layer(tracer, module, example_args) else module
    # Parameters are symbolic while tracing; buffers and plain attributes are real objects, so an
    # update of them runs once, for real, and is not in the graph: undo it and refuse the graph.
    state = ModuleState(module, parameters=False)
    try:
        graph = tracer.trace(root, concrete_args=_varargs_placeholders(root, example_args))  # type: ignore[arg-type]
    except CaptureError:
        raise
    except Exception as exc:  # fx raises TraceError, TypeError, AttributeError... all mean "not a graph"
        raise CaptureError(_describe_trace_failure(exc), user_source_line(exc.__traceback__)) from exc
    finally:
        changed = state.replaced() + list(state.changed_tensors())
        state.restore()
    if changed:
        raise CaptureError(f"forward updates module state ({', '.join(f'self.{n}' for n in changed)}) "
                           "outside the graph, so a replay would skip the update; move the update out of "
                           "forward or keep the module eager")
    gm = fx.GraphModule(root, graph, class_name=f"Captured{type(module).__name__}")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_args):
        raise CaptureError(f"forward takes {len(placeholders)} inputs but was called with "
                           f"{len(example_args)} positional arguments; pass inputs positionally")
    _reject_escaping_values(gm)
    _lower_leaf_modules(gm)
    return Captured(module, gm, len(example_args), mode)


def _called_as_a_layer(tracer: fx.Tracer, module: nn.Module, example_args: tuple) -> bool:
    """Whether to trace ``module(*example_args)`` from a wrapper (:class:`_Calls`) rather than its forward.

    A :class:`GraphSource` is copied in where it is called. A torch layer (``nn.BatchNorm2d`` alone) is
    what fx keeps as one call inside a model: traced itself, its forward's checks of the input
    (``if input.dim() != 4``) would stop capture. A forward with more parameters than the call passes,
    the rest defaulted (``forward(self, x, mask=None)``), would get a placeholder for each: called as
    the caller calls it, the defaults apply as they do eagerly and fix the graph.
    """
    if isinstance(module, GraphSource) or tracer.is_leaf_module(module, ""):
        return True
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]  # without self
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(example_args) < len(positional) and all(p.default is not p.empty
                                                      for p in positional[len(example_args):])


def _varargs_placeholders(module: nn.Module, example_args: tuple) -> tuple | None:
    """For ``forward(self, *args)``: one placeholder per example input (fx would make one for ``*args``)."""
    code = type(module).forward.__code__
    if code.co_argcount == 1 and code.co_kwonlyargcount == 0 and code.co_flags & inspect.CO_VARARGS \
            and example_args:
        from torch.fx._symbolic_trace import PH

        return tuple(PH for _ in example_args)
    return None


def _describe_trace_failure(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "control flow" in text or "iterated" in text or "iterable" in text:
        return ("data-dependent Python control flow cannot be captured (the branch depends on tensor "
                f"values the graph does not have yet; use torch.where or keep this module eager): {text}")
    return f"forward cannot be captured as a graph: {type(exc).__name__}: {text}"


def user_source_line(tb) -> str | None:
    """The innermost frame outside torch and this package: where the user's code went wrong."""
    frames = traceback.extract_tb(tb)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH_DIR) or path.startswith(_HERE):
            continue
        source = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
        return f"{frame.filename}:{frame.lineno}: {source}"
    return None


def node_source_line(node: fx.Node) -> str | None:
    """The last user frame of a node's recorded stack trace, as 'file:line: source'."""
    trace = node.stack_trace or ""
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith('File "'):
            try:
                fname = lines[i].split('"')[1]
                lineno = int(lines[i].split("line ")[1].split(",")[0])
            except (IndexError, ValueError):
                continue
            if os.path.abspath(fname).startswith((_TORCH_DIR, _HERE)):
                continue
            source = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{fname}:{lineno}: {source}"
    return None


def _reject_escaping_values(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target in ESCAPING_METHODS:
            raise CaptureError(f"tensor.{node.target}() moves a value out of the graph into Python, "
                               "which a replay would not re-run; remove it from forward or keep the "
                               "module eager", node_source_line(node))


# --- lowering leaf layers to functional calls -----------------------------------------------

def _linear(gm, node, m: nn.Linear):
    return F.linear, (node.args[0], _attr(gm, node, "weight"), _attr(gm, node, "bias") if
                      m.bias is not None else None)


def _conv2d(gm, node, m: nn.Conv2d):
    if m.padding_mode != "zeros":
        return None
    bias = _attr(gm, node, "bias") if m.bias is not None else None
    return F.conv2d, (node.args[0], _attr(gm, node, "weight"), bias, m.stride, m.padding, m.dilation,
                      m.groups)


def _relu(gm, node, m: nn.ReLU):
    return (torch.relu_ if m.inplace else torch.relu), (node.args[0],)


def _flatten(gm, node, m: nn.Flatten):
    return torch.flatten, (node.args[0], m.start_dim, m.end_dim)


def _max_pool2d(gm, node, m: nn.MaxPool2d):
    if m.return_indices:
        return None
    return F.max_pool2d, (node.args[0], m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode)


def _avg_pool2d(gm, node, m: nn.AvgPool2d):
    return F.avg_pool2d, (node.args[0], m.kernel_size, m.stride, m.padding, m.ceil_mode,
                          m.count_include_pad, m.divisor_override)


_LOWERINGS: dict[type, Callable] = {
    nn.Linear: _linear,
    nn.Conv2d: _conv2d,
    nn.ReLU: _relu,
    nn.Sigmoid: lambda gm, node, m: (torch.sigmoid, (node.args[0],)),
    nn.Tanh: lambda gm, node, m: (torch.tanh, (node.args[0],)),
    nn.Flatten: _flatten,
    nn.MaxPool2d: _max_pool2d,
    nn.AvgPool2d: _avg_pool2d,
    nn.AdaptiveAvgPool2d: lambda gm, node, m: (F.adaptive_avg_pool2d, (node.args[0], m.output_size)),
}


def _attr(gm: fx.GraphModule, node: fx.Node, name: str) -> fx.Node:
    with gm.graph.inserting_before(node):
        return gm.graph.get_attr(f"{node.target}.{name}")


def _lower_leaf_modules(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or node.kwargs or len(node.args) != 1:
            continue
        module = gm.get_submodule(node.target)
        if type(module) is nn.Identity:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            continue
        if _has_hooks(module):
            continue  # a lowered layer would skip the user's hooks; keep calling the module
        lower = _LOWERINGS.get(type(module))  # exact type: a subclass may override forward
        lowered = lower(gm, node, module) if lower else None
        if lowered is None:
            continue
        fn, args = lowered
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(fn, args)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def _has_hooks(module: nn.Module) -> bool:
    return any(getattr(module, name, None) for name in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))


# nn.Module's own bookkeeping in __dict__; everything else there is the user's state.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"training"}
_SCALARS = (int, float, complex, bool, str, bytes, type(None))


def _same_value(now: object, then: object) -> bool:
    return now is then or (type(now) is type(then) and isinstance(then, _SCALARS) and now == then)


def _same_tensor(now: torch.Tensor, then: torch.Tensor, rtol: float = 0.0, atol: float = 0.0) -> bool:
    if now.shape != then.shape or now.dtype != then.dtype:
        return False
    if now.is_floating_point() or now.is_complex():
        return torch.allclose(now.detach(), then, rtol, atol, equal_nan=True)
    return torch.equal(now.detach(), then)


# A step's change compared with eager's: within this fraction of eager's change, of the largest change in the
# tensor (sums reassociated), and of float32 rounding of the value itself.
CHANGE_RTOL, CHANGE_SCALE_TOL, ROUNDING = 1e-3, 1e-5, 4 * 2.0**-24


def same_change(before: torch.Tensor, got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether ``before -> got`` is the change ``before -> expected``, within float rounding."""
    if got.shape != expected.shape or got.dtype != expected.dtype or before.shape != expected.shape:
        return False
    if not (expected.is_floating_point() or expected.is_complex()):
        return torch.equal(got.detach(), expected)
    base, want, have = before.detach().double(), expected.detach().double(), got.detach().double()
    change = want - base
    scale = float(change.abs().max()) if change.numel() else 0.0
    tol = CHANGE_RTOL * change.abs() + CHANGE_SCALE_TOL * scale + ROUNDING * (base.abs() + want.abs())
    return bool(((have - want).abs() <= tol).all()) and bool((have.isnan() == want.isnan()).all())


@dataclass
class _TensorSlot:
    """One tensor a forward can change: a parameter, a buffer or a plain tensor attribute."""

    name: str  # qualified, as the user would spell it: "bn.running_mean"
    table: dict  # owner._parameters, owner._buffers or owner.__dict__
    key: str
    live: torch.Tensor
    saved: torch.Tensor


@dataclass
class _ValueSlot:
    """A plain Python attribute (``self.calls``): its object and, for containers, their items."""

    name: str
    table: dict
    key: str
    live: object
    fingerprint: object  # the identities of a list/dict/set's items, else None
    items: object  # a shallow copy of a list/dict/set, else None


class ModuleState:
    """What a forward can change on a module, snapshotted so trial runs can be undone and compared.

    Covers parameters (optional: at capture they are symbolic and cannot change), buffers, plain
    tensor attributes, plain Python attributes of every submodule, and the RNG. Restoring writes
    through ``.data``, so it neither bumps version counters nor disturbs autograd graphs of earlier
    calls that saved these tensors (as eager's in-kernel BatchNorm update does not either).
    """

    def __init__(self, module: nn.Module, *, parameters: bool = True):
        self._tensors: list[_TensorSlot] = []
        self._values: list[_ValueSlot] = []
        self._keys: list[tuple[str, dict, frozenset]] = []
        with torch.no_grad():
            for prefix, sub in module.named_modules():
                tables = [sub._parameters] if parameters else []
                for table in [*tables, sub._buffers, sub.__dict__]:
                    for key, value in table.items():
                        if table is sub.__dict__ and key in _MODULE_INTERNALS:
                            continue
                        name = f"{prefix}.{key}" if prefix else key
                        if isinstance(value, torch.Tensor):
                            self._tensors.append(_TensorSlot(name, table, key, value, value.detach().clone()))
                        elif table is sub.__dict__:
                            self._values.append(_ValueSlot(name, table, key, value, _fingerprint(value),
                                                                  _shallow_copy(value)))
                self._keys.append((prefix, sub.__dict__, frozenset(sub.__dict__)))
        self._cpu_rng = torch.get_rng_state()
        self._cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def replaced(self) -> list[str]:
        """Attributes the forward rebound or whose Python value changed (a graph cannot replay these)."""
        names = [s.name for s in self._tensors if s.table.get(s.key) is not s.live]
        names += [s.name for s in self._values
                  if not _same_value(s.table.get(s.key, _MISSING), s.live) or _fingerprint(s.live) != s.fingerprint]
        for prefix, table, keys in self._keys:
            names += [f"{prefix}.{k}" if prefix else k for k in sorted(set(table) - keys)]
        return names

    def changed_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors whose values the forward changed in place, as copies of their new values."""
        with torch.no_grad():
            return {s.name: s.live.detach().clone() for s in self._tensors
                    if s.table.get(s.key) is s.live and not _same_tensor(s.live, s.saved)}

    def differences(self, expected: dict[str, torch.Tensor], rtol: float, atol: float) -> list[str]:
        """Tensors whose values now differ from ``expected`` (a ``changed_tensors()``), else from the snapshot."""
        return [s.name for s in self._tensors
                if not _same_tensor(s.live, expected.get(s.name, s.saved), rtol, atol)]

    def step_differences(self, expected: dict[str, torch.Tensor]) -> list[str]:
        """Tensors whose change since the snapshot is not the change ``expected`` (a ``changed_tensors()``) shows.

        Changes are compared, not values: a step that moves a weight by a thousandth of eager's move, or a
        weight eager does not move at all, differs however small the weight's change is next to its value.
        """
        return [s.name for s in self._tensors if not same_change(s.saved, s.live, expected.get(s.name, s.saved))]

    def restore(self) -> None:
        """Put every tensor, attribute and the RNG back as they were at the snapshot."""
        with torch.no_grad():
            for s in self._tensors:
                s.table[s.key] = s.live
                if s.live.shape == s.saved.shape and s.live.dtype == s.saved.dtype:
                    s.live.data.copy_(s.saved)
                else:  # resized in place
                    s.live.data = s.saved.clone()
        for v in self._values:
            v.table[v.key] = v.live
            _refill(v.live, v.items)
        for _prefix, table, keys in self._keys:
            for extra in set(table) - keys:
                del table[extra]
        torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state_all(self._cuda_rng)


_MISSING = object()


def _fingerprint(value: object) -> object:
    if type(value) is list:
        return [id(v) for v in value]
    if type(value) is dict:
        return [(id(k), id(v)) for k, v in value.items()]
    if type(value) is set:
        return {id(v) for v in value}
    return None


def _shallow_copy(value: object) -> object:
    if isinstance(value, (list, dict, set)) and type(value) in (list, dict, set):
        return type(value)(value)
    return None


def _refill(container: Any, items: Any) -> None:
    """Put a list's, dict's or set's items back (``items`` is its :func:`_shallow_copy`)."""
    if items is None:
        return
    if type(container) is list:
        container[:] = items
    else:
        container.clear()
        container.update(items)

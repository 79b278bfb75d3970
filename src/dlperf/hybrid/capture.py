"""Capture a module's forward as a graph, and refuse what a graph cannot express.

Capture runs ``forward`` once with symbolic stand-ins for the inputs (torch.fx), so every
operation on them is recorded instead of executed. What the stand-ins cannot answer is
exactly what a replayed graph would get wrong, and capture stops there with the user's line:

* Python control flow on tensor *values* (``if x.sum() > 0:``, ``for row in x:``): the branch
  taken depends on data the graph does not have yet.
* Values leaving the graph (``x.numpy()``, ``x.item()``, ``x.tolist()``): a replay would not
  re-run the Python that consumes them.

Control flow on Python values (``if self.stride != 1:``, ``for block in self.blocks:``) is fine:
it is decided at capture and unrolled. Side effects such as ``print`` run during capture (they
see the stand-ins, not numbers) and never again on replay.

Leaf layers whose behaviour does not depend on ``module.training`` are lowered to functional
calls on the module's own parameters, which skips ``nn.Module.__call__`` on replay; BatchNorm,
Dropout, LSTM and unknown layers stay module calls and keep reading their mode at run time.

>>> import torch
>>> from torch import nn
>>> cap = capture(nn.Sequential(nn.Linear(4, 3), nn.ReLU()), (torch.randn(2, 4),))
>>> [n.op for n in cap.graph_module.graph.nodes]
['placeholder', 'get_attr', 'get_attr', 'call_function', 'call_function', 'output']
"""

from __future__ import annotations

import contextlib
import linecache
import os
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass

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

    def nodes_of(self, op: str) -> list[fx.Node]:
        return [n for n in self.graph_module.graph.nodes if n.op == op]


def capture(module: nn.Module, example_args: tuple) -> Captured:
    """Trace ``module.forward`` into a lowered fx graph, or raise :class:`CaptureError`.

    ``example_args`` fixes how many positional inputs the graph takes.
    """
    tracer = fx.Tracer()
    tracer.record_stack_traces = True
    try:
        graph = tracer.trace(module)
    except Exception as exc:  # fx raises TraceError, TypeError, AttributeError... all mean "not a graph"
        raise CaptureError(_describe_trace_failure(exc), _user_line(exc.__traceback__)) from exc
    gm = fx.GraphModule(module, graph, class_name=f"Captured{type(module).__name__}")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_args):
        raise CaptureError(f"forward takes {len(placeholders)} inputs but was called with "
                           f"{len(example_args)} positional arguments; pass inputs positionally")
    _reject_escaping_values(gm)
    _lower_leaf_modules(gm)
    return Captured(module, gm, len(example_args))


def _describe_trace_failure(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "control flow" in text or "iterated" in text or "iterable" in text:
        return ("data-dependent Python control flow cannot be captured (the branch depends on tensor "
                f"values the graph does not have yet; use torch.where or keep this module eager): {text}")
    return f"forward cannot be captured as a graph: {type(exc).__name__}: {text}"


def _user_line(tb) -> str | None:
    """The innermost frame outside torch and this package: where the user's code went wrong."""
    frames = traceback.extract_tb(tb)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH_DIR) or path.startswith(_HERE):
            continue
        source = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        return f"{frame.filename}:{frame.lineno}: {source}"
    return None


def _stack_line(node: fx.Node) -> str | None:
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
            if os.path.abspath(fname).startswith(_TORCH_DIR):
                continue
            source = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{fname}:{lineno}: {source}"
    return None


def _reject_escaping_values(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target in ESCAPING_METHODS:
            raise CaptureError(f"tensor.{node.target}() moves a value out of the graph into Python, "
                               "which a replay would not re-run; remove it from forward or keep the "
                               "module eager", _stack_line(node))


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


@contextlib.contextmanager
def preserved_state(module: nn.Module) -> Iterator[None]:
    """Undo side effects of trial runs: buffer updates (BatchNorm statistics) and RNG draws."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for live, saved in buffers:
                live.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

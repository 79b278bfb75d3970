"""Forward, loss and backward of a module traced as one joint ATen graph, on fake tensors.

``make_fx`` runs ``loss_fn(functional_call(module, weights, x), y)`` and ``torch.autograd.grad`` of it with
fake tensors, recording every ATen operation autograd dispatches, backward included: the result is a flat
graph ``(params..., buffers..., input leaves...) -> (loss, grads...)``. A parameter the loss does not reach
(its layer under ``no_grad``, or detached) has no gradient in eager, and the optimizer skips it: the
graph returns no gradient for it either, and :attr:`JointGraph.used` says which parameters have one.
Fake tensors have no values, so tracing changes nothing (no buffer update, no random draw) and a branch on
tensor values cannot be taken silently: it fails, and the step stays eager. In-place updates of buffers
(BatchNorm's running statistics, ``num_batches_tracked``) are operations on the buffers' placeholders, so a
replay on the real buffers updates them as eager does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import batch as batches
from ..engine.external import release_unused_hooks
from .capture import CaptureError, ModuleState, user_source_line
from .optim_update import trainable_parameters

_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


class TrainCaptureError(CaptureError):
    """The training step cannot be captured; the message says why, ``line`` where (when known)."""


@dataclass
class JointGraph:
    """The traced step: ``graph_module(*params, *buffers, *leaves) -> [loss, *grads]``."""

    module: nn.Module
    loss_fn: Callable
    graph_module: fx.GraphModule
    params: list[torch.Tensor]  # trainable parameters, the order of the gradients
    buffers: list[torch.Tensor]  # buffers and frozen parameters, real tensors of the module
    input_spec: object  # pytree spec of (x, y)
    output: torch.Tensor | None  # a fake tensor shaped like the model's output (for planners)
    used: list[int] | None = None  # indices into params of those with a gradient, in the graph's order; None: all

    def leaves(self, x, y) -> list:
        return tree_flatten((x, y))[0]


def capture_joint(module: nn.Module, loss_fn: Callable, x, y) -> JointGraph:
    """Trace one training step of ``module`` on ``(x, y)``; raise :class:`TrainCaptureError` if it is not a graph."""
    hooks = _hooks(module)
    if hooks:
        raise TrainCaptureError(f"hooks are registered ({hooks}), and a replayed graph would not call them")
    named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    trainable = trainable_parameters(module)
    if [p for _, p in named_params] != trainable:
        raise TrainCaptureError("trainable parameters are shared in a way the step cannot name")
    constants: list[tuple[str, torch.Tensor]] = [(n, t) for n, t in module.named_parameters() if not t.requires_grad]
    constants += list(module.named_buffers())
    leaves, spec = tree_flatten((x, y))
    tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    names = [n for n, _ in named_params] + [n for n, _ in constants]
    n_params = len(named_params)
    seen_output: list = []
    used: list[list[int]] = []

    def joint(*flat):
        weights = [w.requires_grad_() for w in flat[:n_params]]  # fakes of leaves: they start without grad
        state = dict(zip(names, [*weights, *flat[n_params:len(names)]]))
        values = list(leaves)
        for i, t in zip(tensor_at, flat[len(names):]):
            values[i] = t
        bx, by = tree_unflatten(values, spec)
        out = functional_call(module, state, _call_args(bx))
        seen_output.append(out)
        loss = loss_fn(out, by)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TrainCaptureError(f"the loss must be a scalar tensor, got {batches.describe(loss)}")
        grads = torch.autograd.grad(loss, weights, allow_unused=True)
        used.append([i for i, g in enumerate(grads) if g is not None])
        return [loss.detach(), *[g for g in grads if g is not None]]

    example = [t.detach() for _, t in named_params] + [t for _, t in constants] + [leaves[i] for i in tensor_at]
    state = ModuleState(module, parameters=False)
    try:
        with torch.enable_grad():
            gm = make_fx(joint, tracing_mode="fake")(*example)
    except TrainCaptureError:
        raise
    except Exception as exc:  # make_fx raises many types; all mean "this step is not one graph"
        raise TrainCaptureError(_describe(exc), user_source_line(exc.__traceback__)) from exc
    finally:
        rebound = state.replaced()
        state.restore()
    if rebound:
        raise TrainCaptureError(f"forward updates module state in Python ({', '.join('self.' + n for n in rebound)}), "
                                "which a replayed graph would skip")
    _reject_input_mutation(gm, n_params, len(names))
    simplify_graph(gm)
    with_grad = used[-1] if used and len(used[-1]) < n_params else None
    return JointGraph(module, loss_fn, gm, [t for _, t in named_params], [t for _, t in constants], spec,
                      seen_output[-1] if seen_output and isinstance(seen_output[-1], torch.Tensor) else None,
                      with_grad)


def _call_args(bx) -> tuple:
    """The positional arguments :func:`dlperf.batch.call_model` passes: a tuple unpacked, anything else as one."""
    if isinstance(bx, tuple) and not hasattr(bx, "_fields"):
        return bx
    return (bx,)


def _describe(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    kind = type(exc).__name__
    if "DataDependent" in kind or "data-dependent" in text or "data dependent" in text:
        return ("data-dependent Python control flow cannot be captured (a branch or a Python value depends on "
                f"tensor values a graph does not have; use torch.where or keep the step eager): {kind}: {text}")
    return f"the step cannot be traced as a graph: {kind}: {text}"


def _hooks(module: nn.Module) -> str:
    from torch.nn.modules import module as base

    found = [f"{name or type(module).__name__}.{table}" for name, sub in module.named_modules()
             for table in _HOOK_TABLES if getattr(sub, table, None)]
    found += [f"{name}.register_hook" for name, p in module.named_parameters()
              if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None)]
    # engine arrays no longer tracked leave the engine's global hooks until a later module call: gone now
    release_unused_hooks()
    if base._global_forward_hooks or base._global_forward_pre_hooks or base._global_backward_hooks:
        found.append("global module hooks")
    return ", ".join(found)


def _reject_input_mutation(gm: fx.GraphModule, n_params: int, n_state: int) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    protected = {node: ("a parameter" if i < n_params else "an input") for i, node in enumerate(placeholders)
                 if i < n_params or i >= n_state}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for arg, value in zip(node.target._schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write and value in protected:
                raise TrainCaptureError(f"forward changes {protected[value]} in place ({node.target}), which a "
                                        "replay would repeat on the caller's tensor; use an out-of-place op",
                                        _node_line(node))


def _node_line(node: fx.Node) -> str | None:
    from .capture import node_source_line

    return node_source_line(node)


def simplify_graph(gm: fx.GraphModule) -> None:
    """Drop what only autograd needed (detach, t of t) and the pytree plumbing of the generated code."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.t.default:
            src = node.args[0]
            if isinstance(src, fx.Node) and src.op == "call_function" and src.target is aten.t.default:
                node.replace_all_uses_with(src.args[0])
                gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.graph._codegen = fx.graph.CodeGen()  # plain positional arguments: no pytree flatten per call
    gm.recompile()

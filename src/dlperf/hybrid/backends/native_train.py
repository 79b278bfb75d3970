"""The native plan as a training step: forward, backward and a fused SGD update in C++.

The forward is the inference plan (:func:`.native.build_code`), so the same layers qualify: linear,
ReLU/sigmoid/tanh, add, mul, flatten, one float32 input tensor. The loss and its gradient with respect
to the model's output come from a small ATen graph traced from the user's loss function (any loss
works; cross-entropy is five calls). The C++ side then runs the backward instructions and, for SGD,
updates each weight row in the same pass that computes its gradient (see
:mod:`.native_train_src`); Adam and AdamW get the gradients in planned buffers and run their
functional update. Momentum buffers are the optimizer's own ``state[p]["momentum_buffer"]``.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ..capture import CaptureError, capture
from ..optim_update import OptimizerUpdate
from ..train_graph import JointGraph
from . import native
from .native_train_src import MODE_GRADS, MODE_SGD
from .registry import BackendUnsupported

_NO_BUFFER = torch.empty(0)


def native_runner(joint: JointGraph, update: OptimizerUpdate, x, y, keep_grads: bool) -> Callable:
    """``step(x, y) -> loss`` on the native plan, or raise :class:`BackendUnsupported` saying why."""
    if not (isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.device.type == "cpu"):
        raise BackendUnsupported("the native plan takes one float32 CPU tensor as input")
    if not isinstance(y, torch.Tensor):
        raise BackendUnsupported("the native step takes one target tensor")
    if joint.used is not None:
        raise BackendUnsupported("the loss does not reach every trainable parameter, and the plan's backward would "
                                 "update them all")
    if update.kind not in ("sgd", "adam"):
        raise BackendUnsupported(f"{type(update.optimizer).__name__} has no fused update")
    if any(not (p.dtype == torch.float32 and p.is_contiguous() and p.device.type == "cpu") for p in joint.params):
        raise BackendUnsupported("the native plan updates contiguous float32 CPU parameters only")
    try:
        with torch.enable_grad():  # a training step's mode: a change inside forward shows against it
            captured = capture(joint.module, (x,))
    except CaptureError as exc:
        raise BackendUnsupported(str(exc)) from None
    native.refuse_grad_mode_changes(captured)
    code, params, num_slots, out_slot = native.build_code(captured.graph_module)
    order = {id(p): i for i, p in enumerate(joint.params)}
    frozen = [name for name, p in joint.module.named_parameters() if not p.requires_grad
              and any(p is q for q in params)]
    if frozen:  # the plan's backward differentiates and updates every weight it reads
        raise BackendUnsupported(f"parameters with requires_grad=False ({', '.join(frozen[:3])}) are read by the "
                                 "plan, whose backward would update them")
    if len(params) != len(joint.params) or {id(p) for p in params} != set(order):
        raise BackendUnsupported("every trainable parameter must be a weight or bias of exactly one linear layer")
    try:
        ext = native.load_extension()
    except RuntimeError as exc:
        raise BackendUnsupported(str(exc)) from None
    if joint.output is None:
        raise BackendUnsupported("the model's output is not one tensor")
    loss_grad = _cross_entropy(ext, joint, joint.output, y) or _trace_loss_grad(joint, joint.output, y)
    return _NativeStep(ext, code, params, num_slots, out_slot, [order[id(p)] for p in params], loss_grad,
                       update, keep_grads)


def _trace_loss_grad(joint: JointGraph, output: torch.Tensor, y: torch.Tensor):
    """``(output, y) -> (loss, d loss / d output)`` as an ATen graph, for the user's own loss."""
    loss_fn = joint.loss_fn

    def loss_and_grad(out, target):
        out = out.requires_grad_()
        loss = loss_fn(out, target)
        (grad,) = torch.autograd.grad(loss, out)
        return loss.detach(), grad

    example = torch.empty(output.shape, dtype=output.dtype)
    with torch.enable_grad():
        gm = make_fx(loss_and_grad, tracing_mode="fake")(example, y)
    from ..train_graph import simplify_graph

    simplify_graph(gm)
    return gm.forward


_CROSS_ENTROPY = {"aten._log_softmax.default", "aten.nll_loss_forward.default", "aten.ones_like.default",
                  "aten.nll_loss_backward.default", "aten._log_softmax_backward_data.default"}


def _cross_entropy(ext, joint: JointGraph, output: torch.Tensor, y: torch.Tensor):
    """The C++ cross-entropy when the loss is exactly mean softmax cross-entropy over 2-d logits, else None."""
    if output.dim() != 2 or output.dtype != torch.float32 or y.dim() != 1 or y.dtype != torch.int64:
        return None
    gm = _trace_loss_grad(joint, output, y).__self__
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    if {str(n.target) for n in calls} != _CROSS_ENTROPY or len(calls) != len(_CROSS_ENTROPY):
        return None
    (log_softmax,) = [n for n in calls if str(n.target) == "aten._log_softmax.default"]
    (nll,) = [n for n in calls if str(n.target) == "aten.nll_loss_forward.default"]
    _, _, weight, reduction, ignore_index = nll.args
    if log_softmax.args[1] not in (1, -1) or weight is not None or reduction != 1:
        return None
    fused = ext.cross_entropy_grad

    def loss_and_grad(out, target):
        return fused(out, target, ignore_index)

    return loss_and_grad


class _NativeStep:
    """One training plan on the C++ side, freed with this object."""

    def __init__(self, ext, code, params, num_slots, out_slot, to_joint: list[int], loss_grad,
                 update: OptimizerUpdate, keep_grads: bool):
        self.plan_id = ext.make_train_plan(code, params, num_slots, out_slot)
        weakref.finalize(self, ext.free_train_plan, self.plan_id)
        self._forward, self._backward = ext.train_forward, ext.train_backward
        self.params, self.to_joint = params, to_joint
        self.loss_grad, self.update, self.keep_grads = loss_grad, update, keep_grads
        self.sgd = update.kind == "sgd"
        optimizer = update.optimizer
        self.groups = [next(g for g in optimizer.param_groups if any(q is p for q in g["params"])) for p in params]
        self.state = optimizer.state
        self.grads = [torch.empty_like(p) for p in params]  # planned once, reused (Adam; keep_grads copies)
        what = "forward, backward and fused SGD update" if self.sgd else "forward and backward, then Adam"
        self.detail = f"C++ training plan of {len(code) // 6} instructions: {what}"

    def _sgd_arguments(self) -> tuple[list[torch.Tensor], list[float]]:
        bufs, hyper = [], []
        for p, g in zip(self.params, self.groups):
            first = 0.0
            if g["momentum"] != 0:
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:  # SGD's first step: the buffer starts as a copy of the gradient
                    buf = state["momentum_buffer"] = torch.empty_like(p)
                    first = 1.0
                bufs.append(buf)
            else:
                bufs.append(_NO_BUFFER)
            hyper += [g["lr"], g["momentum"], g["dampening"], g["weight_decay"], float(g["nesterov"]),
                      float(g["maximize"]), first]
        return bufs, hyper

    def __call__(self, x, y) -> torch.Tensor:
        with torch.no_grad():
            out = self._forward(self.plan_id, x)
            loss, grad_out = self.loss_grad(out, y)
            grads = [torch.empty_like(p) for p in self.params] if self.keep_grads else self.grads
            if self.sgd:
                bufs, hyper = self._sgd_arguments()
                self.update.optimizer._opt_called = True  # type: ignore[attr-defined]  # for LR schedulers
                self._backward(self.plan_id, grad_out, grads if self.keep_grads else [], bufs, hyper, MODE_SGD)
            else:
                self._backward(self.plan_id, grad_out, grads, [], [], MODE_GRADS)
                in_joint_order = [grads[0]] * len(grads)
                for g, j in zip(grads, self.to_joint):
                    in_joint_order[j] = g
                self.update(in_joint_order)
            if self.keep_grads:
                for p, g in zip(self.params, grads):
                    p.grad = g
        return loss


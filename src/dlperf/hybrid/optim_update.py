"""The optimizer update of a captured training step, as functional calls on the optimizer's own state.

``optimizer.step()`` costs ~70 us at batch 1 before any arithmetic (profiling hooks, grouping tensors,
reading ``.grad`` of every parameter). A captured step already has the gradients in hand, so it calls
PyTorch's own functional update (``torch.optim.sgd.sgd``, ``torch.optim.adam.adam``: the very functions
``step()`` calls) with the gradients directly, hyperparameters read from ``param_groups`` on every call (a
learning-rate scheduler's change takes effect on the next step) and state kept in ``optimizer.state``
exactly as ``step()`` keeps it, so checkpoints and a later eager ``step()`` continue seamlessly. On the CPU
it asks for the multi-tensor (``foreach``) form, whose kernels apply the same per-element arithmetic as
the per-tensor loop eager uses, in three to seven calls instead of three to seven per parameter.

Any other optimizer still works through :class:`GenericUpdate`: gradients are put in ``.grad`` and its
``step()`` runs (slower, but exact for every optimizer, its hooks included).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from torch.optim import SGD, Adam, AdamW
from torch.optim.adam import adam as adam_update
from torch.optim.sgd import sgd as sgd_update


class UnsupportedOptimizer(Exception):
    """The optimizer cannot be driven from captured gradients; the message says why."""


class OptimizerUpdate:
    """``update(grads)``: one optimizer step from gradients given in ``self.params`` order."""

    kind = "generic"

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]):
        self.optimizer = optimizer
        self.params = list(params)
        index = {id(p): i for i, p in enumerate(self.params)}
        self.groups: list[tuple[dict, list[int]]] = []
        for group in optimizer.param_groups:
            missing = [p for p in group["params"] if id(p) not in index and p.requires_grad]
            if missing:
                raise UnsupportedOptimizer(f"the optimizer updates {len(missing)} tensor(s) that are not "
                                           "trainable parameters of the module, which the step does not differentiate")
            self.groups.append((group, [index[id(p)] for p in group["params"] if id(p) in index]))

        self.without: list[torch.Tensor] = []  # parameters this update leaves alone (no gradient this step)

    def __call__(self, grads: Sequence[torch.Tensor]) -> None:
        raise NotImplementedError

    def only(self, indices: Sequence[int]) -> OptimizerUpdate:
        """This update for the parameters at ``indices`` alone: the others are left as eager's ``step()`` leaves a
        parameter without a gradient (not changed, no state made for it)."""
        other = copy.copy(self)
        other.params = [self.params[i] for i in indices]
        kept = {id(p): i for i, p in enumerate(other.params)}
        other.without = [p for p in self.params if id(p) not in kept]
        other.groups = [(group, [kept[id(self.params[i])] for i in idx if id(self.params[i]) in kept])
                        for group, idx in self.groups]
        return other


class GenericUpdate(OptimizerUpdate):
    """Any optimizer: gradients into ``.grad``, then its own ``step()``."""

    def __call__(self, grads: Sequence[torch.Tensor]) -> None:
        for p, g in zip(self.params, grads):
            p.grad = g
        for p in self.without:  # as zero_grad(set_to_none=True) left it: step() skips it
            p.grad = None
        self.optimizer.step()


def _foreach(group: dict, params: list[torch.Tensor]) -> bool | None:
    if group.get("foreach") is not None or group.get("fused") or group.get("differentiable"):
        return group.get("foreach")
    # Same elementwise kernels as the per-tensor loop eager picks on the CPU, in one call per op.
    return True if params and all(p.device.type == "cpu" for p in params) else None


def _mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    # What the learning-rate schedulers' wrapper of step() records; without it they warn that
    # scheduler.step() came before optimizer.step().
    optimizer._opt_called = True  # type: ignore[attr-defined]


class SGDUpdate(OptimizerUpdate):
    """``torch.optim.SGD``: momentum, dampening, Nesterov, weight decay, maximize."""

    kind = "sgd"

    def __call__(self, grads: Sequence[torch.Tensor]) -> None:
        _mark_stepped(self.optimizer)
        state = self.optimizer.state
        for group, indices in self.groups:
            params = [self.params[i] for i in indices]
            bufs = [state[p].get("momentum_buffer") for p in params] if group["momentum"] != 0 else []
            sgd_update(params, [grads[i] for i in indices], bufs, weight_decay=group["weight_decay"],
                       momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
                       nesterov=group["nesterov"], maximize=group["maximize"], foreach=_foreach(group, params),
                       fused=group.get("fused"))
            for p, buf in zip(params, bufs):
                state[p]["momentum_buffer"] = buf


class AdamUpdate(OptimizerUpdate):
    """``torch.optim.Adam`` and ``AdamW`` (decoupled weight decay), AMSGrad included."""

    kind = "adam"

    def __call__(self, grads: Sequence[torch.Tensor]) -> None:
        _mark_stepped(self.optimizer)
        state = self.optimizer.state
        for group, indices in self.groups:
            params = [self.params[i] for i in indices]
            for p in params:
                if not state[p]:
                    _init_adam_state(state[p], p, group)
            slots = [state[p] for p in params]
            beta1, beta2 = group["betas"]
            adam_update(params, [grads[i] for i in indices], [s["exp_avg"] for s in slots],
                        [s["exp_avg_sq"] for s in slots],
                        [s["max_exp_avg_sq"] for s in slots] if group["amsgrad"] else [],
                        [s["step"] for s in slots], amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2,
                        lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                        maximize=group["maximize"], foreach=_foreach(group, params),
                        capturable=group["capturable"], differentiable=group["differentiable"],
                        fused=group["fused"], has_complex=False,
                        decoupled_weight_decay=group.get("decoupled_weight_decay", False))


def _init_adam_state(state: dict, p: torch.Tensor, group: dict) -> None:
    """Adam's lazy state, as ``Adam._init_group`` creates it."""
    from torch.optim.optimizer import _get_scalar_dtype

    if group["capturable"] or group["fused"]:
        state["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=p.device)
    else:
        state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def functional_update(optimizer: torch.optim.Optimizer, module: nn.Module) -> OptimizerUpdate:
    """The fastest exact update for ``optimizer`` over ``module``'s trainable parameters."""
    params = trainable_parameters(module)
    if any(p.is_complex() or p.is_sparse for p in params) or _has_step_hooks(optimizer) \
            or _tensor_hyperparameters(optimizer):
        return GenericUpdate(optimizer, params)  # step() runs the hooks, the complex views, tensor betas
    # Exact classes only: a subclass may override step() with different mathematics.
    if type(optimizer) is SGD:
        return SGDUpdate(optimizer, params)
    if type(optimizer) in (Adam, AdamW):
        return AdamUpdate(optimizer, params)
    return GenericUpdate(optimizer, params)


def _tensor_hyperparameters(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a hyperparameter is a tensor (``lr``, ``betas=(tensor, tensor)``): only ``step()`` takes every form."""
    for group in optimizer.param_groups:
        for key, value in group.items():
            values = value if isinstance(value, (tuple, list)) and key != "params" else (value,)
            if key != "params" and any(isinstance(v, torch.Tensor) for v in values):
                return True
    return False


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    from torch.optim import optimizer as base

    return bool(getattr(optimizer, "_optimizer_step_pre_hooks", None) or
                getattr(optimizer, "_optimizer_step_post_hooks", None) or
                base._global_optimizer_pre_hooks or base._global_optimizer_post_hooks)


def trainable_parameters(module: nn.Module) -> list[torch.Tensor]:
    """The parameters a step differentiates, in ``named_parameters`` order (tied weights once)."""
    return [p for p in module.parameters() if p.requires_grad]

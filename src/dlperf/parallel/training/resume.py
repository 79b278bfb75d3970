"""Checking a checkpoint's trainer state against the run that resumes it, field by field.

:func:`~dlperf.parallel.training.checkpoint.load_checkpoint` checks a file's layout; this module checks what the
layout holds against the model and the configuration of the run that continues it: every weight and
buffer (names, shapes, dtypes), the optimizer's hyperparameters (types, finite, in range, and equal
to the run's unless the user takes them from the checkpoint), its per-parameter state (known keys,
shapes, dtypes), the step counter and the history (bounded and consistent with each other). Each
problem is one line naming the field, what was expected and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..._cliargs import short_repr

__all__ = ["trainer_state_problem", "history_problem", "HPARAMS_FLAG", "HPARAM_RANGES", "TAKEN_FROM_CHECKPOINT"]

HPARAMS_FLAG = "--resume-hparams-from-checkpoint"
"""The option that takes the optimizer's hyperparameters from the checkpoint instead of the run's."""
TAKEN_FROM_CHECKPOINT = ("lr", "momentum", "weight_decay")
"""The hyperparameters :data:`HPARAMS_FLAG` takes over; any other (``maximize``, ``nesterov``, ``dampening``) must
still equal the run's: a crafted flag would change what training computes without a word."""

# Inclusive lower and upper bounds, and whether the lower one is excluded: the range in which SGD
# trains the zoo's models at all (beyond 100 the learning rate only diverges to NaN).
HPARAM_RANGES: dict[str, tuple[float, float, bool]] = {
    "lr": (0.0, 100.0, True), "initial_lr": (0.0, 100.0, True),
    "momentum": (0.0, 0.999, False), "dampening": (0.0, 1.0, False),
    "weight_decay": (0.0, 1.0, False),
}
# How the optimizer is implemented, not what it computes: always the run's own.
_IMPLEMENTATION = ("foreach", "differentiable", "fused")
# The per-parameter state each optimizer keeps, by class name.
_STATE_KEYS: dict[str, tuple[str, ...]] = {
    "SGD": ("momentum_buffer",), "Adam": ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "AdamW": ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
}


def _show(value: object) -> str:
    if isinstance(value, torch.Tensor):
        kind = "" if value.layout == torch.strided and not value.is_meta else \
            f"{'meta' if value.is_meta else str(value.layout).removeprefix('torch.')} "
        return f"a {kind}{value.dtype} tensor of shape {tuple(value.shape)}"
    return short_repr(value, 40)


def _not_dense(value: torch.Tensor) -> bool:
    """A sparse, quantized or meta tensor: it has the shape and dtype of a weight but none of its arithmetic."""
    return value.layout != torch.strided or value.is_meta or value.is_quantized


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def tensors_problem(where: str, got: object, expected: Mapping[str, torch.Tensor]) -> str | None:
    """The first name, shape or dtype in ``got`` that differs from ``expected`` (a dict of tensors), or None."""
    if not isinstance(got, dict):
        return f"{where} is {_show(got)}, expected a dict of tensors"
    extra = sorted(map(str, set(got) - set(expected)))
    if extra:
        return f"{where} has unexpected entries {extra[:5]}; this model has no such {'weights or buffers'}"
    for name, ref in expected.items():
        if name not in got:
            return f"{where} has no {name!r}, which this model has"
        t = got[name]
        if not isinstance(t, torch.Tensor) or _not_dense(t):
            return f"{where}[{name!r}] is {_show(t)}, expected a dense tensor"
        if t.dtype != ref.dtype:
            return f"{where}[{name!r}] is {t.dtype}, expected {ref.dtype}"
        if tuple(t.shape) != tuple(ref.shape):
            return f"{where}[{name!r}] has shape {tuple(t.shape)}, expected {tuple(ref.shape)}"
    return None


def _hparam_problem(where: str, key: str, got: object, ref: object, from_checkpoint: bool) -> str | None:
    if isinstance(ref, bool) or (ref is None and key in _IMPLEMENTATION):
        if not isinstance(got, bool) and got is not None:
            return f"{where}[{key!r}] is {_show(got)}, expected a bool"
    elif _is_number(ref):
        if not _is_number(got):
            return f"{where}[{key!r}] is {_show(got)}, expected a number"
        if not math.isfinite(float(got)):  # type: ignore[arg-type]  # (a number: checked above)
            return f"{where}[{key!r}] is {got}, expected a finite number"
        if key in HPARAM_RANGES:
            low, high, open_low = HPARAM_RANGES[key]
            value = float(got)  # type: ignore[arg-type]
            if value > high or value < low or (open_low and value == low):
                bound = f"{'>' if open_low else '>='} {low:g} and <= {high:g}"
                return f"{where}[{key!r}] is {got}, expected {bound}"
    if got != ref and (not from_checkpoint or key not in TAKEN_FROM_CHECKPOINT):
        if key not in TAKEN_FROM_CHECKPOINT and key not in _IMPLEMENTATION:
            fix = f" ({HPARAMS_FLAG} takes over {', '.join(TAKEN_FROM_CHECKPOINT)} only)" if from_checkpoint else ""
        else:
            fix = "" if key in _IMPLEMENTATION else f", or add {HPARAMS_FLAG} to train with the checkpoint's"
        return f"{where}[{key!r}] is {_show(got)} but this run's is {_show(ref)}; resume with the settings that " \
               f"wrote the checkpoint{fix}"
    return None


def _groups_problem(where: str, groups: object, ref_groups: list[dict[str, Any]],
                    from_checkpoint: bool) -> str | None:
    if not isinstance(groups, list) or len(groups) != len(ref_groups):
        return f"{where}['param_groups'] is {_show(groups)}, expected {len(ref_groups)} group(s)"
    for g, (group, ref_group) in enumerate(zip(groups, ref_groups)):
        here = f"{where}['param_groups'][{g}]"
        if not isinstance(group, dict) or set(group) != set(ref_group):
            keys = sorted(map(str, group)) if isinstance(group, dict) else _show(group)
            return f"{here} has keys {keys}, expected {sorted(ref_group)}"
        if group["params"] != ref_group["params"]:
            return f"{here}['params'] is {_show(group['params'])}, expected {_show(ref_group['params'])}"
        scheduled = "initial_lr" in ref_group  # a schedule moves "lr"; the run's own rate is its "initial_lr"
        for key, ref_value in ref_group.items():
            if key == "params" or (scheduled and key == "lr"):
                continue
            problem = _hparam_problem(here, key, group[key], ref_value, from_checkpoint)
            if problem:
                return problem
        if scheduled and not (_is_number(group["lr"]) and 0 <= float(group["lr"]) <= HPARAM_RANGES["lr"][1]):
            return f"{here}['lr'] is {_show(group['lr'])}, expected a rate from 0 to {HPARAM_RANGES['lr'][1]:g}"
        if group.get("nesterov") and (group.get("momentum", 0) <= 0 or group.get("dampening", 0) != 0):
            return f"{here}['nesterov'] is True with momentum {group.get('momentum')} and dampening " \
                   f"{group.get('dampening')}; Nesterov momentum needs momentum > 0 and dampening 0"
    return None


def _entry_problem(here: str, key: str, value: object, param: torch.Tensor | None, index: int) -> str | None:
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or _not_dense(value):
        return f"{here}[{key!r}] is {_show(value)}, expected a dense tensor"
    if key == "step":
        if value.numel() != 1 or not bool(torch.isfinite(value).all()) or float(value) < 0:
            return f"{here}['step'] is {_show(value)}, expected one finite count >= 0"
        return None
    if param is not None and (value.dtype != param.dtype or tuple(value.shape) != tuple(param.shape)):
        return f"{here}[{key!r}] is {_show(value)}, expected a {param.dtype} tensor of shape " \
               f"{tuple(param.shape)} (parameter {index}'s)"
    return None


def optimizer_problem(where: str, got: object, reference: torch.optim.Optimizer, params: Sequence[torch.Tensor] | None,
                      from_checkpoint: bool) -> str | None:
    """The first problem of optimizer state ``got`` against a fresh ``reference`` over the same parameters.

    ``params`` gives the shapes and dtypes of the per-parameter state (None: not checked, e.g. a slice).
    """
    ref = reference.state_dict()
    if not isinstance(got, dict) or set(got) != {"state", "param_groups"}:
        return f"{where} is {_show(got)}, expected an optimizer state with 'state' and 'param_groups'"
    problem = _groups_problem(where, got["param_groups"], ref["param_groups"], from_checkpoint)
    if problem:
        return problem
    state = got["state"]
    if not isinstance(state, dict):
        return f"{where}['state'] is {_show(state)}, expected a dict"
    count = sum(len(g["params"]) for g in ref["param_groups"])
    allowed = _STATE_KEYS.get(type(reference).__name__)
    momentum = got["param_groups"][0].get("momentum", 0) if got["param_groups"] else 0
    for index, entry in state.items():
        here = f"{where}['state'][{index!r}]"
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            return f"{here}: expected a parameter index from 0 to {count - 1}"
        if not isinstance(entry, dict):
            return f"{here} is {_show(entry)}, expected a dict"
        for key, value in entry.items():
            if allowed is not None and (key not in allowed or (key == "momentum_buffer" and momentum == 0)):
                why = "this run's SGD has momentum 0" if key == "momentum_buffer" else \
                    f"{type(reference).__name__} keeps {list(allowed)}"
                return f"{here} holds {key!r}, which {why}; resume with the settings that wrote the checkpoint"
            problem = _entry_problem(here, key, value, None if params is None else params[index], index)
            if problem:
                return problem
    return None


def trainer_state_problem(state: Mapping[str, Any], *, model: torch.nn.Module, devices: int,
                          make_reference: Any, on_store: bool, from_checkpoint: bool) -> str | None:
    """The first problem of a checkpoint's ``trainer`` state for ``model`` on ``devices`` devices, or None.

    ``make_reference(params)`` builds the run's optimizer; ``on_store``: the state is a KVStore's
    (``{"values", "optimizers"}``, update on the store) instead of one optimizer's.
    """
    problem = tensors_problem("trainer['model']", state.get("model"), model.state_dict())
    if problem:
        return problem
    if "plan" in state:  # a planned run kept one replica per planned device: the resumed run follows the plan
        from ...errors import UsageError
        from ..planning.plan import Plan

        try:
            plan = Plan.from_dict(state["plan"], "trainer['plan']")
            devices = 1 if plan.launcher == "processes" else plan.replicas  # processes: one replica each
        except (UsageError, TypeError) as exc:
            return f"{exc}; resume from a checkpoint dlperf wrote"
    buffers = state.get("buffers")
    if not isinstance(buffers, list) or len(buffers) != devices:
        return f"trainer['buffers'] is {_show(buffers)}, expected one dict per device ({devices}); resume on the " \
               "devices that wrote the checkpoint"
    expected_buffers = dict(model.named_buffers())
    for i, bufs in enumerate(buffers):
        problem = tensors_problem(f"trainer['buffers'][{i}]", bufs, expected_buffers)
        if problem:
            return problem
    params = list(model.parameters())
    if not on_store:
        if "optimizer" not in state or "kvstore" in state:
            return "trainer holds store state, not one optimizer's; resume with the --kvstore that wrote it"
        return optimizer_problem("trainer['optimizer']", state["optimizer"], make_reference(params), params,
                                 from_checkpoint)
    store = state.get("kvstore")
    # a distributed store also records in how many parts (slices on servers) it keeps each key
    if not isinstance(store, dict) or "optimizer" in state or set(store) - {"parts"} != {"values", "optimizers"}:
        return "trainer holds no store state ('kvstore' with 'values' and 'optimizers'); resume with the " \
               "--kvstore that wrote it"
    return _store_problem(store, params, make_reference, from_checkpoint)


def _store_problem(store: dict[str, Any], params: list[torch.nn.Parameter], make_reference: Any,
                   from_checkpoint: bool) -> str | None:
    values = store["values"]
    problem = tensors_problem("trainer['kvstore']['values']", {str(k): v for k, v in values.items()}
                              if isinstance(values, dict) else values,
                              {str(i): p.detach() for i, p in enumerate(params)})
    if problem:
        return problem
    parts = store.get("parts", {})
    if not isinstance(parts, dict) or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 2**20
                                          or k not in values for k, n in parts.items()):
        return f"trainer['kvstore']['parts'] is {_show(parts)}, expected a count >= 1 for each stored key"
    optimizers = store["optimizers"]
    if not isinstance(optimizers, dict):
        return f"trainer['kvstore']['optimizers'] is {_show(optimizers)}, expected a dict"
    for key, kept in optimizers.items():
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < len(params):
            return f"trainer['kvstore']['optimizers'] has key {_show(key)}, expected 0 to {len(params) - 1}"
        # a distributed store keeps one state per slice of a key, a local one a single state
        slices = kept.items() if isinstance(kept, dict) and "param_groups" not in kept else [(None, kept)]
        for part, opt_state in slices:
            where = f"trainer['kvstore']['optimizers'][{key}]" + ("" if part is None else f"[{part!r}]")
            problem = optimizer_problem(where, opt_state, make_reference([params[key]]),
                                        [params[key]] if part is None else None, from_checkpoint)
            if problem:
                return problem
    return None


def history_problem(history: Sequence[Mapping[str, Any]], steps: object, *, epochs: int,
                    batches_per_epoch: int | None) -> str | None:
    """The first problem of a checkpoint's history and step counter, or None.

    The history holds epochs 1, 2, ... in order, no more than the run's ``epochs``; the step counter
    is what those epochs ran: every batch of each, but perhaps the last (too small for the devices).
    """
    if len(history) > epochs:
        return f"history holds {len(history)} epochs but --epochs is {epochs}; give --epochs {len(history) + 1} or " \
               "more to train on, or resume an earlier checkpoint"
    for i, rec in enumerate(history):
        where = f"history[{i}]"
        if rec["epoch"] != i + 1:
            return f"{where}['epoch'] is {_show(rec['epoch'])}, expected {i + 1} (epochs count from 1, in order)"
        seconds = float(rec["seconds"])
        if ("test_acc" in rec) == ("test_loss" in rec):
            both = "both" if "test_acc" in rec else "neither"
            return f"{where} holds {both} 'test_acc' and 'test_loss', expected one"
        if "test_acc" in rec and not 0.0 <= float(rec["test_acc"]) <= 1.0:
            return f"{where}['test_acc'] is {_show(rec['test_acc'])}, expected an accuracy from 0 to 1"
        if not (math.isfinite(seconds) and seconds >= 0):
            return f"{where}['seconds'] is {_show(rec['seconds'])}, expected a finite time >= 0"
        since = rec.get("nonfinite_since_step")
        if since is None and not math.isfinite(float(rec["loss"])):
            return f"{where}['loss'] is {rec['loss']} without 'nonfinite_since_step', expected a finite loss"
        if since is not None and not (isinstance(steps, int) and 1 <= since <= steps):
            return f"{where}['nonfinite_since_step'] is {_show(since)}, expected a step from 1 to {steps}"
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        return f"trainer['steps'] is {_show(steps)}, expected a count >= 0"
    if batches_per_epoch is not None:
        low, high = len(history) * max(batches_per_epoch - 1, 0), len(history) * batches_per_epoch
        if not low <= steps <= high:
            return f"trainer['steps'] is {_show(steps)}, but {len(history)} epochs of {batches_per_epoch} batches " \
                   f"run {low if low == high else f'{low} to {high}'} steps"
    return None

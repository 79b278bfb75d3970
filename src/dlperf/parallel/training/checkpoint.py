"""``dlperf train``'s checkpoints: written atomically, read back as data only, checked field by field.

A checkpoint is ``{"format", "config", "history", "trainer"}``; :func:`load_checkpoint` refuses any file
that is not one with a single :class:`~dlperf.errors.UsageError` naming the first problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..._io import safe_torch_load, save_torch
from ...errors import UsageError

__all__ = ["save_checkpoint", "load_checkpoint", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = 1
"""The layout this dlperf writes and reads; a file with another number is refused."""
_CHECKPOINT_FORMAT = CHECKPOINT_FORMAT


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` so that a crash leaves either the old file or the new one, never half of one."""
    save_torch(path, state)


_CONFIG_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,), "devices": (int,), "batch_size": (int,), "lr": (float, int), "data": (str, type(None)),
    "train_size": (int,), "test_size": (int,), "seed": (int,), "algorithm": (str,), "kvstore": (str, type(None))}
_CONFIG_OPTIONAL: dict[str, tuple[type, ...]] = {"processes": (int,)}
_HISTORY_TYPES: dict[str, tuple[type, ...]] = {
    "epoch": (int,), "loss": (float, int), "test_acc": (float, int), "seconds": (float, int)}
_HISTORY_OPTIONAL: dict[str, tuple[type, ...]] = {"nonfinite_since_step": (int, type(None))}
_TRAINER_TYPES: dict[str, tuple[type, ...]] = {"model": (dict,), "buffers": (list,), "steps": (int,)}
_TRAINER_OPTIONAL: dict[str, tuple[type, ...]] = {"plan": (dict,)}  # written by a trainer that follows a plan


def _check_fields(where: str, d: object, required: dict[str, tuple[type, ...]],
                  optional: dict[str, tuple[type, ...]] | None = None) -> str | None:
    """The first problem with dict ``d`` (missing, unexpected or wrong-typed key), or None."""
    if not isinstance(d, dict):
        return f"{where} is a {type(d).__name__}, not a dict"
    allowed = {**required, **(optional or {})}
    for key, types in allowed.items():
        if key not in d:
            if key in required:
                return f"{where} has no {key!r}"
            continue
        v = d[key]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            return f"{where}[{key!r}] is a {type(v).__name__}, expected {' or '.join(t.__name__ for t in types)}"
    extra = sorted(map(str, set(d) - set(allowed)))
    return f"{where} has unexpected keys {extra}" if extra else None


def _checkpoint_problem(state: object) -> str | None:
    problem = _check_fields("the file", state, {"format": (int,), "config": (dict,), "history": (list,),
                                                "trainer": (dict,)})
    if problem or not isinstance(state, dict):  # (a dict when no problem: narrowed for the type checker)
        return problem
    if state["format"] != _CHECKPOINT_FORMAT:
        return f"format {state['format']} (this dlperf reads format {_CHECKPOINT_FORMAT})"
    problem = _check_fields("config", state["config"], _CONFIG_TYPES, _CONFIG_OPTIONAL)
    for i, rec in enumerate(state["history"]):
        problem = problem or _check_fields(f"history[{i}]", rec, _HISTORY_TYPES, _HISTORY_OPTIONAL)
    trainer = state["trainer"]
    problem = problem or _check_fields("trainer", {k: v for k, v in trainer.items()
                                                   if k not in ("optimizer", "kvstore")}, _TRAINER_TYPES,
                                   _TRAINER_OPTIONAL)
    if problem:
        return problem
    if not any(isinstance(trainer.get(k), dict) for k in ("optimizer", "kvstore")):
        return "trainer has no optimizer state"
    tensors = [trainer["model"], *trainer["buffers"]]
    if not all(isinstance(t, dict) and all(isinstance(v, torch.Tensor) for v in t.values()) for t in tensors):
        return "trainer's model or buffers are not dicts of tensors"
    return None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`; any unreadable file is one :class:`UsageError`.

    Only tensors and plain containers are unpickled (``weights_only``): a checkpoint is data, and a
    file from elsewhere must not be able to run code.
    """
    state = safe_torch_load(path, "--resume checkpoint", "a checkpoint written by dlperf train --checkpoint")
    problem = _checkpoint_problem(state)
    if problem:
        raise UsageError(f"--resume checkpoint {str(path)!r} is not a dlperf train checkpoint: {problem}; "
                         "give a file written by dlperf train --checkpoint")
    return state

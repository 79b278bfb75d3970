"""``dlperf train``'s checkpoints: written atomically, read back as data only, checked field by field.

A checkpoint is ``{"format", "config", "history", "trainer", "checksum"}``; :func:`load_checkpoint` refuses
any file that is not one with a single :class:`~dlperf.errors.UsageError` naming the first problem. The
checksum (SHA-256 of every tensor's bytes, dtype and shape and of every other value, in order) is checked on
load, so a flipped bit in a stored tensor is one line instead of a run resumed from damaged weights. A
checkpoint without one (written before checksums) still loads.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from ..._io import safe_torch_load, save_torch
from ...errors import UsageError

__all__ = ["save_checkpoint", "load_checkpoint", "state_checksum", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = 1
"""The layout this dlperf writes and reads; a file with another number is refused."""
_CHECKPOINT_FORMAT = CHECKPOINT_FORMAT


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` and its checksum so that a crash leaves either the old file or the new one, never half."""
    save_torch(path, {**state, "checksum": state_checksum(state)})


def state_checksum(state: Any) -> str:
    """SHA-256 (hex) of ``state``: every tensor's dtype, shape and bytes, every other value's type and text, and
    the keys, in order (``"checksum"`` itself left out at the top)."""
    digest = hashlib.sha256()
    stack: list[Any] = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            _hash_tensor(digest, item)
        elif isinstance(item, dict):
            keys = [k for k in item if not (item is state and k == "checksum")]
            digest.update(f"dict{len(keys)}".encode())
            for key in reversed(keys):
                stack += [item[key], _Key(key)]
        elif isinstance(item, (list, tuple)):
            digest.update(f"{type(item).__name__}{len(item)}".encode())
            stack.extend(reversed(item))
        else:
            digest.update(f"{type(item).__name__}:{item!r};".encode())
    return digest.hexdigest()


class _Key:
    """A dict key on the walk's stack (hashed as a key, not as a value)."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __repr__(self) -> str:
        return repr(self.key)


def _hash_tensor(digest: Any, t: torch.Tensor) -> None:
    digest.update(f"tensor:{t.dtype}:{list(t.shape)}:{t.layout};".encode())
    if t.layout == torch.sparse_coo:
        parts = [t._indices(), t._values()]
    elif t.layout != torch.strided:  # compressed layouts: their index and value arrays, never a dense copy
        compressed = t.crow_indices() if t.layout in (torch.sparse_csr, torch.sparse_bsr) else t.ccol_indices()
        plain = t.col_indices() if t.layout in (torch.sparse_csr, torch.sparse_bsr) else t.row_indices()
        parts = [compressed, plain, t.values()]
    else:
        parts = [t]
    for part in parts:
        flat = part.detach().cpu().contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")


_CONFIG_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,), "devices": (int,), "batch_size": (int,), "lr": (float, int), "data": (str, type(None)),
    "train_size": (int,), "test_size": (int,), "seed": (int,), "algorithm": (str,), "kvstore": (str, type(None))}
_CONFIG_OPTIONAL: dict[str, tuple[type, ...]] = {
    "processes": (int,), "optimizer": (str,), "lr_schedule": (str,), "accumulate": (int,),
    "clip_grad_norm": (float, int)}
_HISTORY_TYPES: dict[str, tuple[type, ...]] = {"epoch": (int,), "loss": (float, int), "seconds": (float, int)}
_HISTORY_OPTIONAL: dict[str, tuple[type, ...]] = {  # the test metric: accuracy, or a regressor's loss
    "test_acc": (float, int), "test_loss": (float, int), "nonfinite_since_step": (int, type(None))}
_TRAINER_TYPES: dict[str, tuple[type, ...]] = {"model": (dict,), "buffers": (list,), "steps": (int,)}
_TRAINER_OPTIONAL: dict[str, tuple[type, ...]] = {  # a plan: written by a trainer that follows one
    "plan": (dict,), "schedule": (dict,)}


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
                                                "trainer": (dict,)}, {"checksum": (str,)})
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
    if "checksum" in state and state["checksum"] != state_checksum(state):
        return ("its contents do not match the checksum written with them (the file was damaged or changed "
                "after dlperf wrote it)")
    return None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`; any unreadable file is one :class:`UsageError`.

    Only tensors and plain containers are unpickled (``weights_only``): a checkpoint is data, and a
    file from elsewhere must not be able to run code.
    """
    state = safe_torch_load(path, "--resume checkpoint", "a checkpoint written by dlperf train --checkpoint")
    problem = _checkpoint_problem(state)
    if problem:
        raise UsageError(f"resume={str(path)!r} is not a dlperf train checkpoint: {problem}; "
                         "give a file dlperf train wrote as its checkpoint")
    return state

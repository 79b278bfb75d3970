"""Batches as PyTorch users write them: a tensor, a tuple or list, or a dict of tensors, nested.

Every verb that calls a model (the Trainer, DataParallel, profile, hybridize, export, evaluation) goes
through these few functions, so a batch of token ids and a dict of features work wherever one float
tensor does. The conventions are DDP's:

- **Calling.** :func:`call_model` unpacks a *tuple* as positional arguments (``model(*inputs)``), a *mapping*
  as keywords when the forward's parameters name every key (``model(**batch)``, HuggingFace's convention, labels
  included), and passes anything else (a tensor, a list, a mapping it cannot name) as the one argument
  (``model(inputs)``); :func:`how_called` says which.
- **Splitting.** :func:`split_tree` cuts every tensor with a first axis along that axis; 0-d tensors and
  non-tensors (strings, ints, None) go unchanged to every part, as DDP's scatter does.
- **Describing.** :func:`describe` names a structure in one line (``dict{ids: int64[64,32], mask:
  bool[64,32]}``), for errors that say what was given.

>>> import torch
>>> b = {"ids": torch.zeros(4, 3, dtype=torch.int64), "lengths": torch.arange(4), "lang": "en"}
>>> batch_size(b)
4
>>> [describe(p) for p in split_tree(b, [3, 1])]
['dict{ids: int64[3,3], lengths: int64[3], lang: str}', 'dict{ids: int64[1,3], lengths: int64[1], lang: str}']
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .errors import UsageError, blame_user_code

__all__ = ["Batch", "call_model", "call_loss", "model_name", "how_called", "takes_keywords", "tensors_of",
           "map_tensors", "batch_size", "split_tree", "gather_tree", "describe"]

Batch = Any
"""A tensor, or a tuple/list/dict (nested) whose leaves are tensors or plain values."""

_MAX_DESCRIBED = 8


def call_model(model: Callable[..., Any], inputs: Batch) -> Any:
    """``model(*inputs)`` for a tuple, ``model(**inputs)`` for a mapping whose keys the forward names,
    ``model(inputs)`` for anything else.

    What the model raises goes on unchanged, noted with the call and the batch's structure
    (:func:`dlperf.errors.blame_user_code`): the CLI shows it as one line naming both.
    """
    try:
        if type(inputs) is torch.Tensor:  # the common case, once per replica and step
            return model(inputs)
        if isinstance(inputs, tuple) and not hasattr(inputs, "_fields"):
            return model(*inputs)
        if isinstance(inputs, Mapping) and takes_keywords(model, inputs):
            return model(**inputs)
        return model(inputs)
    except Exception as exc:
        blame_user_code(exc, f"the model {model_name(model)}({describe(inputs)})",
                        "fix the model, or give it batches of the structure, shapes and dtypes its forward takes")
        raise


def call_loss(loss_fn: Callable[..., Any], output: Any, targets: Batch, *inputs: Any) -> Any:
    """``loss_fn(output, targets, *inputs)``; what it raises is noted as :func:`call_model` notes the model's errors
    (a :class:`dlperf.losses.StepLoss` takes the inputs too: a batch that carries its labels)."""
    try:
        return loss_fn(output, targets, *inputs)
    except Exception as exc:
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        blame_user_code(exc, f"the loss {name}(output {describe(output)}, targets {describe(targets)})",
                        "give targets the loss takes (class labels from 0 to the output's width - 1 for "
                        "cross-entropy), or a model whose output fits them")
        raise


def model_name(model: Any) -> str:
    """The user's class name of ``model``, seen through dlperf's and torch's wrappers."""
    for attribute in ("_orig_mod", "module", "inner"):
        inner = getattr(model, attribute, None)
        if isinstance(inner, torch.nn.Module) and type(model).__module__.startswith(("dlperf.", "torch.")):
            model = inner
    return type(model).__name__


_KEYWORDS: dict[tuple[Any, frozenset[str]], bool] = {}


def _forward_of(model: Any) -> Any:
    """The function whose parameters say how ``model`` is called (a compiled module's original forward)."""
    while hasattr(model, "_orig_mod"):  # torch.compile's wrapper
        model = model._orig_mod
    return model.forward if isinstance(model, torch.nn.Module) else model


def takes_keywords(model: Any, batch: Mapping[str, Any]) -> bool:
    """Whether ``model``'s forward names every key of ``batch`` as a parameter (then it is called with keywords)."""
    forward = _forward_of(model)
    key = (getattr(forward, "__func__", forward), frozenset(map(str, batch)))
    found = _KEYWORDS.get(key)
    if found is None:
        try:
            params = inspect.signature(forward).parameters.values()
        except (TypeError, ValueError):  # a builtin or C callable: no signature to read
            found = False
        else:
            named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
            found = bool(key[1]) and key[1] <= named
        if len(_KEYWORDS) < 4096:
            _KEYWORDS[key] = found
    return found


def how_called(model: Any, inputs: Batch) -> str:
    """How :func:`call_model` calls ``model`` on ``inputs``, in words for reports and errors."""
    if isinstance(inputs, tuple) and not hasattr(inputs, "_fields"):
        return f"model(*inputs), {len(inputs)} positional arguments"
    if isinstance(inputs, Mapping) and takes_keywords(model, inputs):
        return "model(**batch), keywords " + ", ".join(map(str, inputs))
    if isinstance(inputs, Mapping):
        return "model(batch), the mapping as one argument (its forward does not name every key)"
    return "model(inputs), one argument"


def tensors_of(tree: Batch) -> list[torch.Tensor]:
    """The tensor leaves of ``tree``, in a fixed order (dict keys in insertion order)."""
    leaves, _ = tree_flatten(tree)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Batch) -> Batch:
    """``tree`` with ``fn`` applied to each tensor leaf; other leaves and the structure are kept."""
    return tree_map(lambda leaf: fn(leaf) if isinstance(leaf, torch.Tensor) else leaf, tree)


def batch_size(tree: Batch, what: str = "batch") -> int:
    """The common first-axis length of the tensors in ``tree`` that have a first axis.

    One clear error when there is none, or when two tensors disagree (a split would pair the wrong rows).
    """
    if isinstance(tree, torch.Tensor) and tree.dim() > 0:  # the common case, once per part and step
        return int(tree.shape[0])
    sized = [t for t in tensors_of(tree) if t.dim() > 0]
    if not sized:
        raise UsageError(f"the {what} {describe(tree)} has no tensor with a batch (first) axis; give at least "
                         f"one tensor whose first dimension counts the examples")
    n = sized[0].shape[0]
    for t in sized[1:]:
        if t.shape[0] != n:
            raise UsageError(f"the {what} {describe(tree)} mixes batch sizes {n} and {t.shape[0]} along the "
                             f"first axis; every tensor with a first axis must hold the same examples")
    return int(n)


def split_tree(tree: Batch, sizes: Sequence[int],
               each: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> list[Batch]:
    """``tree`` cut into ``len(sizes)`` parts along the first axis; 0-d tensors and plain values are shared.

    ``each(tensor, i)``, if given, is applied to every tensor of part ``i`` (0-d ones too), in the same
    pass: placing part ``i`` on device ``i`` costs no second walk of the structure.
    """
    leaves, spec = tree_flatten(tree)
    columns: list[list[Any]] = []
    k = len(sizes)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            columns.append([leaf] * k)
            continue
        parts = list(torch.split(leaf, list(sizes))) if leaf.dim() > 0 else [leaf] * k
        columns.append(parts if each is None else [each(p, i) for i, p in enumerate(parts)])
    return [tree_unflatten([col[i] for col in columns], spec) for i in range(len(sizes))]


def gather_tree(parts: Sequence[Batch], move: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                what: str = "output") -> Batch:
    """The inverse of :func:`split_tree`: parts of one structure joined along the first axis.

    Tensors with a first axis are concatenated, 0-d tensors stacked (one value per part, as
    ``nn.DataParallel`` gathers a scalar loss); plain values must be equal in every part and are kept
    once. ``move`` is applied to every tensor first (to bring the parts to one device). Parts of
    different structures are one error naming them.

    >>> parts = split_tree({"y": torch.arange(4), "n": 3}, [3, 1])
    >>> gather_tree(parts)
    {'y': tensor([0, 1, 2, 3]), 'n': 3}
    """
    flat = [tree_flatten(p) for p in parts]
    spec = flat[0][1]
    for part, (_, other) in zip(parts[1:], flat[1:]):
        if other != spec:
            raise UsageError(f"the replicas' {what}s differ in structure ({describe(parts[0])} and "
                             f"{describe(part)}); a forward must return the same structure for every part of a batch")
    joined: list[Any] = []
    for column in zip(*(leaves for leaves, _ in flat)):
        first = column[0]
        if isinstance(first, torch.Tensor):
            tensors = [move(t) for t in column]
            joined.append(torch.cat(tensors) if first.dim() > 0 else torch.stack(tensors))
        elif all(v == first for v in column[1:]):
            joined.append(first)
        else:
            raise UsageError(f"the replicas' {what}s hold different values {first!r} and "
                             f"{next(v for v in column if v != first)!r} where a tensor is not ({describe(parts[0])}); "
                             f"return tensors for values that vary with the batch")
    return tree_unflatten(joined, spec)


def _leaf(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{dtype}[{','.join(map(str, value.shape))}]"
    return type(value).__name__


def describe(tree: Batch, depth: int = 0) -> str:
    """One line naming a batch's structure, dtypes and shapes (not its values)."""
    if depth > 3:
        return "..."
    if isinstance(tree, dict):
        items = [f"{k}: {describe(v, depth + 1)}" for k, v in list(tree.items())[:_MAX_DESCRIBED]]
        more = ", ..." if len(tree) > _MAX_DESCRIBED else ""
        return "dict{" + ", ".join(items) + more + "}"
    if isinstance(tree, (tuple, list)):
        items = [describe(v, depth + 1) for v in tree[:_MAX_DESCRIBED]]
        more = ", ..." if len(tree) > _MAX_DESCRIBED else ""
        return f"{type(tree).__name__}({', '.join(items)}{more})"
    return _leaf(tree)

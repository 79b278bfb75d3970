"""Proof, before anything runs, that a loaded graph writes only into its own results.

Every value in the graph gets the set of inputs and parameters ("roots") whose memory it may share,
from its operator's schema: ``Tensor(a)`` on an argument and a result says the result may be a view
of that argument (``view``, ``expand``, ``contiguous``, ``reshape``: the last two alias only for some
shapes, and the schema says "may"); a result without an annotation is a new tensor. A graph is
refused when one node may write (an argument marked ``Tensor(a!)``: in-place ops, ``out=``) into a
value with any root, or changes a tensor's metadata in place (``transpose_``, ``detach_``,
``requires_grad_``, ...), whoever owns it.

The schema is trusted only where PyTorch enforces it, for operators with kernels. Operators that
are compositions of others (``CompositeImplicitAutograd``) carry no such guarantee (``dropout``,
``type_as`` and ``atleast_1d`` return their input unchanged in some cases, ``batch_norm`` updates
its running statistics in training mode), so their results may alias all their arguments, except
for the few in :data:`_NEW_RESULT_COMPOSITES`, whose results are always new (their test checks it).

The analysis is one pass over the nodes with the roots as bit sets: linear in the graph's size.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

from .export_format import OPERATORS, ExportFormatError

# Compositions whose result is always a tensor they allocate (the written results of real exports:
# ``relu_`` after ``conv2d`` or ``batch_norm``). Checked on sample inputs by the tests.
_NEW_RESULT_COMPOSITES = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "linear",
    "batch_norm", "instance_norm", "layer_norm", "group_norm", "max_pool1d", "max_pool2d", "max_pool3d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "lstm", "gru", "rnn_tanh",
    "rnn_relu",
})

# Writes a schema does not declare: the batch-norm family updates its running statistics in place
# when the named flag is true (or always, for None).
_UNDECLARED_WRITES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "batch_norm": (("running_mean", "running_var"), "training"),
    "native_batch_norm": (("running_mean", "running_var"), "training"),
    "cudnn_batch_norm": (("running_mean", "running_var"), "training"),
    "miopen_batch_norm": (("running_mean", "running_var"), "training"),
    "instance_norm": (("running_mean", "running_var"), "use_input_stats"),
    "batch_norm_update_stats": (("running_mean", "running_var"), None),
    "batch_norm_gather_stats": (("running_mean", "running_var"), None),
    "batch_norm_gather_stats_with_counts": (("running_mean", "running_var"), None),
}

# In-place changes of a tensor's metadata the ``inplace_view`` tag does not mark.
_METADATA_OPS = frozenset({"requires_grad_", "retain_grad", "set_data", "record_stream", "detach_", "set_",
                           "resize_", "resize_as_"})


def check_no_writes(doc: dict, ops: Iterable[Any], where: str) -> None:
    """Raise :class:`ExportFormatError` if a node of ``doc`` may write into an input or a parameter,
    or changes any tensor's metadata in place. ``ops`` are the nodes' resolved operators, in order."""
    roots: dict[str, int] = {}
    names: list[str] = []
    for name in [spec["name"] for spec in doc["inputs"]] + list(doc["state"]):
        roots[name] = 1 << len(names)
        names.append(name)
    for node, op in zip(doc["nodes"], ops):
        what = f"{where}: node {node['name']!r} ({node['op']})"
        if node["op"] in OPERATORS:  # Python operators: getitem of a tensor is a view; be coarse
            roots[node["name"]] = _roots_of(node["inputs"], roots)
            continue
        roots[node["name"]] = _node_roots(op, node, roots, names, what)


def _node_roots(op: Any, node: dict, roots: dict[str, int], names: list[str], what: str) -> int:
    """The roots of a node's result, after refusing its writes into any root."""
    if _changes_metadata(op):
        raise ExportFormatError(f"{what} changes a tensor's metadata in place (shape, strides, storage or "
                                f"requires_grad); a loaded graph may not")
    bound = _bind(op._schema, node)
    _refuse_writes(op, bound, roots, names, what)
    return _result_roots(op, bound, roots)


def _refuse_writes(op: Any, bound: list[tuple[Any, Any]], roots: dict[str, int], names: list[str],
                   what: str) -> None:
    for arg, value in bound:
        info = arg.alias_info
        if info is not None and info.is_write:
            _refuse_write(_roots_of(value, roots), names, what)
    hidden = _UNDECLARED_WRITES.get(op._schema.name.removeprefix("aten::"))
    if hidden is not None:
        written, flag = hidden
        values = {arg.name: value for arg, value in bound}
        if flag is None or values.get(flag, True) is not False:
            for name in written:
                _refuse_write(_roots_of(values.get(name), roots), names, what)


def _result_roots(op: Any, bound: list[tuple[Any, Any]], roots: dict[str, int]) -> int:
    result = 0
    everything = _roots_of([value for _, value in bound], roots)
    for ret in op._schema.returns:
        info = ret.alias_info
        if info is None:
            if not _schema_is_enforced(op):
                result |= everything
            continue
        sets = set(info.before_set) | set(info.after_set)
        if not sets or "*" in sets:  # a list of views (split, unbind): torch does not name their sources
            result |= everything
            continue
        for arg, value in bound:
            arg_info = arg.alias_info
            if arg_info is not None and sets & (set(arg_info.before_set) | set(arg_info.after_set)):
                result |= _roots_of(value, roots)
    return result


def _bind(schema: Any, node: dict) -> list[tuple[Any, Any]]:
    """(schema argument, JSON value) for each argument the node passes; unmatched ones fail the call."""
    arguments = schema.arguments
    bound = [(arguments[i], value) for i, value in enumerate(node["inputs"]) if i < len(arguments)]
    by_name = {arg.name: arg for arg in arguments}
    bound += [(by_name[key], value) for key, value in node["kwargs"].items() if key in by_name]
    return bound


def _refuse_write(written: int, names: list[str], what: str) -> None:
    if written:
        victim = names[(written & -written).bit_length() - 1]
        raise ExportFormatError(f"{what} may write into {victim!r}, an input or parameter (or a view of one); "
                                f"a loaded graph may only write into its own results")


def _roots_of(value: Any, roots: dict[str, int]) -> int:
    """The roots of a JSON argument: of every node it refers to, nested lists included."""
    if isinstance(value, dict):
        found = 0
        for kind, name in value.items():
            if kind == "node" and isinstance(name, str):
                found |= roots.get(name, 0)
        return found
    if isinstance(value, list):
        found = 0
        for v in value:
            found |= _roots_of(v, roots)
        return found
    return 0


@functools.lru_cache(maxsize=4096)
def _changes_metadata(op: Any) -> bool:
    return torch.Tag.inplace_view in op.tags or op._schema.name.removeprefix("aten::") in _METADATA_OPS


@functools.lru_cache(maxsize=4096)
def _schema_is_enforced(op: Any) -> bool:
    """Whether a result the schema does not annotate is surely new: kernels keep that promise."""
    base = op._schema.name.removeprefix("aten::")
    if base in _NEW_RESULT_COMPOSITES:
        return True
    if torch.Tag.maybe_aliasing_or_mutating in op.tags:
        return False
    qualified = op._schema.name + (f".{op._overloadname}" if op._overloadname != "default" else "")
    return not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd")

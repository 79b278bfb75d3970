"""The structure of an export's inputs and outputs: tuples, lists and dicts around the graph's tensors.

``graph.json`` lists the graph's inputs and outputs flat; ``input_tree`` and ``output_tree`` say how
they nest in the model's call and result, so that ``load(path)(batch)`` takes the batch the model took
(``model(ids, mask)``, ``model({"ids": ..., "mask": ...})``) and gives back what it gave (a dict with
its keys, a tuple, nested). A tree in JSON is one of:

* an integer ``i``: the ``i``-th entry of ``inputs`` (or ``outputs``), a leaf;
* ``{"tuple": [tree, ...]}`` or ``{"list": [tree, ...]}``;
* ``{"dict": {"key": tree, ...}}``, keys in the model's order.

Nothing else: a tree is data, read by the fixed walks below and never executed. Its size, depth and
keys are bounded, and its leaves must number the flat entries ``0, 1, 2, ...`` once each in the order
of a depth-first walk, the order PyTorch's pytree flattens the same structure in. The input tree's
root is the tuple of positional arguments. A namedtuple is stored as a tuple (its class is Python
code an export does not carry), an ``OrderedDict`` as a dict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import torch
from torch.utils import _pytree
from torch.utils._pytree import tree_flatten

from ..batch import describe
from ..errors import DlperfError
from .export_format import is_json_int, json_type_name

__all__ = ["MAX_KEY_CHARS", "MAX_TREE_DEPTH", "MAX_TREE_NODES", "Tree", "build", "check_inputs_are_tensors",
           "check_tree", "flat_tree", "flatten_call", "tree_of_spec", "tree_text"]

MAX_TREE_DEPTH = 8
MAX_TREE_NODES = 4096
MAX_KEY_CHARS = 128
_KINDS = ("tuple", "list", "dict")
_TEXT_CHARS = 400
# pytree names namedtuple and structseq nodes by markers, not by the tuple classes themselves
_TUPLE_MARKERS = tuple(m for m in (getattr(_pytree, "namedtuple", None), getattr(_pytree, "structseq", None)) if m)

Tree = Any
"""An int (a leaf), or a one-key dict of kind tuple, list or dict (see the module docstring)."""


def tree_of_spec(spec: Any, what: str) -> Tree:
    """The JSON tree of a ``torch.utils._pytree.TreeSpec`` (from ``torch.export``), leaves numbered in order.

    Raises DlperfError naming the structure for a container that is not a tuple, list or dict with
    string keys (a dataclass, a custom pytree node, an int key).
    """
    counter = [0]

    def walk(s: Any, depth: int) -> Tree:
        if s.is_leaf():
            counter[0] += 1
            return counter[0] - 1
        if depth >= MAX_TREE_DEPTH:
            raise DlperfError(f"cannot export: the {what} nest deeper than {MAX_TREE_DEPTH} levels")
        children = [walk(c, depth + 1) for c in s.children()]
        kind = s.type
        if kind is list:
            return {"list": children}
        # namedtuples and torch's structseqs (torch.return_types) too: see the module docstring
        if kind in _TUPLE_MARKERS or isinstance(kind, type) and issubclass(kind, tuple):
            return {"tuple": children}
        if isinstance(kind, type) and issubclass(kind, dict):
            keys = list(s.context)
            bad = next((k for k in keys if not _valid_key(k)), None)
            if bad is not None:
                raise DlperfError(f"cannot export: the {what} hold a dict key {bad!r}; an export keeps string keys "
                                  f"of at most {MAX_KEY_CHARS} printable characters")
            return {"dict": dict(zip(keys, children))}
        name = getattr(kind, "__name__", str(kind))
        raise DlperfError(f"cannot export: the {what} hold a {name}; an export keeps tensors in tuples, lists and "
                          f"dicts with string keys: return or take those instead")

    return walk(spec, 0)


def _valid_key(key: object) -> bool:
    return isinstance(key, str) and len(key) <= MAX_KEY_CHARS and key.isprintable()


def check_tree(tree: object, field: str, leaves: int, fail: Callable[[str, str], NoReturn],
               root: str | None = None) -> None:
    """Validate a tree from graph.json: allowed kinds only, bounded, leaves ``0..leaves-1`` in order.

    ``fail(field, problem)`` raises. ``root``: the kind the tree's root must have (``"tuple"`` for inputs).
    """
    if root is not None and not (isinstance(tree, dict) and set(tree) == {root}):
        fail(field, f"is {json_type_name(tree)}, expected an object with {root!r} at its root")
    check = _TreeCheck(fail)
    check.node(tree, field, 0)
    if check.next_leaf != leaves:
        fail(field, f"has {check.next_leaf} leaves for {leaves} entries; each entry must be a leaf once")


class _TreeCheck:
    """One depth-first walk of a tree from a file, bounded before it goes deeper or wider."""

    def __init__(self, fail: Callable[[str, str], NoReturn]) -> None:
        self.fail = fail
        self.nodes = 0
        self.next_leaf = 0

    def node(self, node: object, where: str, depth: int) -> None:
        self.nodes += 1
        if self.nodes > MAX_TREE_NODES:
            self.fail(where, f"the structure has more than {MAX_TREE_NODES} nodes")
        if is_json_int(node):
            if node != self.next_leaf:
                self.fail(where, f"leaf {node} out of order: expected {self.next_leaf} (leaves number the entries "
                                 f"once each, depth first)")
            self.next_leaf += 1
            return
        if not isinstance(node, dict) or len(node) != 1:
            self.fail(where, f"is {json_type_name(node)}, expected a leaf number or an object with one of "
                             f"{', '.join(_KINDS)}")
        (kind, body), = node.items()
        if kind not in _KINDS:
            self.fail(where, f"{kind!r} is not a structure kind ({', '.join(_KINDS)})")
        if depth >= MAX_TREE_DEPTH:
            self.fail(where, f"nests deeper than {MAX_TREE_DEPTH} levels")
        if kind == "dict":
            self.dict_body(body, f"{where}.dict", depth)
            return
        if not isinstance(body, list):
            self.fail(f"{where}.{kind}", f"is {json_type_name(body)}, expected an array")
        for j, child in enumerate(body):
            self.node(child, f"{where}.{kind}[{j}]", depth + 1)

    def dict_body(self, body: object, where: str, depth: int) -> None:
        if not isinstance(body, dict):
            self.fail(where, f"is {json_type_name(body)}, expected an object")
        for key, child in body.items():
            if not _valid_key(key):
                self.fail(where, f"key {str(key)[:40]!r} is not a string of at most {MAX_KEY_CHARS} printable "
                                 f"characters")
            self.node(child, f"{where}[{key!r}]", depth + 1)


def flatten_call(tree: Tree, args: tuple, describe_leaf: Callable[[int], str]) -> list:
    """The tensors of a call's ``args`` in the order of ``tree`` (validated), or one error naming both."""
    flat: list = []

    def walk(node: Tree, value: Any) -> bool:
        if isinstance(node, int):
            flat.append(value)
            return True
        (kind, body), = node.items()
        if kind == "dict":
            if not isinstance(value, Mapping) or set(value) != set(body):
                return False
            return all(walk(child, value[key]) for key, child in body.items())
        if not isinstance(value, (tuple, list)) or len(value) != len(body):
            return False
        return all(walk(child, v) for child, v in zip(body, value))

    if not walk(tree, args):
        raise DlperfError(f"the exported model takes {tree_text(tree, describe_leaf)}, got {describe(args)}; "
                          f"call it with the structure it was exported with")
    return flat


def build(tree: Tree, leaves: list) -> Any:
    """The structure ``tree`` describes with ``leaves`` at its leaves (a validated tree)."""
    if isinstance(tree, int):
        return leaves[tree]
    (kind, body), = tree.items()
    if kind == "dict":
        return {key: build(child, leaves) for key, child in body.items()}
    children = [build(child, leaves) for child in body]
    return tuple(children) if kind == "tuple" else children


def tree_text(tree: Tree, describe_leaf: Callable[[int], str]) -> str:
    """One bounded line for a tree, leaves described by ``describe_leaf`` (``(dict{ids: int64[N,32]})``)."""

    def walk(node: Tree) -> str:
        if isinstance(node, int):
            return describe_leaf(node)
        (kind, body), = node.items()
        if kind == "dict":
            return "dict{" + ", ".join(f"{k}: {walk(v)}" for k, v in body.items()) + "}"
        return f"{kind}(" + ", ".join(walk(v) for v in body) + ")"

    text = walk(tree)
    return text if len(text) <= _TEXT_CHARS else text[:_TEXT_CHARS - 3] + "..."


def flat_tree(leaves: int, root: str = "tuple") -> Tree:
    """The tree of ``leaves`` entries side by side (a format-1 export's inputs)."""
    return {root: list(range(leaves))}


def check_inputs_are_tensors(args: tuple) -> None:
    """Refuse example inputs with a leaf that is not a tensor, naming the structure."""
    leaves, _ = tree_flatten(args, is_leaf=lambda v: v is None)  # pytree drops a None, export would fail on it
    others = [leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)]
    if others or not leaves:
        what = f"a {type(others[0]).__name__} ({others[0]!r:.40})" if others else "no tensor"
        raise DlperfError(f"cannot export with example inputs {describe(args)}: they hold {what}; an export takes "
                          f"tensors (of any dtype) in tuples, lists and dicts: pass non-tensor settings to the "
                          f"model's constructor instead")


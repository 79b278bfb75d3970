"""The export format's vocabulary: file names, limits, the tables of torch values a graph may name,
how node arguments are encoded in JSON and decoded back, operator names and their resolution,
and the checksums. Shared by the writer (:mod:`.export`) and the reader (:mod:`.export_load`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import operator
import re
from typing import Any

import torch
from torch import fx

from ..errors import DlperfError

FORMAT_NAME = "dlperf-graph"
FORMAT_VERSION = 2
# Version 1 had no input_tree/output_tree: its inputs are positional, its outputs one tensor or a tuple.
READABLE_VERSIONS = (1, 2)
GRAPH_FILE = "graph.json"
PARAMS_FILE = "params.safetensors"
PT2_FILE = "model.pt2"
EXPORT_FILES = (GRAPH_FILE, PARAMS_FILE, PT2_FILE)
# Names the temporary sibling directories of an export being written: ``.NAME.export-PID-XXXX``.
STAGING_TAG = "export"

# Python-level operators torch.export leaves between ATen calls (tuple outputs, symbolic sizes).
OPERATORS = {f"operator.{name}": getattr(operator, name)
              for name in ("getitem", "add", "sub", "mul", "floordiv", "mod", "neg", "truediv")}

# Limits on what a graph may ask for; far above any real model, far below what would exhaust a machine.
MAX_GRAPH_BYTES = 64 << 20
MAX_NODES = 5_000  # the trial runs at load cost up to a millisecond per node: a few seconds at most
MAX_RANK = 16
MAX_ELEMENTS = 1 << 32  # per tensor
MAX_FILE_BYTES = 1 << 40
MAX_LIST_DEPTH = 6  # nesting of lists in one argument
MAX_LIST_LENGTH = 4096
MAX_STRING_LENGTH = 256
INT64_LIMIT = 1 << 63
# A dimension recorded as dynamic (``null``) takes this size in the trial runs at load, whose
# results together may take at most MAX_TRIAL_BYTES.
TRIAL_DIM = 2
MAX_TRIAL_BYTES = 1 << 31


class ExportFormatError(DlperfError, ValueError):
    """An export directory is missing, truncated, tampered with, malformed, or of an unknown version."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
_OP_NAME = re.compile(r"aten\.([a-z][a-z0-9_]{0,99})\.([A-Za-z][A-Za-z0-9_]{0,99})")
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
DEVICE_PATTERN = re.compile(r"(cpu|cuda|meta|mps|xpu)(:[0-9]{1,3})?")
# Dispatcher operators whose effects reach past the graph's tensors: reading files, sparse
# constructors whose invariant checks an argument can switch off (unchecked indices read out of
# bounds), and set_ (a tensor that takes over a parameter's storage, writing it unseen).
_DENIED_OPS = re.compile(r"from_file|get_gradients|set_.*|.*sparse.*|.*unsafe.*")

DTYPES_BY_NAME = {dtype_name(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_LAYOUTS = {"strided": torch.strided}  # other layouts (sparse) are refused, see _DENIED_OPS
_MEMORY_FORMATS = {str(v).removeprefix("torch."): v for v in vars(torch).values()
                   if isinstance(v, torch.memory_format)}
_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
STATE_KINDS = ("parameter", "buffer", "constant_tensor")
TOP_FIELDS_V1 = ("format", "format_version", "torch_version", "inputs", "outputs", "state", "nodes", "files",
                  "content_sha256")
TOP_FIELDS = (*TOP_FIELDS_V1[:5], "input_tree", "output_tree", *TOP_FIELDS_V1[5:])
NODE_FIELDS = {"name", "op", "inputs", "kwargs"}
PYTHON_ARITY = {"operator.neg": 1}


def layout_of(doc: dict) -> str:
    """JSON with one node, input or tensor per line: readable with ``head``, diffable with ``diff``."""
    lines = []
    for key, value in doc.items():
        if isinstance(value, list) and value:
            body = ",\n".join(f"  {json.dumps(v)}" for v in value)
            lines.append(f" {json.dumps(key)}: [\n{body}\n ]")
        elif isinstance(value, dict) and value:
            body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            lines.append(f" {json.dumps(key)}: {{\n{body}\n }}")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._opname}.{target._overloadname}" if target.namespace == "aten" else \
            f"{target.namespace}.{target._opname}.{target._overloadname}"
    for name, fn in OPERATORS.items():
        if target is fn:
            return name
    raise DlperfError(f"cannot export operator {target!r}: only ATen operators are portable")


def encode_value(value):
    """A JSON value for one node argument."""
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        return [encode_value(v) for v in value]
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).replace("torch.", "")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).replace("torch.", "")}
    raise DlperfError(f"cannot export argument {value!r} of type {type(value).__name__}")


def resolve_op(name: object) -> Any:
    """An ATen operator (or one of a few Python operators) by its exported name, nothing else.

    The name is matched against a grammar and the dispatcher's schema registry before torch.ops is
    consulted, so no attribute path is ever followed and only real ATen operators are created.
    """
    if not isinstance(name, str) or (_OP_NAME.fullmatch(name) is None and name not in OPERATORS) or "__" in name:
        raise ExportFormatError(f"operator {name!r} is not an ATen operator: expected aten.<op>.<overload> "
                                f"of plain identifiers, or one of {', '.join(OPERATORS)}")
    return _resolve_valid_name(name)


# A graph names a few distinct operators many times: the dispatcher is asked once per name.
@functools.lru_cache(maxsize=4096)
def _resolve_valid_name(name: str) -> Any:
    if name in OPERATORS:
        return OPERATORS[name]
    m = _OP_NAME.fullmatch(name)
    assert m is not None  # checked by resolve_op
    op, overload = m.groups()
    if _DENIED_OPS.fullmatch(op):
        raise ExportFormatError(f"operator {name!r} reaches beyond tensors (files or unchecked memory); "
                                f"a loaded graph may not use it")
    missing = ExportFormatError(f"operator {name!r} does not exist in this PyTorch ({torch.__version__})")
    try:
        torch._C._dispatch_find_schema_or_throw(f"aten::{op}", "" if overload == "default" else overload)
    except RuntimeError:
        raise missing from None
    try:
        packet = getattr(torch.ops.aten, op)
        resolved = getattr(packet, overload) if isinstance(packet, torch._ops.OpOverloadPacket) else None
    except (AttributeError, RuntimeError):
        raise missing from None
    if not isinstance(resolved, torch._ops.OpOverload) or resolved.namespace != "aten" \
            or resolved._schema.name != f"aten::{op}" or resolved._overloadname != overload:
        raise missing
    return resolved


def decode_value(value, env: dict):
    """A node argument from its (validated) JSON form."""
    if isinstance(value, list):
        return [decode_value(v, env) for v in value]
    if isinstance(value, dict):
        (kind, name), = value.items()
        if kind == "node":
            return env[name]
        if kind == "device":
            return env["@device"]
        return DECODERS[kind][name]
    return value


DECODERS: dict[str, dict[str, Any]] = {"dtype": DTYPES_BY_NAME, "layout": _LAYOUTS, "memory_format": _MEMORY_FORMATS,
                                        "float": _FLOATS}


def is_json_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def json_type_name(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
             int: "an integer", float: "a number"}
    return names.get(type(value), type(value).__name__)


def content_hash(doc: dict) -> str:
    body = {k: v for k, v in doc.items() if k != "content_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def describe_value(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{dtype_name(value.dtype)}{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


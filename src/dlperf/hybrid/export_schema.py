"""The one validator of graph.json's structure (:class:`GraphSchema`), run before anything executes."""

from __future__ import annotations

import re
from collections.abc import Set as AbstractSet
from typing import NoReturn

from .export_format import (
    DECODERS,
    DEVICE_PATTERN,
    DTYPES_BY_NAME,
    FORMAT_VERSION,
    INT64_LIMIT,
    MAX_ELEMENTS,
    MAX_FILE_BYTES,
    MAX_LIST_DEPTH,
    MAX_LIST_LENGTH,
    MAX_NODES,
    MAX_RANK,
    MAX_STRING_LENGTH,
    NAME_PATTERN,
    NODE_FIELDS,
    OPERATORS,
    PARAMS_FILE,
    PT2_FILE,
    PYTHON_ARITY,
    SHA256_PATTERN,
    STATE_KINDS,
    TOP_FIELDS,
    TOP_FIELDS_V1,
    ExportFormatError,
    is_json_int,
    json_type_name,
    resolve_op,
)
from .export_tree import check_tree

# dtypes of which no plain tensor exists to feed a graph (torch.zeros fails or needs a quantizer).
_NOT_PLAIN_DTYPE = re.compile(r"q.*|bits.*|u?int[1-7]")


class GraphSchema:
    """The one validator of graph.json's structure; raises ExportFormatError naming the field."""

    def __init__(self, where: str):
        self.where = where
        self.defined: set[str] = set()

    def fail(self, field: str, problem: str) -> NoReturn:
        raise ExportFormatError(f"{self.where}: {field}: {problem}")

    def check(self, doc) -> None:
        if not isinstance(doc, dict):
            self.fail("document", f"is {json_type_name(doc)}, expected an object")
        version = doc.get("format_version")
        fields = TOP_FIELDS_V1 if version == 1 and not isinstance(version, bool) else TOP_FIELDS
        for key in fields:
            if key not in doc:
                raise ExportFormatError(f"{self.where}: missing field {key!r}")
        unknown = sorted(set(doc) - set(fields))
        if unknown:
            shown = 1 if fields is TOP_FIELDS_V1 else FORMAT_VERSION
            self.fail(f"field {unknown[0]!r}", f"unknown in format_version {shown}")
        self.string("torch_version", doc["torch_version"])
        self.inputs(doc["inputs"])
        self.state(doc["state"])
        self.nodes(doc["nodes"])
        self.sequence("outputs", doc["outputs"], 1, 1024)
        for i, out in enumerate(doc["outputs"]):
            self.arg(f"outputs[{i}]", out, 0)
        if "input_tree" in fields:
            check_tree(doc["input_tree"], "input_tree", len(doc["inputs"]), self.fail, root="tuple")
            check_tree(doc["output_tree"], "output_tree", len(doc["outputs"]), self.fail)
        self.files(doc["files"])

    def string(self, field: str, value, limit: int = MAX_STRING_LENGTH) -> str:
        if not isinstance(value, str) or len(value) > limit:
            self.fail(field, f"is {json_type_name(value)}, expected a string of at most {limit} characters")
        return value

    def sequence(self, field: str, value, least: int, most: int) -> None:
        if not isinstance(value, list) or not least <= len(value) <= most:
            shown = f"an array of {len(value)}" if isinstance(value, list) else json_type_name(value)
            self.fail(field, f"is {shown}, expected an array of {least} to {most} entries")

    def record(self, field: str, value, keys: AbstractSet[str], optional: AbstractSet[str] = frozenset()) -> None:
        if not isinstance(value, dict):
            self.fail(field, f"is {json_type_name(value)}, expected an object with {', '.join(sorted(keys))}")
        missing, unknown = keys - set(value), set(value) - keys - optional
        if missing or unknown:
            self.fail(field, f"{'lacks' if missing else 'has unknown'} field {sorted(missing or unknown)[0]!r}")

    def name(self, field: str, value) -> None:
        if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
            self.fail(field, f"{value!r} is not a name (letters, digits, underscores)")
        if value in self.defined:
            self.fail(field, f"{value!r} is defined twice")

    def shape(self, field: str, value) -> None:
        self.sequence(field, value, 0, MAX_RANK)
        static = 1
        for d in value:
            if d is not None and not (is_json_int(d) and 0 <= d <= MAX_ELEMENTS):
                self.fail(field, f"dimension {d!r} is not an integer in [0, {MAX_ELEMENTS}] or null")
            static *= 1 if d is None else d
        if static > MAX_ELEMENTS:
            self.fail(field, f"{value} has {static} elements, more than {MAX_ELEMENTS}")

    def dtype(self, field: str, value) -> None:
        if not isinstance(value, str) or value not in DTYPES_BY_NAME:
            self.fail(field, f"{value!r} is not a torch dtype name (float32, int64, ...)")

    def inputs(self, inputs) -> None:
        self.sequence("inputs", inputs, 0, 1024)
        for i, spec in enumerate(inputs):
            field = f"inputs[{i}]"
            self.record(field, spec, {"name", "shape", "dtype"})
            self.name(f"{field}.name", spec["name"])
            self.shape(f"{field}.shape", spec["shape"])
            self.dtype(f"{field}.dtype", spec["dtype"])
            if _NOT_PLAIN_DTYPE.fullmatch(spec["dtype"]):
                self.fail(f"{field}.dtype", f"{spec['dtype']} is not a dtype of plain tensors (quantized, bit-packed "
                                            f"and sub-byte dtypes cannot be an export's input)")
            self.defined.add(spec["name"])

    def state(self, state) -> None:
        if not isinstance(state, dict) or len(state) > MAX_NODES:
            self.fail("state", f"is {json_type_name(state)}, expected an object of at most {MAX_NODES} tensors")
        for node_name, info in state.items():
            field = f"state[{node_name!r}]"
            self.name(field, node_name)
            self.record(field, info, {"tensor", "kind", "shape", "dtype"})
            self.string(f"{field}.tensor", info["tensor"], 1024)
            if info["kind"] not in STATE_KINDS:
                self.fail(f"{field}.kind", f"{info['kind']!r} is not one of {', '.join(STATE_KINDS)}")
            self.shape(f"{field}.shape", info["shape"])
            if None in info["shape"]:
                self.fail(f"{field}.shape", "a stored tensor has no dynamic dimension")
            self.dtype(f"{field}.dtype", info["dtype"])
            self.defined.add(node_name)

    def nodes(self, nodes) -> None:
        self.sequence("nodes", nodes, 0, MAX_NODES)
        for i, node in enumerate(nodes):
            field = f"nodes[{i}]"
            self.record(field, node, NODE_FIELDS, {"shape", "dtype", "outputs"})
            self.name(f"{field}.name", node["name"])
            field = f"nodes[{i}] ({node['name']})"
            self.op(field, node)
            self.sequence(f"{field}.inputs", node["inputs"], 0, 64)
            for j, arg in enumerate(node["inputs"]):
                self.arg(f"{field}.inputs[{j}]", arg, 0)
            if not isinstance(node["kwargs"], dict) or len(node["kwargs"]) > 64:
                self.fail(f"{field}.kwargs", f"is {json_type_name(node['kwargs'])}, expected an object")
            for key, arg in node["kwargs"].items():
                if not NAME_PATTERN.fullmatch(key) or key.startswith("_"):
                    self.fail(f"{field}.kwargs", f"{key!r} is not an argument name")
                self.arg(f"{field}.kwargs[{key!r}]", arg, 0)
            self.node_meta(field, node)
            self.defined.add(node["name"])

    def op(self, field: str, node: dict) -> None:
        try:
            resolve_op(node["op"])
        except ExportFormatError as exc:
            self.fail(f"{field}.op", str(exc))
        if node["op"] not in OPERATORS:
            return
        arity = PYTHON_ARITY.get(node["op"], 2)
        if node["kwargs"] or not isinstance(node["inputs"], list) or len(node["inputs"]) != arity or not all(
                is_json_int(a) or isinstance(a, float) or isinstance(a, dict) and set(a) == {"node"}
                for a in node["inputs"]):
            self.fail(f"{field}.inputs", f"{node['op']} takes {arity} node references or numbers, no kwargs")

    def node_meta(self, field: str, node: dict) -> None:
        if "outputs" in node:
            if "shape" in node or "dtype" in node:
                self.fail(field, "has both outputs and shape/dtype")
            self.sequence(f"{field}.outputs", node["outputs"], 1, 1024)
            for j, meta in enumerate(node["outputs"]):
                if meta is not None:
                    self.tensor_meta(f"{field}.outputs[{j}]", meta)
        elif "shape" in node or "dtype" in node:
            self.tensor_meta(field, {k: node.get(k) for k in ("shape", "dtype")})

    def tensor_meta(self, field: str, meta) -> None:
        self.record(field, meta, {"shape", "dtype"})
        self.shape(f"{field}.shape", meta["shape"])
        self.dtype(f"{field}.dtype", meta["dtype"])

    def arg(self, field: str, value, depth: int) -> None:
        if value is None or isinstance(value, (bool, float)):
            return
        if is_json_int(value):
            if not -INT64_LIMIT <= value < INT64_LIMIT:
                self.fail(field, f"{value} does not fit 64 bits")
        elif isinstance(value, str):
            self.string(field, value)
        elif isinstance(value, list):
            if depth >= MAX_LIST_DEPTH or len(value) > MAX_LIST_LENGTH:
                self.fail(field, f"nests deeper than {MAX_LIST_DEPTH} or holds more than {MAX_LIST_LENGTH} entries")
            for j, v in enumerate(value):
                self.arg(f"{field}[{j}]", v, depth + 1)
        elif isinstance(value, dict):
            self.tagged(field, value)
        else:
            self.fail(field, f"is {json_type_name(value)}")

    def tagged(self, field: str, value: dict) -> None:
        if len(value) != 1:
            self.fail(field, f"{value!r} is not an argument encoding (one of node, dtype, device, layout, "
                             f"memory_format, float)")
        (kind, name), = value.items()
        if kind == "node":
            if not isinstance(name, str) or name not in self.defined:
                self.fail(field, f"refers to {name!r}, which is not an input, parameter or earlier node")
        elif kind == "device":
            if not isinstance(name, str) or not DEVICE_PATTERN.fullmatch(name):
                self.fail(field, f"{name!r} is not a device (cpu, cuda:0, ...)")
        elif kind in DECODERS:
            if not isinstance(name, str) or name not in DECODERS[kind]:
                self.fail(field, f"{name!r} is not a torch {kind} (one of {', '.join(DECODERS[kind])})")
        else:
            self.fail(field, f"unknown argument encoding {kind!r}")

    def files(self, files) -> None:
        if not isinstance(files, dict) or PARAMS_FILE not in files:
            self.fail("files", f"is {json_type_name(files)} without {PARAMS_FILE}, expected an object listing it")
        for name, entry in files.items():
            if name not in (PARAMS_FILE, PT2_FILE):
                self.fail("files", f"{name!r} is not a file of an export ({PARAMS_FILE}, {PT2_FILE})")
            self.record(f"files[{name!r}]", entry, {"sha256", "bytes"})
            if not isinstance(entry["sha256"], str) or not SHA256_PATTERN.fullmatch(entry["sha256"]):
                self.fail(f"files[{name!r}].sha256", "is not 64 lowercase hex digits")
            if not is_json_int(entry["bytes"]) or not 0 <= entry["bytes"] <= MAX_FILE_BYTES:
                self.fail(f"files[{name!r}].bytes", f"{entry['bytes']!r} is not a file size")



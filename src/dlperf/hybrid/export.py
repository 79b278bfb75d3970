"""``export(module, path, example_inputs)`` and ``load(path)``: a model that outlives its Python class.

An export is a directory of two files (three on request):

``graph.json``
    human-readable: a format name and version, the inputs (name, shape, dtype; ``null`` for a
    dimension that may vary, such as the batch), the parameters and buffers (shape, dtype), and the
    nodes in execution order, each an ATen operator (``aten.conv2d.default``) with its inputs and
    the shape and dtype of what it produces. It also records the SHA-256 of the parameter file and
    of its own content, so a truncated or edited export is refused instead of silently misread.
``params.safetensors``
    every parameter and buffer, by the module's ``state_dict`` names.
``model.pt2`` (only with ``pt2=True``)
    the ``torch.export`` program, for PyTorch's own deployment tools; checksummed like the rest.

The graph comes from ``torch.export`` of the module in eval mode: the exported computation is
inference (BatchNorm uses running statistics, dropout is off), as in MXNet's ``export``. ``load``
interprets it with ATen operators only: a tampered graph cannot name arbitrary Python functions.
Both files are written to a temporary name and moved into place (``os.replace``), so a crash never
leaves a half-written export behind a valid name.

>>> import tempfile, torch
>>> from dlperf.models import get_model
>>> net = get_model("mlp").eval()
>>> x = torch.randn(1, 512)
>>> d = tempfile.mkdtemp()
>>> paths = export(net, d, (x,))
>>> torch.allclose(load(d)(x), net(x))
True
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import operator
import os
import tempfile
import warnings
from collections.abc import Iterator

import torch
from torch import fx, nn

from ..errors import DlperfError

FORMAT_NAME = "dlperf-graph"
FORMAT_VERSION = 1
GRAPH_FILE = "graph.json"
PARAMS_FILE = "params.safetensors"
PT2_FILE = "model.pt2"

# Python-level operators torch.export leaves between ATen calls (tuple outputs, symbolic sizes).
_OPERATORS = {f"operator.{name}": getattr(operator, name)
              for name in ("getitem", "add", "sub", "mul", "floordiv", "mod", "neg", "truediv")}


class ExportFormatError(DlperfError, ValueError):
    """An export directory is missing, truncated, tampered with, or of an unknown version."""


# --- writing ----------------------------------------------------------------------------

def export(module: nn.Module, path: str | os.PathLike, example_inputs: tuple, *,
           dynamic_batch: bool = True, pt2: bool = False) -> dict[str, str]:
    """Write ``module``'s inference graph and parameters to the directory ``path``.

    Args:
        example_inputs: positional inputs of a forward call; they fix dtypes and shapes.
        dynamic_batch: let dimension 0 of every input vary (kept static if the model needs it).
        pt2: also write ``model.pt2`` (``torch.export.save``) for PyTorch tools that read
            ExportedPrograms (AOTInductor, ExecuTorch); :func:`load` does not need it.

    Returns:
        The paths written, ``{"graph": ..., "params": ...}``.
    """
    from .hybridize import HybridModule

    if isinstance(module, HybridModule):
        module = module.module
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    program = _export_program(module, tuple(example_inputs), dynamic_batch)
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    doc, tensors = _describe(program, state, example_inputs)
    _make_export_dir(path)
    params_path = os.path.join(path, PARAMS_FILE)
    _write_safetensors_atomically(tensors, params_path)
    written = {"graph": os.path.join(path, GRAPH_FILE), "params": params_path}
    if pt2:
        written["pt2"] = os.path.join(path, PT2_FILE)
        with _temp_beside(written["pt2"]) as tmp:
            torch.export.save(program, tmp)
            _fsync(tmp)
    doc["files"] = {os.path.basename(p): {"sha256": _sha256_file(p), "bytes": os.path.getsize(p)}
                    for kind, p in written.items() if kind != "graph"}
    doc["content_sha256"] = _content_hash(doc)
    graph_path = os.path.join(path, GRAPH_FILE)
    _write_atomically(graph_path, _layout(doc).encode())
    return written


def _make_export_dir(path: str | os.PathLike) -> None:
    """Create the export directory, with one clear error when the path cannot be one."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ExportFormatError(f"{os.fspath(path)}: exists and is not a directory; give a directory for the export")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ExportFormatError(f"{os.fspath(path)}: cannot create the export directory: "
                                f"{exc.strerror or exc}") from exc


def _export_program(module: nn.Module, args: tuple, dynamic_batch: bool):
    was_training = module.training
    module.eval()
    try:
        with warnings.catch_warnings():
            # nn.LSTM re-assigns its flat weight list during tracing; torch warns, harmlessly here.
            warnings.simplefilter("ignore", UserWarning)
            if dynamic_batch:
                dims = tuple({0: torch.export.Dim.AUTO} if a.dim() > 0 else None for a in args)
                # A batch of 1 would be specialized (size-1 dimensions broadcast), so trace with
                # the example repeated; only shapes and dtypes are taken from it.
                traced = tuple(torch.cat([a, a]) if a.dim() > 0 and a.shape[0] == 1 else a for a in args)
                try:
                    return torch.export.export(module, traced, dynamic_shapes=dims, strict=False)
                except Exception:  # some graphs pin the batch size; a static export still serves
                    pass
            return torch.export.export(module, args, strict=False)
    except Exception as exc:
        raise DlperfError(f"cannot export {type(module).__name__}: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    finally:
        module.train(was_training)


def _describe(program, state: dict, example_inputs) -> tuple[dict, dict[str, torch.Tensor]]:
    """The JSON document and the tensors to save, from an ExportedProgram."""
    from torch.export.graph_signature import InputKind

    specs = {s.arg.name: s for s in program.graph_signature.input_specs}
    tensors: dict[str, torch.Tensor] = {}
    inputs, state_nodes, nodes = [], {}, []
    constants = dict(getattr(program, "constants", {}) or {})
    for node in program.graph.nodes:
        if node.op == "placeholder":
            spec = specs[node.name]
            if spec.kind == InputKind.USER_INPUT:
                inputs.append({"name": node.name, **_meta(node, dynamic_ok=True)})
                continue
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                tensor = state[spec.target]
            elif spec.target in constants:
                tensor = constants[spec.target]
            else:
                raise DlperfError(f"cannot export input {node.name} of kind {spec.kind.name}")
            tensors[spec.target] = tensor.detach().contiguous()
            state_nodes[node.name] = {"tensor": spec.target, "kind": spec.kind.name.lower(),
                                      "shape": list(tensor.shape), "dtype": _dtype_name(tensor.dtype)}
        elif node.op == "call_function":
            nodes.append({"name": node.name, "op": _op_name(node.target),
                          "inputs": [_encode(a) for a in node.args],
                          "kwargs": {k: _encode(v) for k, v in node.kwargs.items()},
                          **_meta(node, dynamic_ok=True)})
        elif node.op == "output":
            outputs = [_encode(a) for a in node.args[0]]
        else:
            raise DlperfError(f"cannot export graph node {node.op} {node.target}")
    doc = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "torch_version": torch.__version__,
           "inputs": inputs, "outputs": outputs, "state": state_nodes, "nodes": nodes}
    return doc, tensors


def _meta(node: fx.Node, dynamic_ok: bool) -> dict:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        shape = [d if isinstance(d, int) else None for d in val.shape]
        return {"shape": shape, "dtype": _dtype_name(val.dtype)}
    if isinstance(val, (tuple, list)):
        return {"outputs": [_meta_value(v) for v in val]}
    return {}


def _meta_value(v) -> dict | None:
    if isinstance(v, torch.Tensor):
        return {"shape": [d if isinstance(d, int) else None for d in v.shape], "dtype": _dtype_name(v.dtype)}
    return None


def _layout(doc: dict) -> str:
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


def _op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._opname}.{target._overloadname}" if target.namespace == "aten" else \
            f"{target.namespace}.{target._opname}.{target._overloadname}"
    for name, fn in _OPERATORS.items():
        if target is fn:
            return name
    raise DlperfError(f"cannot export operator {target!r}: only ATen operators are portable")


def _encode(value):
    """A JSON value for one node argument."""
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, torch.dtype):
        return {"dtype": _dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).replace("torch.", "")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).replace("torch.", "")}
    raise DlperfError(f"cannot export argument {value!r} of type {type(value).__name__}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# --- reading ----------------------------------------------------------------------------

class ExportedModule(nn.Module):
    """A loaded export: interprets the graph's ATen nodes over the saved tensors.

    ``forward`` checks the number, dtype and fixed dimensions of its inputs against the export.
    """

    def __init__(self, doc: dict, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.doc = doc
        self._names: dict[str, str] = {}  # graph placeholder -> attribute holding its tensor
        for i, (node_name, info) in enumerate(doc["state"].items()):
            attr = f"t{i}"
            tensor = tensors[info["tensor"]]
            if info["kind"] == "parameter":
                self.register_parameter(attr, nn.Parameter(tensor, requires_grad=tensor.is_floating_point()))
            else:
                self.register_buffer(attr, tensor)
            self._names[node_name] = attr
        self._program = [(n["name"], _resolve_op(n["op"]), n["inputs"], n["kwargs"]) for n in doc["nodes"]]
        self._inputs = doc["inputs"]
        self._outputs = doc["outputs"]

    def forward(self, *args):
        self._check_inputs(args)
        env: dict[str, object] = {spec["name"]: a for spec, a in zip(self._inputs, args)}
        # Tensors the graph creates (LSTM's zero state) go where the inputs are, whatever device
        # the export was traced on.
        env["@device"] = args[0].device if args else None
        for node_name, attr in self._names.items():
            env[node_name] = getattr(self, attr)
        for name, fn, inputs, kwargs in self._program:
            env[name] = fn(*[_decode(a, env) for a in inputs], **{k: _decode(v, env) for k, v in kwargs.items()})
        outs = [_decode(o, env) for o in self._outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _check_inputs(self, args: tuple) -> None:
        if len(args) != len(self._inputs):
            raise DlperfError(f"exported model takes {len(self._inputs)} inputs, got {len(args)}")
        for spec, a in zip(self._inputs, args):
            want = spec["shape"]
            ok = isinstance(a, torch.Tensor) and _dtype_name(a.dtype) == spec["dtype"] and a.dim() == len(want) \
                and all(w is None or w == d for w, d in zip(want, a.shape))
            if not ok:
                got = f"{_dtype_name(a.dtype)}{list(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
                shown = ["N" if w is None else w for w in want]
                raise DlperfError(f"input {spec['name']}: expected {spec['dtype']}{shown}, got {got}")

    def extra_repr(self) -> str:
        return f"{len(self._program)} nodes, format_version={self.doc['format_version']}"


def load(path: str | os.PathLike, device: torch.device | str = "cpu") -> ExportedModule:
    """Load an export written by :func:`export`; raises ExportFormatError on any damage.

    The returned module needs no Python class of the original model.
    """
    graph_path = os.path.join(path, GRAPH_FILE)
    params_path = os.path.join(path, PARAMS_FILE)
    for p in (graph_path, params_path):
        if not os.path.isfile(p):
            raise ExportFormatError(f"{path}: missing {os.path.basename(p)}; is this a dlperf export?")
    doc = _read_graph(graph_path)
    expected = doc["files"][PARAMS_FILE]
    if os.path.getsize(params_path) != expected.get("bytes") or _sha256_file(params_path) != expected.get("sha256"):
        raise ExportFormatError(f"{params_path}: checksum does not match graph.json (truncated or modified)")
    try:
        from safetensors.torch import load_file

        tensors = load_file(params_path, device=str(device))
    except Exception as exc:
        raise ExportFormatError(f"{params_path}: unreadable safetensors file: {exc}") from exc
    _check_state(doc, tensors, params_path)
    try:
        return ExportedModule(doc, tensors)
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportFormatError(f"{graph_path}: malformed graph: {type(exc).__name__}: {exc}") from exc


def load_pt2(path: str | os.PathLike):
    """The ``torch.export`` program saved with ``export(..., pt2=True)``, after its checksum."""
    doc = _read_graph(os.path.join(path, GRAPH_FILE))
    pt2_path = os.path.join(path, PT2_FILE)
    expected = doc["files"].get(PT2_FILE)
    if expected is None or not os.path.isfile(pt2_path):
        raise ExportFormatError(f"{path}: no {PT2_FILE} in this export (export with pt2=True)")
    if _sha256_file(pt2_path) != expected.get("sha256"):
        raise ExportFormatError(f"{pt2_path}: checksum does not match graph.json (truncated or modified)")
    return torch.export.load(pt2_path)


def _read_graph(graph_path: str) -> dict:
    try:
        with open(graph_path, "rb") as f:
            doc = json.loads(f.read().decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportFormatError(f"{graph_path}: not a readable JSON graph ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise ExportFormatError(f"{graph_path}: not a {FORMAT_NAME} file")
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise ExportFormatError(f"{graph_path}: format_version {version!r} is not supported "
                                f"(this dlperf reads version {FORMAT_VERSION}); re-export the model")
    if doc.get("content_sha256") != _content_hash(doc):
        raise ExportFormatError(f"{graph_path}: content checksum does not match (file was modified)")
    for key in ("inputs", "outputs", "state", "nodes", "files"):
        if key not in doc:
            raise ExportFormatError(f"{graph_path}: missing field {key!r}")
    return doc


def _check_state(doc: dict, tensors: dict, params_path: str) -> None:
    for info in doc["state"].values():
        t = tensors.get(info["tensor"])
        if t is None:
            raise ExportFormatError(f"{params_path}: tensor {info['tensor']!r} is missing")
        if list(t.shape) != info["shape"] or _dtype_name(t.dtype) != info["dtype"]:
            raise ExportFormatError(f"{params_path}: tensor {info['tensor']!r} is {_dtype_name(t.dtype)}"
                                    f"{list(t.shape)}, graph.json says {info['dtype']}{info['shape']}")


def _resolve_op(name: str):
    """An ATen operator (or one of a few Python operators) by its exported name, nothing else."""
    if name in _OPERATORS:
        return _OPERATORS[name]
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        raise ExportFormatError(f"operator {name!r} is not an ATen operator")
    try:
        return getattr(getattr(torch.ops.aten, parts[1]), parts[2])
    except (AttributeError, RuntimeError) as exc:
        raise ExportFormatError(f"operator {name!r} does not exist in this PyTorch") from exc


def _decode(value, env: dict):
    if isinstance(value, list):
        return [_decode(v, env) for v in value]
    if isinstance(value, dict):
        if "node" in value:
            return env[value["node"]]
        if "dtype" in value:
            return getattr(torch, value["dtype"])
        if "device" in value:
            return env.get("@device") or torch.device(value["device"])
        if "layout" in value:
            return getattr(torch, value["layout"])
        if "memory_format" in value:
            return getattr(torch, value["memory_format"])
        if "float" in value:
            return float(value["float"])
        raise ExportFormatError(f"unknown argument encoding {value!r}")
    return value


# --- files ------------------------------------------------------------------------------

def _content_hash(doc: dict) -> str:
    body = {k: v for k, v in doc.items() if k != "content_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def _temp_beside(path: str) -> Iterator[str]:
    """A temporary file in ``path``'s directory (same filesystem, so os.replace is atomic)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(path) or ".")
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_atomically(path: str, data: bytes) -> None:
    with _temp_beside(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def _write_safetensors_atomically(tensors: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    with _temp_beside(path) as tmp:
        save_file(tensors, tmp, metadata={"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)})
        _fsync(tmp)  # the bytes reach the disk before the rename makes them the export's


def _fsync(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())

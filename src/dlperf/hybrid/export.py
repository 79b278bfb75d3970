"""``export(module, path, example_inputs)`` and ``load(path)``: a model that outlives its Python class.

An export is a directory of two files (three on request):

``graph.json``
    human-readable: a format name and version, the inputs (name, shape, dtype; ``null`` for a
    dimension that may vary, such as the batch), the parameters and buffers (shape, dtype), and the
    nodes in execution order, each an ATen operator (``aten.conv2d.default``) with its inputs and
    the shape and dtype of what it produces. It also records the size and SHA-256 of the other
    files and of its own content, so a truncated or damaged export is refused instead of misread.
``params.safetensors``
    every parameter and buffer, by the module's ``state_dict`` names.
``model.pt2`` (only with ``pt2=True``)
    the ``torch.export`` program, for PyTorch's own deployment tools; checksummed like the rest.

The graph comes from ``torch.export`` of the module in eval mode: the exported computation is
inference (BatchNorm uses running statistics, dropout is off), as in MXNet's ``export``.

What ``load`` guarantees for a directory from an untrusted source. The checksums catch accidents,
not attackers (anyone can recompute them), so every field is checked on its own:

* Nothing but ATen operators and a fixed table of Python arithmetic operators (``operator.add``,
  ``operator.getitem``...) can be named. An operator name must match ``aten.<op>.<overload>`` with
  plain identifiers (no leading underscore, no dunder), must exist in PyTorch's dispatcher (which
  excludes TorchScript's list/string/file builtins such as ``aten::save``), and must not be one of
  the few dispatcher operators that touch files or build unchecked sparse tensors. No attribute
  path is followed: the lookup cannot reach Python objects or change ``torch.ops``.
* dtypes, layouts, memory formats and devices are looked up in tables of torch's own values.
* ``graph.json`` is validated against one schema before anything runs: field types, identifier
  syntax, shapes (lists of ints, ``null`` for a dynamic dimension, bounded rank and size), node
  references only to inputs, parameters and earlier nodes, every listed file present with its size
  and SHA-256, and the parameter file holding exactly the recorded tensors with their shapes and
  dtypes. Node counts, nesting, strings and tensor sizes are bounded.
* The graph then runs with the declared input shapes: on the ``meta`` device (shapes only, no
  memory) with dynamic dimensions of ``TRIAL_DIM``, where every node's result must have the
  recorded dtype and shape and all results together take at most ``MAX_TRIAL_BYTES``; again on
  ``meta`` with dynamic dimensions of a prime that equals no fixed dimension of the graph (so that
  nothing broadcasts only by coincidence); then on zeros where the parameters are, since meta
  kernels skip some checks real kernels make. No run may write into an input or a parameter
  (their version counters must not move).

Any violation raises :class:`ExportFormatError` from ``load`` naming the file and the field or
node, never later from ``forward``, except for what depends on the caller's values (a token id out
of the embedding's range) or, for a graph crafted to pass the trial, Python arithmetic on sizes at
another batch size (also ExportFormatError). A graph that passes runs the recorded ATen kernels, so
its results are those of the computation graph.json describes. What stays possible is what any
model can do: spend CPU time and memory within the bounds.
``load_pt2`` is different: ``torch.export.load`` unpickles parts of the archive, so it refuses
unless called with ``trusted=True`` (see its docstring).

Writing is atomic as a whole: the files go into a new temporary directory beside ``path``, which
is flushed to disk and then swapped with ``path`` in one rename (``renameat2(RENAME_EXCHANGE)`` on
Linux). A process killed at any moment leaves the previous export loadable; the next export removes
the temporary directories that dead processes left behind.

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

import ctypes
import ctypes.util
import errno
import hashlib
import json
import math
import operator
import os
import re
import shutil
import stat
import tempfile
import warnings
from typing import NamedTuple

import torch
from torch import fx, nn

from .._io import _umask
from ..errors import DlperfError

FORMAT_NAME = "dlperf-graph"
FORMAT_VERSION = 1
GRAPH_FILE = "graph.json"
PARAMS_FILE = "params.safetensors"
PT2_FILE = "model.pt2"
EXPORT_FILES = (GRAPH_FILE, PARAMS_FILE, PT2_FILE)

# Python-level operators torch.export leaves between ATen calls (tuple outputs, symbolic sizes).
_OPERATORS = {f"operator.{name}": getattr(operator, name)
              for name in ("getitem", "add", "sub", "mul", "floordiv", "mod", "neg", "truediv")}

# Limits on what a graph may ask for; far above any real model, far below what would exhaust a machine.
MAX_GRAPH_BYTES = 64 << 20
MAX_NODES = 100_000
MAX_RANK = 16
MAX_ELEMENTS = 1 << 32  # per tensor
MAX_FILE_BYTES = 1 << 40
_MAX_DEPTH = 6  # nesting of lists in one argument
_MAX_LIST = 4096
_MAX_STR = 256
_INT64 = 1 << 63
# A dimension recorded as dynamic (``null``) takes this size in the trial runs at load, whose
# results together may take at most MAX_TRIAL_BYTES.
TRIAL_DIM = 2
MAX_TRIAL_BYTES = 1 << 31


class ExportFormatError(DlperfError, ValueError):
    """An export directory is missing, truncated, tampered with, malformed, or of an unknown version."""


# --- writing ----------------------------------------------------------------------------

def export(module: nn.Module, path: str | os.PathLike, example_inputs: tuple, *,
           dynamic_batch: bool = True, pt2: bool = False) -> dict[str, str]:
    """Write ``module``'s inference graph and parameters to the directory ``path``.

    ``path`` is replaced as a whole, atomically: it must not exist, or be empty, or hold only a
    previous export's files (anything else there would be lost, so it is refused).

    Args:
        example_inputs: positional inputs of a forward call; they fix dtypes and shapes.
        dynamic_batch: let dimension 0 of every input vary (kept static if the model needs it).
        pt2: also write ``model.pt2`` (``torch.export.save``) for PyTorch tools that read
            ExportedPrograms (AOTInductor, ExecuTorch); :func:`load` does not need it.

    Returns:
        The paths written, ``{"graph": ..., "params": ...}`` (and ``"pt2"``).
    """
    from .hybridize import HybridModule

    if isinstance(module, HybridModule):
        module = module.module
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    target = _export_target(path)
    program = _export_program(module, tuple(example_inputs), dynamic_batch)
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    doc, tensors = _describe(program, state, example_inputs)
    _recover(target)
    staging = _make_staging_dir(target)
    try:
        _write_files(staging, doc, tensors, program if pt2 else None)
        _swap_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # after a swap it holds the previous export
    written = {"graph": os.path.join(path, GRAPH_FILE), "params": os.path.join(path, PARAMS_FILE)}
    if pt2:
        written["pt2"] = os.path.join(path, PT2_FILE)
    return written


def _export_target(path: str | os.PathLike) -> str:
    """The directory an export replaces, refused early when replacing it would lose something."""
    shown = os.fspath(path)
    target = os.path.realpath(shown)  # a symlinked export directory is updated where it points
    if os.path.exists(target) and not os.path.isdir(target):
        raise ExportFormatError(f"{shown}: exists and is not a directory; give a directory for the export")
    if os.path.isdir(target):
        others = sorted(set(os.listdir(target)) - set(EXPORT_FILES))
        if others:
            raise ExportFormatError(f"{shown}: holds {others[0]!r}, which is not part of an export; the export "
                                    f"replaces the whole directory, so give a new or empty directory")
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise ExportFormatError(f"{shown}: cannot create the export directory: {exc.strerror or exc}") from exc
    return target


def _write_files(staging: str, doc: dict, tensors: dict[str, torch.Tensor], program) -> None:
    """Write the export's files into ``staging`` and flush them to disk.

    ``staging`` is new and only becomes the export by the swap of the whole directory, so no reader
    can see these files half-written: plain writes suffice, with no temporary file per file. They
    must be on disk before the swap, though, or a crash right after it could leave an empty file.
    """
    from safetensors.torch import save_file

    save_file(tensors, os.path.join(staging, PARAMS_FILE),
              metadata={"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)})
    names = [PARAMS_FILE]
    if program is not None:
        torch.export.save(program, os.path.join(staging, PT2_FILE))
        names.append(PT2_FILE)
    for name in names:
        path = os.path.join(staging, name)
        os.chmod(path, 0o666 & ~_umask())  # safetensors creates its file 0600; an export is as readable as any file
        _fsync_path(path)
    doc["files"] = {name: {"sha256": _sha256_file(os.path.join(staging, name)),
                           "bytes": os.path.getsize(os.path.join(staging, name))} for name in names}
    doc["content_sha256"] = _content_hash(doc)
    with open(os.path.join(staging, GRAPH_FILE), "xb") as f:
        f.write(_layout(doc).encode())
        f.flush()
        os.fsync(f.fileno())
    _fsync_path(staging)


# Temporary directories beside the target: ``.NAME.export-PID-XXXX`` holds an export being
# written (or, after the swap, the previous one being deleted); ``.NAME.old-PID-XXXX`` holds the
# previous export while the fallback swap has moved it aside.
def _sibling_pattern(target: str) -> re.Pattern:
    return re.compile(rf"\.{re.escape(os.path.basename(target))}\.(export|old)-(\d+)-[A-Za-z0-9_]+")


def _make_staging_dir(target: str) -> str:
    parent, base = os.path.split(target)
    staging = tempfile.mkdtemp(prefix=f".{base}.export-{os.getpid()}-", dir=parent)
    os.chmod(staging, 0o777 & ~_umask())  # mkdtemp's 0700 would become the export's mode
    return staging


def _recover(target: str) -> None:
    """Undo what a killed export left: restore a moved-aside previous export, delete temporaries."""
    parent = os.path.dirname(target)
    pattern = _sibling_pattern(target)
    leftovers = []
    for entry in os.listdir(parent):
        m = pattern.fullmatch(entry)
        if m and not _process_alive(int(m.group(2))):
            leftovers.append((m.group(1), os.path.join(parent, entry)))
    for kind, path in sorted(leftovers, key=lambda kp: kp[0] != "old"):
        if kind == "old" and not os.path.exists(target):
            os.rename(path, target)
            _fsync_path(parent)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _libc_renameat2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _libc_renameat2()


def _exchange(a: str, b: str) -> bool:
    """Swap two directory entries in one step; False when the system cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False  # kernel or filesystem without RENAME_EXCHANGE
    raise OSError(err, os.strerror(err), b)


def _swap_into_place(staging: str, target: str) -> None:
    """Make ``staging`` the directory at ``target``; what was there ends up at ``staging`` or deleted."""
    parent = os.path.dirname(target)
    if not os.path.exists(target):
        try:
            os.rename(staging, target)
            _fsync_path(parent)
            return
        except OSError as exc:  # another export created it meanwhile: swap with that one
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    if not _exchange(staging, target):
        # Two renames: a kill between them leaves no ``target`` but a complete ``.old-`` directory,
        # which _recover (next export) puts back and load reads meanwhile.
        aside = os.path.join(parent, os.path.basename(staging).replace(".export-", ".old-", 1))
        os.rename(target, aside)
        os.rename(staging, target)
        _fsync_path(parent)
        shutil.rmtree(aside, ignore_errors=True)
    _fsync_path(parent)


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

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
_OP_NAME = re.compile(r"aten\.([a-z][a-z0-9_]{0,99})\.([A-Za-z][A-Za-z0-9_]{0,99})")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DEVICE = re.compile(r"(cpu|cuda|meta|mps|xpu)(:[0-9]{1,3})?")
# Dispatcher operators whose effects reach past the graph's tensors: reading files, sparse
# constructors whose invariant checks an argument can switch off (unchecked indices read out of
# bounds), and set_ (a tensor that takes over a parameter's storage, writing it unseen).
_DENIED_OPS = re.compile(r"from_file|get_gradients|set_.*|.*sparse.*|.*unsafe.*")

_DTYPES = {_dtype_name(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_LAYOUTS = {"strided": torch.strided}  # other layouts (sparse) are refused, see _DENIED_OPS
_MEMORY_FORMATS = {str(v).removeprefix("torch."): v for v in vars(torch).values()
                   if isinstance(v, torch.memory_format)}
_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_STATE_KINDS = ("parameter", "buffer", "constant_tensor")
_TOP_FIELDS = ("format", "format_version", "torch_version", "inputs", "outputs", "state", "nodes", "files",
               "content_sha256")
_NODE_FIELDS = {"name", "op", "inputs", "kwargs"}
_PYTHON_ARITY = {"operator.neg": 1}


class _Step(NamedTuple):
    name: str
    op: str
    fn: object
    inputs: list
    kwargs: dict
    meta: dict


class ExportedModule(nn.Module):
    """A loaded export: interprets the graph's ATen nodes over the saved tensors.

    The constructor validates ``doc`` and ``tensors`` and trial-runs the graph (see :func:`load`);
    ``forward`` checks the number, dtype and fixed dimensions of its inputs against the export.
    """

    def __init__(self, doc: dict, tensors: dict[str, torch.Tensor], *, where: str = GRAPH_FILE):
        super().__init__()
        _GraphSchema(where).check(doc)
        _check_params(doc, tensors, where)
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
        self._program = [_Step(n["name"], n["op"], _resolve_op(n["op"]), n["inputs"], n["kwargs"],
                               {k: n[k] for k in ("shape", "dtype", "outputs") if k in n}) for n in doc["nodes"]]
        self._inputs = doc["inputs"]
        self._outputs = doc["outputs"]
        self._trial_run(where)

    def forward(self, *args):
        self._check_inputs(args)
        env: dict[str, object] = {spec["name"]: a for spec, a in zip(self._inputs, args)}
        env.update((node_name, getattr(self, attr)) for node_name, attr in self._names.items())
        # Tensors the graph creates (LSTM's zero state) go where the inputs are, whatever device
        # the export was traced on.
        return self._interpret(env, args[0].device if args else torch.device("cpu"))

    def _interpret(self, env: dict, device: torch.device, trial: bool = False, limit: int | None = None):
        env["@device"] = device
        produced = 0
        for step in self._program:
            try:
                value = _call(step, env)
            except ExportFormatError:
                raise
            except Exception as exc:
                # ATen errors at forward are the caller's (wrong device, out-of-range token);
                # anything in the trial runs, and Python operators on the graph's own values, are the file's.
                if not trial and step.op not in _OPERATORS:
                    raise
                raise ExportFormatError(f"node {step.name!r} ({step.op}) fails{' in the trial run' if trial else ''}: "
                                        f"{type(exc).__name__}: {_first_line(exc)}") from exc
            if trial:
                produced += _check_result(step, value)
                if limit is not None and produced > limit:
                    raise ExportFormatError(f"node {step.name!r} ({step.op}): the graph's results take more than "
                                            f"{limit} bytes")
            env[step.name] = value
        outs = [_decode(o, env) for o in self._outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _trial_run(self, where: str) -> None:
        """Run the graph with the declared input shapes, comparing every node with its record.

        On the meta device (shapes only, no memory) with dynamic dimensions of ``TRIAL_DIM``, which
        bounds the results' size; again with a size that equals no fixed dimension of the graph, so
        that no broadcast or reshape works only by coincidence; then on zeros where the parameters
        are, because meta kernels skip some checks the real kernels make (an int64 input to
        ``linear``, say). A graph that loads must not fail in forward.
        """
        params_device = next((t.device for t in self._state_tensors()), torch.device("cpu"))
        meta = torch.device("meta")
        for device, dim, limit in ((meta, TRIAL_DIM, MAX_TRIAL_BYTES), (meta, _unlike_any_dimension(self.doc), None),
                                   (params_device, TRIAL_DIM, MAX_TRIAL_BYTES)):
            env: dict[str, object] = {
                spec["name"]: torch.zeros([dim if d is None else d for d in spec["shape"]],
                                          dtype=_DTYPES[spec["dtype"]], device=device)
                for spec in self._inputs}
            env.update((name, getattr(self, attr).detach().to(device)) for name, attr in self._names.items())
            # Writes show in version counters (views share their base's); the graph may only
            # write into its own results, never into the caller's inputs or the parameters.
            versions = {name: t._version for name, t in env.items()}
            try:
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self._interpret(env, device, trial=True, limit=limit)
            except ExportFormatError as exc:
                raise ExportFormatError(f"{where}: {exc} (dynamic dimensions of size {dim})") from exc.__cause__
            written = [name for name, version in versions.items() if env[name]._version != version]
            if written:
                raise ExportFormatError(f"{where}: the graph writes into {written[0]!r}, an input or parameter; "
                                        f"a loaded graph may only write into its own results")

    def _state_tensors(self):
        return (getattr(self, attr) for attr in self._names.values())

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


def _call(step: _Step, env: dict):
    args = [_decode(a, env) for a in step.inputs]
    if step.op not in _OPERATORS:
        return step.fn(*args, **{k: _decode(v, env) for k, v in step.kwargs.items()})
    # Python operators only ever see tensors and numbers (and getitem a node's tuple): a graph
    # cannot make them repeat a sequence a billion times or build an unbounded integer.
    operands = args[1:] if step.op == "operator.getitem" else args
    container_ok = step.op != "operator.getitem" or isinstance(args[0], (torch.Tensor, tuple, list))
    if not container_ok or not all(isinstance(a, (torch.Tensor, int, float)) for a in operands):
        raise ExportFormatError(f"node {step.name!r} ({step.op}) applied to "
                                f"{', '.join(type(a).__name__ for a in args)}; expected tensors or numbers")
    value = step.fn(*args)
    if isinstance(value, int) and not -_INT64 <= value < _INT64:
        raise ExportFormatError(f"node {step.name!r} ({step.op}) gives {value}, beyond 64-bit integers")
    return value


def _check_result(step: _Step, value) -> int:
    """A trial-run value against the shape and dtype graph.json records for its node; its size in bytes."""
    meta = step.meta
    if "outputs" in meta:
        if not isinstance(value, (tuple, list)) or len(value) != len(meta["outputs"]):
            raise ExportFormatError(f"node {step.name!r} ({step.op}) gives {_describe_value(value)}, "
                                    f"graph.json records {len(meta['outputs'])} outputs")
        return sum(_check_tensor(f"node {step.name!r} ({step.op}) output {i}", v, m)
                   for i, (v, m) in enumerate(zip(value, meta["outputs"])))
    return _check_tensor(f"node {step.name!r} ({step.op})", value, meta if "shape" in meta else None)


def _check_tensor(what: str, value, meta: dict | None) -> int:
    if meta is None:
        if not isinstance(value, (int, float, bool)) and value is not None:
            raise ExportFormatError(f"{what} gives {_describe_value(value)}, graph.json records no tensor there")
        return 0
    want = f"{meta['dtype']}{['N' if d is None else d for d in meta['shape']]}"
    if not isinstance(value, torch.Tensor):
        raise ExportFormatError(f"{what} gives {_describe_value(value)}, graph.json records {want}")
    fits = _dtype_name(value.dtype) == meta["dtype"] and value.dim() == len(meta["shape"]) \
        and all(w is None or w == d for w, d in zip(meta["shape"], value.shape))
    if not fits:
        raise ExportFormatError(f"{what} gives {_describe_value(value)}, graph.json records {want}")
    return value.numel() * value.element_size()


def _unlike_any_dimension(doc: dict) -> int:
    """A prime size for dynamic dimensions that equals no fixed dimension recorded in the graph."""
    shapes = [spec["shape"] for spec in doc["inputs"]] + [info["shape"] for info in doc["state"].values()]
    shapes += [n["shape"] for n in doc["nodes"] if "shape" in n]
    shapes += [o["shape"] for n in doc["nodes"] for o in n.get("outputs", []) if o]
    fixed = {d for shape in shapes for d in shape}
    candidate = 11
    while candidate in fixed or any(candidate % k == 0 for k in range(2, math.isqrt(candidate) + 1)):
        candidate += 1
    return candidate


def _describe_value(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{_dtype_name(value.dtype)}{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


def load(path: str | os.PathLike, device: torch.device | str = "cpu") -> ExportedModule:
    """Load an export written by :func:`export`; raises ExportFormatError on any damage.

    Safe on untrusted directories: see the module docstring for what is checked. Every problem is
    an :class:`ExportFormatError` raised here, not at the first forward call. The returned module
    needs no Python class of the original model.
    """
    root = _export_root(path)
    graph_path = os.path.join(root, GRAPH_FILE)
    params_path = os.path.join(root, PARAMS_FILE)
    for p in (graph_path, params_path):
        if not os.path.isfile(p):
            raise ExportFormatError(f"{path}: missing {os.path.basename(p)}; is this a dlperf export?")
    doc = _read_graph(graph_path)
    _check_file(params_path, doc["files"][PARAMS_FILE])
    try:
        from safetensors.torch import load_file

        tensors = load_file(params_path, device=str(device))
    except Exception as exc:
        raise ExportFormatError(f"{params_path}: unreadable safetensors file: {_first_line(exc)}") from exc
    return ExportedModule(doc, tensors, where=graph_path)


def load_pt2(path: str | os.PathLike, *, trusted: bool = False):
    """The ``torch.export`` program saved with ``export(..., pt2=True)``, after its checksum.

    Only for files you trust (``trusted=True``): ``torch.export.load`` (PyTorch 2.13) unpickles
    pickled weights and constants with ``torch.load(weights_only=False)`` and ``pickle.loads``,
    resolves operator names by following attribute paths under ``torch``, and parses symbolic
    expressions with ``sympy.sympify``; a crafted ``model.pt2`` can run arbitrary code in any of
    them. The checksum in ``graph.json`` only detects accidents (an attacker recomputes it). For
    files of unknown origin use :func:`load`, which reads ``graph.json`` and ``params.safetensors``
    without any of these.
    """
    root = _export_root(path)
    doc = _read_graph(os.path.join(root, GRAPH_FILE))
    pt2_path = os.path.join(root, PT2_FILE)
    expected = doc["files"].get(PT2_FILE)
    if expected is None or not os.path.isfile(pt2_path):
        raise ExportFormatError(f"{path}: no {PT2_FILE} in this export (export with pt2=True)")
    _check_file(pt2_path, expected)
    if trusted is not True:
        raise ExportFormatError(f"{pt2_path}: torch.export.load can run code embedded in a .pt2 file (it unpickles "
                                f"parts of it); pass trusted=True only for files you made or trust, or use "
                                f"dlperf.hybrid.load({os.fspath(path)!r}), which is safe on untrusted files")
    return torch.export.load(pt2_path)


def _export_root(path: str | os.PathLike) -> str:
    """The directory to read: ``path``, or the previous export a killed fallback swap moved aside."""
    target = os.path.realpath(os.fspath(path))
    if os.path.exists(target):
        return target
    parent = os.path.dirname(target)
    pattern = _sibling_pattern(target)
    try:
        aside = [os.path.join(parent, e) for e in os.listdir(parent)
                 if (m := pattern.fullmatch(e)) and m.group(1) == "old"]
    except OSError:
        return target
    complete = [d for d in aside if os.path.isfile(os.path.join(d, GRAPH_FILE))]
    return max(complete, key=os.path.getmtime) if complete else target


def _read_graph(graph_path: str) -> dict:
    try:
        info = os.stat(graph_path)
    except OSError as exc:
        raise ExportFormatError(f"{graph_path}: missing ({exc.strerror}); is this a dlperf export?") from exc
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_GRAPH_BYTES:
        raise ExportFormatError(f"{graph_path}: not a regular file of at most {MAX_GRAPH_BYTES} bytes")
    try:
        with open(graph_path, "rb") as f:
            data = f.read(MAX_GRAPH_BYTES + 1)
        doc = json.loads(data.decode(), object_pairs_hook=_unique_keys, parse_constant=_no_constant)
        digest = _content_hash(doc) if isinstance(doc, dict) else None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ExportFormatError(f"{graph_path}: not a readable JSON graph ({type(exc).__name__}: "
                                f"{_first_line(exc)})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise ExportFormatError(f"{graph_path}: not a {FORMAT_NAME} file")
    version = doc.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise ExportFormatError(f"{graph_path}: format_version {version!r} is not supported "
                                f"(this dlperf reads version {FORMAT_VERSION}); re-export the model")
    if doc.get("content_sha256") != digest:
        raise ExportFormatError(f"{graph_path}: content checksum does not match (file was modified)")
    _GraphSchema(graph_path).check(doc)
    return doc


def _unique_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _check_file(path: str, expected: dict) -> None:
    """A file listed in graph.json: a regular file of the recorded size and SHA-256."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ExportFormatError(f"{path}: missing ({exc.strerror}); graph.json lists it") from exc
    if not stat.S_ISREG(info.st_mode):
        raise ExportFormatError(f"{path}: not a regular file")
    if info.st_size != expected["bytes"] or _sha256_file(path) != expected["sha256"]:
        raise ExportFormatError(f"{path}: checksum does not match graph.json ({info.st_size} bytes, "
                                f"{expected['bytes']} recorded; truncated or modified)")


def _check_params(doc: dict, tensors: dict, where: str) -> None:
    """The parameter file holds exactly the tensors graph.json records, with their shapes and dtypes."""
    recorded = {info["tensor"]: info for info in doc["state"].values()}
    missing = sorted(set(recorded) - set(tensors))
    extra = sorted(set(tensors) - set(recorded))
    if missing or extra:
        name, problem = (missing[0], "is missing") if missing else (extra[0], "is not in graph.json")
        raise ExportFormatError(f"{where}: parameter file: tensor {name!r} {problem}")
    for name, info in recorded.items():
        t = tensors[name]
        if not isinstance(t, torch.Tensor) or list(t.shape) != info["shape"] or _dtype_name(t.dtype) != info["dtype"]:
            raise ExportFormatError(f"{where}: parameter file: tensor {name!r} is {_describe_value(t)}, "
                                    f"graph.json says {info['dtype']}{info['shape']}")


def _resolve_op(name: str):
    """An ATen operator (or one of a few Python operators) by its exported name, nothing else.

    The name is matched against a grammar and the dispatcher's schema registry before torch.ops is
    consulted, so no attribute path is ever followed and only real ATen operators are created.
    """
    if isinstance(name, str) and name in _OPERATORS:
        return _OPERATORS[name]
    m = _OP_NAME.fullmatch(name) if isinstance(name, str) else None
    if m is None or "__" in name:
        raise ExportFormatError(f"operator {name!r} is not an ATen operator: expected aten.<op>.<overload> "
                                f"of plain identifiers, or one of {', '.join(_OPERATORS)}")
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


def _decode(value, env: dict):
    """A node argument from its (validated) JSON form."""
    if isinstance(value, list):
        return [_decode(v, env) for v in value]
    if isinstance(value, dict):
        (kind, name), = value.items()
        if kind == "node":
            return env[name]
        if kind == "device":
            return env["@device"]
        return _DECODERS[kind][name]
    return value


_DECODERS = {"dtype": _DTYPES, "layout": _LAYOUTS, "memory_format": _MEMORY_FORMATS, "float": _FLOATS}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
             int: "an integer", float: "a number"}
    return names.get(type(value), type(value).__name__)


class _GraphSchema:
    """The one validator of graph.json's structure; raises ExportFormatError naming the field."""

    def __init__(self, where: str):
        self.where = where
        self.defined: set[str] = set()

    def fail(self, field: str, problem: str):
        raise ExportFormatError(f"{self.where}: {field}: {problem}")

    def check(self, doc) -> None:
        if not isinstance(doc, dict):
            self.fail("document", f"is {_json_type(doc)}, expected an object")
        for key in _TOP_FIELDS:
            if key not in doc:
                raise ExportFormatError(f"{self.where}: missing field {key!r}")
        unknown = sorted(set(doc) - set(_TOP_FIELDS))
        if unknown:
            self.fail(f"field {unknown[0]!r}", f"unknown in format_version {FORMAT_VERSION}")
        self.string("torch_version", doc["torch_version"])
        self.inputs(doc["inputs"])
        self.state(doc["state"])
        self.nodes(doc["nodes"])
        self.sequence("outputs", doc["outputs"], 1, 1024)
        for i, out in enumerate(doc["outputs"]):
            self.arg(f"outputs[{i}]", out, 0)
        self.files(doc["files"])

    def string(self, field: str, value, limit: int = _MAX_STR) -> str:
        if not isinstance(value, str) or len(value) > limit:
            self.fail(field, f"is {_json_type(value)}, expected a string of at most {limit} characters")
        return value

    def sequence(self, field: str, value, least: int, most: int) -> None:
        if not isinstance(value, list) or not least <= len(value) <= most:
            shown = f"an array of {len(value)}" if isinstance(value, list) else _json_type(value)
            self.fail(field, f"is {shown}, expected an array of {least} to {most} entries")

    def record(self, field: str, value, keys: set[str], optional: set[str] = frozenset()) -> None:
        if not isinstance(value, dict):
            self.fail(field, f"is {_json_type(value)}, expected an object with {', '.join(sorted(keys))}")
        missing, unknown = keys - set(value), set(value) - keys - optional
        if missing or unknown:
            self.fail(field, f"{'lacks' if missing else 'has unknown'} field {sorted(missing or unknown)[0]!r}")

    def name(self, field: str, value) -> None:
        if not isinstance(value, str) or not _NAME.fullmatch(value):
            self.fail(field, f"{value!r} is not a name (letters, digits, underscores)")
        if value in self.defined:
            self.fail(field, f"{value!r} is defined twice")

    def shape(self, field: str, value) -> None:
        self.sequence(field, value, 0, MAX_RANK)
        static = 1
        for d in value:
            if d is not None and not (_is_int(d) and 0 <= d <= MAX_ELEMENTS):
                self.fail(field, f"dimension {d!r} is not an integer in [0, {MAX_ELEMENTS}] or null")
            static *= 1 if d is None else d
        if static > MAX_ELEMENTS:
            self.fail(field, f"{value} has {static} elements, more than {MAX_ELEMENTS}")

    def dtype(self, field: str, value) -> None:
        if not isinstance(value, str) or value not in _DTYPES:
            self.fail(field, f"{value!r} is not a torch dtype name (float32, int64, ...)")

    def inputs(self, inputs) -> None:
        self.sequence("inputs", inputs, 0, 1024)
        for i, spec in enumerate(inputs):
            field = f"inputs[{i}]"
            self.record(field, spec, {"name", "shape", "dtype"})
            self.name(f"{field}.name", spec["name"])
            self.shape(f"{field}.shape", spec["shape"])
            self.dtype(f"{field}.dtype", spec["dtype"])
            self.defined.add(spec["name"])

    def state(self, state) -> None:
        if not isinstance(state, dict) or len(state) > MAX_NODES:
            self.fail("state", f"is {_json_type(state)}, expected an object of at most {MAX_NODES} tensors")
        for node_name, info in state.items():
            field = f"state[{node_name!r}]"
            self.name(field, node_name)
            self.record(field, info, {"tensor", "kind", "shape", "dtype"})
            self.string(f"{field}.tensor", info["tensor"], 1024)
            if info["kind"] not in _STATE_KINDS:
                self.fail(f"{field}.kind", f"{info['kind']!r} is not one of {', '.join(_STATE_KINDS)}")
            self.shape(f"{field}.shape", info["shape"])
            if None in info["shape"]:
                self.fail(f"{field}.shape", "a stored tensor has no dynamic dimension")
            self.dtype(f"{field}.dtype", info["dtype"])
            self.defined.add(node_name)

    def nodes(self, nodes) -> None:
        self.sequence("nodes", nodes, 0, MAX_NODES)
        for i, node in enumerate(nodes):
            field = f"nodes[{i}]"
            self.record(field, node, _NODE_FIELDS, {"shape", "dtype", "outputs"})
            self.name(f"{field}.name", node["name"])
            field = f"nodes[{i}] ({node['name']})"
            self.op(field, node)
            self.sequence(f"{field}.inputs", node["inputs"], 0, 64)
            for j, arg in enumerate(node["inputs"]):
                self.arg(f"{field}.inputs[{j}]", arg, 0)
            if not isinstance(node["kwargs"], dict) or len(node["kwargs"]) > 64:
                self.fail(f"{field}.kwargs", f"is {_json_type(node['kwargs'])}, expected an object")
            for key, arg in node["kwargs"].items():
                if not _NAME.fullmatch(key) or key.startswith("_"):
                    self.fail(f"{field}.kwargs", f"{key!r} is not an argument name")
                self.arg(f"{field}.kwargs[{key!r}]", arg, 0)
            self.node_meta(field, node)
            self.defined.add(node["name"])

    def op(self, field: str, node: dict) -> None:
        try:
            _resolve_op(node["op"])
        except ExportFormatError as exc:
            self.fail(f"{field}.op", str(exc))
        if node["op"] not in _OPERATORS:
            return
        arity = _PYTHON_ARITY.get(node["op"], 2)
        if node["kwargs"] or not isinstance(node["inputs"], list) or len(node["inputs"]) != arity or not all(
                _is_int(a) or isinstance(a, float) or isinstance(a, dict) and set(a) == {"node"}
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
        if _is_int(value):
            if not -_INT64 <= value < _INT64:
                self.fail(field, f"{value} does not fit 64 bits")
        elif isinstance(value, str):
            self.string(field, value)
        elif isinstance(value, list):
            if depth >= _MAX_DEPTH or len(value) > _MAX_LIST:
                self.fail(field, f"nests deeper than {_MAX_DEPTH} or holds more than {_MAX_LIST} entries")
            for j, v in enumerate(value):
                self.arg(f"{field}[{j}]", v, depth + 1)
        elif isinstance(value, dict):
            self.tagged(field, value)
        else:
            self.fail(field, f"is {_json_type(value)}")

    def tagged(self, field: str, value: dict) -> None:
        if len(value) != 1:
            self.fail(field, f"{value!r} is not an argument encoding (one of node, dtype, device, layout, "
                             f"memory_format, float)")
        (kind, name), = value.items()
        if kind == "node":
            if not isinstance(name, str) or name not in self.defined:
                self.fail(field, f"refers to {name!r}, which is not an input, parameter or earlier node")
        elif kind == "device":
            if not isinstance(name, str) or not _DEVICE.fullmatch(name):
                self.fail(field, f"{name!r} is not a device (cpu, cuda:0, ...)")
        elif kind in _DECODERS:
            if not isinstance(name, str) or name not in _DECODERS[kind]:
                self.fail(field, f"{name!r} is not a torch {kind} (one of {', '.join(_DECODERS[kind])})")
        else:
            self.fail(field, f"unknown argument encoding {kind!r}")

    def files(self, files) -> None:
        if not isinstance(files, dict) or PARAMS_FILE not in files:
            self.fail("files", f"is {_json_type(files)} without {PARAMS_FILE}, expected an object listing it")
        for name, entry in files.items():
            if name not in (PARAMS_FILE, PT2_FILE):
                self.fail("files", f"{name!r} is not a file of an export ({PARAMS_FILE}, {PT2_FILE})")
            self.record(f"files[{name!r}]", entry, {"sha256", "bytes"})
            if not isinstance(entry["sha256"], str) or not _SHA256.fullmatch(entry["sha256"]):
                self.fail(f"files[{name!r}].sha256", "is not 64 lowercase hex digits")
            if not _is_int(entry["bytes"]) or not 0 <= entry["bytes"] <= MAX_FILE_BYTES:
                self.fail(f"files[{name!r}].bytes", f"{entry['bytes']!r} is not a file size")


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


def _fsync_path(path: str) -> None:
    """Flush a file's or a directory's entries to disk (a rename is durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""``load(path)``: an export read back as a module, safe on directories from untrusted sources."""

from __future__ import annotations

import hashlib
import io
import math
import os
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import fx, nn

from .._io import decode_json, directory_to_read, read_bounded
from ..errors import DlperfError
from .export_aliasing import check_no_writes
from .export_format import (
    DTYPES_BY_NAME,
    FORMAT_NAME,
    GRAPH_FILE,
    INT64_LIMIT,
    MAX_GRAPH_BYTES,
    MAX_TRIAL_BYTES,
    OPERATORS,
    PARAMS_FILE,
    PT2_FILE,
    READABLE_VERSIONS,
    STAGING_TAG,
    TRIAL_DIM,
    ExportFormatError,
    content_hash,
    decode_value,
    describe_value,
    dtype_name,
    first_line,
    resolve_op,
)
from .export_schema import GraphSchema
from .export_tree import build, flat_tree, flatten_call, tree_text


class _Step(NamedTuple):
    name: str
    op: str
    fn: Any
    inputs: list
    kwargs: dict
    meta: dict
    places: bool = False
    """The operator creates a tensor on the ``device`` it is given: given none, it gets the graph's."""


def _places(fn: Any) -> bool:
    schema = getattr(fn, "_schema", None)
    return schema is not None and any(a.name == "device" and a.kwarg_only for a in schema.arguments)


class ExportedModule(nn.Module):
    """A loaded export: interprets the graph's ATen nodes over the saved tensors.

    The constructor validates ``doc`` and ``tensors`` and trial-runs the graph (see :func:`load`);
    ``forward`` checks the number, dtype and fixed dimensions of its inputs against the export.
    Hybridized (``hybridize(load(path))``, or as a layer of a hybridized model), the same program is
    replayed as a torch.fx graph (:meth:`graph_of_call`) instead of interpreted node by node.
    """

    def __init__(self, doc: dict, tensors: dict[str, torch.Tensor], *, where: str = GRAPH_FILE):
        super().__init__()
        GraphSchema(where).check(doc)
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
        self._program = [_Step(n["name"], n["op"], fn, n["inputs"], n["kwargs"],
                               {k: n[k] for k in ("shape", "dtype", "outputs") if k in n}, _places(fn))
                         for n in doc["nodes"] for fn in (resolve_op(n["op"]),)]
        self._inputs = doc["inputs"]
        self._outputs = doc["outputs"]
        self._input_tree = doc.get("input_tree", flat_tree(len(self._inputs)))
        self._output_tree = doc.get("output_tree")  # None: format 1, one tensor or a tuple
        check_no_writes(doc, [step.fn for step in self._program], where)
        self._trial_run(where)

    def forward(self, *args: Any) -> Any:
        """The model's call: the positional inputs it was exported with, in the same structure."""
        flat = flatten_call(self._input_tree, args, self._describe_input)
        self._check_inputs(tuple(flat))
        env: dict[str, object] = {spec["name"]: a for spec, a in zip(self._inputs, flat)}
        env.update((node_name, getattr(self, attr)) for node_name, attr in self._names.items())
        # Tensors the graph creates (LSTM's zero state) go where the inputs are, whatever device
        # the export was traced on.
        outs = self._interpret(env, flat[0].device if flat else torch.device("cpu"))
        return self._result(outs)

    def _result(self, outs: list) -> Any:
        """The call's result from the flat outputs, in the structure the model returned."""
        if self._output_tree is None:
            return outs[0] if len(outs) == 1 else tuple(outs)
        return build(self._output_tree, outs)

    def graph_of_call(self, args: tuple) -> tuple[fx.Graph, list, Callable[[list], Any]]:
        """This call as a torch.fx graph, for :func:`dlperf.hybrid.hybridize` to replay instead of interpreting.

        Returns the graph, the flat inputs its placeholders take in order, and the function that builds the
        call's result from the graph's flat outputs. The graph holds the validated program as it is
        interpreted: ``get_attr`` of this module's parameters and buffers, the recorded ATen operators
        with the same arguments, the Python operators through the same checks, and tensors the graph
        creates placed where the first input is. Building it runs nothing from the file.
        """
        flat = flatten_call(self._input_tree, args, self._describe_input)
        graph = fx.Graph()
        # torch.fx writes placeholder targets and keyword names into the Python it generates: the names
        # there are ours and the operators' own, never strings from the file.
        env: dict[str, Any] = {spec["name"]: graph.placeholder(f"input_{i}") for i, spec in enumerate(self._inputs)}
        env.update((node_name, graph.get_attr(attr)) for node_name, attr in self._names.items())
        first = env[self._inputs[0]["name"]] if self._inputs else None
        device = graph.call_function(_device_of, (first,)) if first is not None else torch.device("cpu")
        env["@device"] = device
        for step in self._program:
            args_ = tuple(decode_value(a, env) for a in step.inputs)
            if step.op in OPERATORS:
                env[step.name] = graph.call_function(_checked_operator, (step.name, step.op, *args_))
            else:
                kwargs = _kwargs(step, env)
                unknown = set(kwargs) - {a.name for a in step.fn._schema.arguments}
                if unknown:
                    raise ExportFormatError(f"node {step.name!r} ({step.op}): {sorted(unknown)[0]!r} is not an "
                                            "argument of the operator")
                env[step.name] = graph.call_function(step.fn, args_, kwargs)
        graph.output(tuple(decode_value(o, env) for o in self._outputs))
        if isinstance(device, fx.Node) and not device.users:
            graph.erase_node(device)
        return graph, flat, self._result

    def _describe_input(self, i: int) -> str:
        spec = self._inputs[i]
        return f"{spec['dtype']}[{','.join('N' if d is None else str(d) for d in spec['shape'])}]"

    @property
    def input_structure(self) -> str:
        """The call the export takes, in one line (``tuple(dict{ids: int64[N,32], mask: bool[N,32]})``)."""
        return tree_text(self._input_tree, self._describe_input)

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
                if not trial and step.op not in OPERATORS:
                    raise
                raise ExportFormatError(f"node {step.name!r} ({step.op}) fails{' in the trial run' if trial else ''}: "
                                        f"{type(exc).__name__}: {first_line(exc)}") from exc
            if trial:
                produced += _check_result(step, value)
                if limit is not None and produced > limit:
                    raise ExportFormatError(f"node {step.name!r} ({step.op}): the graph's results take more than "
                                            f"{limit} bytes")
            env[step.name] = value
        return [decode_value(o, env) for o in self._outputs]

    def _trial_run(self, where: str) -> None:
        """Run the graph with the declared input shapes, comparing every node's dtype and shape with its record.

        On the meta device (shapes only, no memory: the tensors the graph creates are made there too) with
        dynamic dimensions of ``TRIAL_DIM``, which bounds the results' size before any is allocated for real;
        again with a size that equals no fixed dimension of the graph, so
        that no broadcast or reshape works only by coincidence; then on zeros where the parameters
        are, because meta kernels skip some checks the real kernels make (an int64 input to
        ``linear``, say). A graph that loads must not fail in forward. That it writes into no input
        or parameter is proven before, for every shape, by :func:`check_no_writes`.
        """
        params_device = next((t.device for t in self._state_tensors()), torch.device("cpu"))
        meta = torch.device("meta")
        for device, dim, limit in ((meta, TRIAL_DIM, MAX_TRIAL_BYTES), (meta, _unlike_any_dimension(self.doc), None),
                                   (params_device, TRIAL_DIM, MAX_TRIAL_BYTES)):
            env = self._trial_env(where, device, dim)
            # A backstop for the static proof: writes show in version counters (views share their base's).
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

    def _trial_env(self, where: str, device: torch.device, dim: int) -> dict[str, Any]:
        env: dict[str, Any] = {}
        for spec in self._inputs:
            try:
                env[spec["name"]] = torch.zeros([dim if d is None else d for d in spec["shape"]],
                                                dtype=DTYPES_BY_NAME[spec["dtype"]], device=device)
            except Exception as exc:  # quantized and bit dtypes have no plain tensors
                raise ExportFormatError(f"{where}: input {spec['name']!r}: dtype {spec['dtype']} cannot be an input "
                                        f"({type(exc).__name__}: {first_line(exc)})") from exc
        env.update((name, getattr(self, attr).detach().to(device)) for name, attr in self._names.items())
        return env

    def _state_tensors(self):
        return (getattr(self, attr) for attr in self._names.values())

    def _apply(self, fn: Callable, recurse: bool = True) -> ExportedModule:
        # MXNet's SymbolBlock.cast changes the dtype the whole graph runs in. Here the graph's operators keep
        # the dtypes recorded at export (their dtype arguments, the inputs they take): parameters cast alone
        # would only make every call fail. So a cast is refused where it is asked for; moves between
        # devices go through.
        for t in self._state_tensors():
            if t.is_floating_point():
                cast = fn(torch.zeros((), dtype=t.dtype, device=t.device)).dtype
                if cast != t.dtype:
                    raise DlperfError(f"cannot cast a loaded export from {dtype_name(t.dtype)} to "
                                      f"{dtype_name(cast)}: its graph runs in the dtypes it was exported with; "
                                      f"export the model again as {dtype_name(cast)} (cast it before export)")
                break
        return super()._apply(fn, recurse)

    def _check_inputs(self, args: tuple) -> None:
        if len(args) != len(self._inputs):
            raise DlperfError(f"exported model takes {len(self._inputs)} inputs, got {len(args)}")
        for spec, a in zip(self._inputs, args):
            want = spec["shape"]
            ok = isinstance(a, torch.Tensor) and dtype_name(a.dtype) == spec["dtype"] and a.dim() == len(want) \
                and all(w is None or w == d for w, d in zip(want, a.shape))
            if not ok:
                got = f"{dtype_name(a.dtype)}{list(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
                shown = ["N" if w is None else w for w in want]
                raise DlperfError(f"input {spec['name']}: expected {spec['dtype']}{shown}, got {got}")

    def extra_repr(self) -> str:
        return f"{len(self._program)} nodes, format_version={self.doc['format_version']}"


def _call(step: _Step, env: dict):
    args = [decode_value(a, env) for a in step.inputs]
    if step.op not in OPERATORS:
        return step.fn(*args, **_kwargs(step, env))
    return _python_operator(step.name, step.op, *args)


def _kwargs(step: _Step, env: dict) -> dict:
    """A node's keyword arguments; a tensor it creates goes on the graph's device even where the node names none
    (ATen's default would be the CPU: in a trial run on the meta device, a real allocation of any size)."""
    kwargs = {k: decode_value(v, env) for k, v in step.kwargs.items()}
    if step.places and kwargs.get("device") is None:
        kwargs["device"] = env["@device"]
    return kwargs


def _python_operator(node_name: str, op: str, *args):
    # Python operators only ever see tensors and numbers (and getitem a node's tuple): a graph
    # cannot make them repeat a sequence a billion times or build an unbounded integer.
    operands = args[1:] if op == "operator.getitem" else args
    container_ok = op != "operator.getitem" or isinstance(args[0], (torch.Tensor, tuple, list))
    if not container_ok or not all(isinstance(a, (torch.Tensor, int, float)) for a in operands):
        raise ExportFormatError(f"node {node_name!r} ({op}) applied to "
                                f"{', '.join(type(a).__name__ for a in args)}; expected tensors or numbers")
    value = OPERATORS[op](*args)
    if isinstance(value, int) and not -INT64_LIMIT <= value < INT64_LIMIT:
        raise ExportFormatError(f"node {node_name!r} ({op}) gives {value}, beyond 64-bit integers")
    return value


def _checked_operator(node_name: str, op: str, *args):
    """A Python operator of a loaded graph replayed by torch.fx: the interpreter's checks, and its errors."""
    try:
        return _python_operator(node_name, op, *args)
    except ExportFormatError:
        raise
    except Exception as exc:  # as the interpreter says it: Python arithmetic on the graph's values is the file's
        raise ExportFormatError(f"node {node_name!r} ({op}) fails: {type(exc).__name__}: {first_line(exc)}") from exc


def _device_of(tensor: torch.Tensor) -> torch.device:
    """Where a replayed loaded graph creates its tensors: on its first input's device, as interpreted."""
    return tensor.device


def _check_result(step: _Step, value) -> int:
    """A trial-run value against the shape and dtype graph.json records for its node; its size in bytes."""
    meta = step.meta
    if "outputs" in meta:
        if not isinstance(value, (tuple, list)) or len(value) != len(meta["outputs"]):
            raise ExportFormatError(f"node {step.name!r} ({step.op}) gives {describe_value(value)}, "
                                    f"graph.json records {len(meta['outputs'])} outputs")
        return sum(_check_tensor(f"node {step.name!r} ({step.op}) output {i}", v, m)
                   for i, (v, m) in enumerate(zip(value, meta["outputs"])))
    return _check_tensor(f"node {step.name!r} ({step.op})", value, meta if "shape" in meta else None)


def _check_tensor(what: str, value, meta: dict | None) -> int:
    if meta is None:
        if not isinstance(value, (int, float, bool)) and value is not None:
            raise ExportFormatError(f"{what} gives {describe_value(value)}, graph.json records no tensor there")
        return 0
    want = f"{meta['dtype']}{['N' if d is None else d for d in meta['shape']]}"
    if not isinstance(value, torch.Tensor):
        raise ExportFormatError(f"{what} gives {describe_value(value)}, graph.json records {want}")
    fits = dtype_name(value.dtype) == meta["dtype"] and value.dim() == len(meta["shape"]) \
        and all(w is None or w == d for w, d in zip(meta["shape"], value.shape))
    if not fits:
        raise ExportFormatError(f"{what} gives {describe_value(value)}, graph.json records {want}")
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


def load(path: str | os.PathLike, device: torch.device | str = "cpu") -> ExportedModule:
    """Load an export written by :func:`export`; raises ExportFormatError on any damage.

    Safe on untrusted directories: see :mod:`dlperf.hybrid.export` for what is checked. Every problem
    is an :class:`ExportFormatError` raised here, not at the first forward call. The returned module
    needs no Python class of the original model.
    """
    try:
        return _load(path, device)
    except ExportFormatError:
        raise
    except Exception as exc:  # whatever a crafted file provokes is still a refusal of that file
        raise ExportFormatError(f"{os.fspath(path)}: cannot load: {type(exc).__name__}: {first_line(exc)}") from exc


def _load(path: str | os.PathLike, device: torch.device | str) -> ExportedModule:
    root = _export_root(path)
    graph_path = os.path.join(root, GRAPH_FILE)
    doc = _read_graph(graph_path)
    params_path = os.path.join(root, PARAMS_FILE)
    # The tensors come from the very bytes whose checksum was checked: a file changed, replaced or
    # swapped for a FIFO after the check cannot be what is loaded.
    data = _read_listed(params_path, doc["files"][PARAMS_FILE])
    try:
        from safetensors.torch import load as load_safetensors

        tensors = load_safetensors(data)  # each tensor in a writable buffer of its own
    except Exception as exc:
        raise ExportFormatError(f"{params_path}: unreadable safetensors file: {first_line(exc)}") from exc
    del data  # twice the file's size at most, and only until here
    tensors = {name: tensor.to(device) for name, tensor in tensors.items()}
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
    if expected is None:
        raise ExportFormatError(f"{path}: no {PT2_FILE} in this export (export with pt2=True)")
    data = _read_listed(pt2_path, expected)
    if trusted is not True:
        raise ExportFormatError(f"{pt2_path}: torch.export.load can run code embedded in a .pt2 file (it unpickles "
                                f"parts of it); pass trusted=True only for files you made or trust, or use "
                                f"dlperf.hybrid.load({os.fspath(path)!r}), which is safe on untrusted files")
    return torch.export.load(io.BytesIO(data))


def _export_root(path: str | os.PathLike) -> str:
    """The directory to read: ``path``, or the previous export a killed fallback swap moved aside."""
    return directory_to_read(os.path.realpath(os.fspath(path)), GRAPH_FILE, tag=STAGING_TAG)


def _read_graph(graph_path: str) -> dict:
    try:
        data = read_bounded(graph_path, MAX_GRAPH_BYTES, _not_a_graph)
    except FileNotFoundError as exc:
        raise ExportFormatError(f"{os.path.dirname(graph_path)}: missing {os.path.basename(graph_path)} "
                                f"({exc.strerror}); is this a dlperf export?") from exc
    except OSError as exc:
        raise ExportFormatError(f"{graph_path}: not a readable JSON graph ({type(exc).__name__}: "
                                f"{first_line(exc)})") from exc
    doc = decode_json(data, graph_path, lambda where, why: ExportFormatError(f"{where}: not a readable JSON graph "
                                                                             f"({why})"),
                      allow_nan=False, unique_keys=True)
    try:
        digest = content_hash(doc) if isinstance(doc, dict) else None
    except (ValueError, RecursionError) as exc:
        raise ExportFormatError(f"{graph_path}: not a readable JSON graph ({type(exc).__name__}: "
                                f"{first_line(exc)})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise ExportFormatError(f"{graph_path}: not a {FORMAT_NAME} file")
    version = doc.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise ExportFormatError(f"{graph_path}: format_version {version!r} is not supported (this dlperf reads "
                                f"versions {', '.join(map(str, READABLE_VERSIONS))}); re-export the model")
    if doc.get("content_sha256") != digest:
        raise ExportFormatError(f"{graph_path}: content checksum does not match (file was modified)")
    GraphSchema(graph_path).check(doc)
    return doc


def _not_a_graph(path: str, problem: str) -> ExportFormatError:
    return ExportFormatError(f"{path}: {problem}; expected the {GRAPH_FILE} of a dlperf export, a regular file of at "
                             f"most {MAX_GRAPH_BYTES} bytes (export the model again)")


def _read_listed(path: str, expected: dict) -> bytes:
    """The bytes of a file graph.json lists, read once through one descriptor (a FIFO or device is
    refused without waiting, never read), checked against the recorded size and SHA-256."""
    size, name = expected["bytes"], os.path.basename(path)

    def refuse(where: str, problem: str) -> ExportFormatError:
        return ExportFormatError(f"{where}: {problem}; expected the {name} that graph.json lists, a regular file "
                                 f"of {size} bytes (export the model again)")

    try:
        # The recorded size bounds the read: the tensors take that much memory once loaded anyway.
        data = read_bounded(path, size, refuse)
    except FileNotFoundError as exc:
        raise ExportFormatError(f"{os.path.dirname(path)}: missing {name} ({exc.strerror}), which graph.json "
                                f"lists; is this a whole dlperf export? (export the model again)") from exc
    except OSError as exc:
        raise refuse(path, f"unreadable ({type(exc).__name__}: {first_line(exc)})") from exc
    if len(data) != size or hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise ExportFormatError(f"{path}: checksum does not match graph.json ({len(data)} bytes, {size} recorded; "
                                f"truncated or modified); export the model again")
    return data


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
        if not isinstance(t, torch.Tensor) or list(t.shape) != info["shape"] or dtype_name(t.dtype) != info["dtype"]:
            raise ExportFormatError(f"{where}: parameter file: tensor {name!r} is {describe_value(t)}, "
                                    f"graph.json says {info['dtype']}{info['shape']}")



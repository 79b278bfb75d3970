"""``export(module, path, example_inputs)`` and ``load(path)``: a model that outlives its Python class.

An export is a directory: ``graph.json`` (the inputs, parameters and ATen nodes, with checksums),
``params.safetensors`` and, with ``pt2=True``, ``model.pt2``; it is written atomically as a whole. This module
writes; :mod:`.export_load` reads, checking every field of a directory that may come from an untrusted source
(:mod:`.export_format`, :mod:`.export_schema`, :mod:`.export_aliasing`). The format and what ``load``
guarantees: docs/design/export-format.md.

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

import errno
import json
import os
import warnings
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_map

from .._io import FileAccessError, atomic_directory, current_umask, no_space_error, tensor_bytes
from ..batch import map_tensors
from ..errors import DlperfError
from .export_format import (
    EXPORT_FILES,
    FORMAT_NAME,
    FORMAT_VERSION,
    GRAPH_FILE,
    MAX_ELEMENTS,
    MAX_FILE_BYTES,
    MAX_GRAPH_BYTES,
    MAX_NODES,
    MAX_RANK,
    MAX_TRIAL_BYTES,
    PARAMS_FILE,
    PT2_FILE,
    STAGING_TAG,
    TRIAL_DIM,
    ExportFormatError,
    content_hash,
    dtype_name,
    encode_value,
    layout_of,
    op_name,
    sha256_file,
)
from .export_load import ExportedModule, load, load_pt2
from .export_tree import check_inputs_are_tensors, tree_of_spec

__all__ = ["EXPORT_FILES", "FORMAT_NAME", "FORMAT_VERSION", "GRAPH_FILE", "MAX_ELEMENTS", "MAX_FILE_BYTES",
           "MAX_GRAPH_BYTES", "MAX_NODES", "MAX_RANK", "MAX_TRIAL_BYTES", "PARAMS_FILE", "PT2_FILE", "TRIAL_DIM",
           "ExportCheckError", "ExportFormatError", "ExportedModule", "export", "load", "load_pt2", "reproduces",
           "CHECK_RTOL", "CHECK_ATOL"]


def export(module: nn.Module, path: str | os.PathLike, example_inputs: tuple | list | dict | torch.Tensor, *,
           dynamic_batch: bool = True, pt2: bool = False) -> dict[str, str]:
    """Write ``module``'s inference graph and parameters to the directory ``path``.

    ``path`` is replaced as a whole, atomically: it must not exist, or be empty, or hold only a
    previous export's files (anything else there would be lost, so it is refused).

    Args:
        example_inputs: the inputs of a forward call; they fix structure, dtypes and shapes. A tuple
            (or list) holds the positional inputs, a tensor or a dict is the one input; inside them
            tensors of any dtype may be nested in tuples, lists and dicts (``({"ids": ids, "mask":
            mask},)``). The loaded module takes the same call and returns the model's structure
            (dict keys included; namedtuples come back as tuples).
        dynamic_batch: let dimension 0 of every input tensor vary (kept static if the model needs it).
        pt2: also write ``model.pt2`` (``torch.export.save``) for PyTorch tools that read
            ExportedPrograms (AOTInductor, ExecuTorch); :func:`load` does not need it.

    Returns:
        The paths written, ``{"graph": ..., "params": ...}`` (and ``"pt2"``).

    Before anything is written, the files are loaded back (:func:`load`) and the example is run through them
    and through ``module``: a batch left dynamic that the graph pins after all is exported fixed, and an export
    that still would not load, or not reproduce the module within float tolerance, is not written.

    Raises:
        DlperfError: the module cannot be exported, or holds weights that are not finite.
        ExportCheckError: its export would not load back or reproduce it; nothing was written.
        FileAccessError: the files cannot be written (a full disk names the space needed).
    """
    from .hybridize import HybridModule

    if isinstance(module, HybridModule):
        module = module.module
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    check_inputs_are_tensors(args)
    target = _export_target(path)
    _check_finite(module)
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    # A batch left dynamic that the graph still pins (x.expand(2, 4)) traces, but its export would not load:
    # then the batch is fixed, as when tracing itself needs it.
    for dynamic in (True, False) if dynamic_batch else (False,):
        program = _export_program(module, args, dynamic)
        doc, tensors = _describe(program, state)
        if len(doc["nodes"]) > MAX_NODES:
            raise DlperfError(f"cannot export {type(module).__name__}: its graph has {len(doc['nodes'])} nodes, and "
                              f"load reads at most {MAX_NODES} (each costs load a trial run)")
        try:
            with atomic_directory(target, tag=STAGING_TAG) as staging:
                _write_files(staging, doc, tensors, program if pt2 else None)
                _check_loads_back(module, staging, args)  # before the swap: what load refuses is never written
            break
        except _DoesNotLoad as exc:
            if dynamic:
                continue
            raise ExportCheckError(f"cannot export {type(module).__name__}: {exc}; nothing was written") \
                from exc.__cause__
        except Exception as exc:
            full = _full_disk(exc, target, doc, tensors, pt2, os.fspath(path))
            if full is None:
                raise
            raise full from exc
    written = {"graph": os.path.join(path, GRAPH_FILE), "params": os.path.join(path, PARAMS_FILE)}
    if pt2:
        written["pt2"] = os.path.join(path, PT2_FILE)
    return written


# The export replays the same ATen kernels in the same order, so float32 outputs normally agree
# bit for bit; the tolerance only absorbs kernel choices that depend on the batch (dynamic shapes).
CHECK_RTOL = 1e-4
CHECK_ATOL = 1e-5


class ExportCheckError(DlperfError):
    """The export of a module would not load back, or would not reproduce the module on its example: nothing
    was written (the check ``dlperf export`` makes after writing, made before)."""


class _DoesNotLoad(Exception):
    """The files written would not load, or would not reproduce the module on its example."""


def _check_loads_back(module: nn.Module, directory: str, args: tuple) -> None:
    """Load the export in ``directory`` and run the example through it and through ``module`` (in eval mode):
    :class:`_DoesNotLoad` unless it loads and reproduces the module (:func:`reproduces`)."""
    from ..batch import tensors_of

    first = next(iter(tensors_of(args)), None)
    try:
        loaded = load(directory, first.device if first is not None else "cpu")  # where the example is
    except ExportFormatError as exc:
        raise _DoesNotLoad(f"its export would not load back ({str(exc).split(': ', 1)[-1]})") from exc
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            got, want = loaded(*args), module(*args)
    except Exception as exc:  # noqa: BLE001 - the export's or the module's own error: either way no export
        raise _DoesNotLoad(f"its export does not run the example ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from exc
    finally:
        module.train(was_training)
    worst, matches = reproduces(got, want)
    if not matches:
        raise _DoesNotLoad(f"its export does not reproduce the model on the example (max difference {worst:.3g}, "
                           f"tolerance rtol={CHECK_RTOL:g} atol={CHECK_ATOL:g})")


def reproduces(got: Any, want: Any) -> tuple[float, bool]:
    """(max absolute difference, whether ``got`` matches ``want``): the same structure, every tensor of the same
    shape and dtype, finite on both sides (NaN or inf would match anything or nothing) and within tolerance."""
    from ..batch import describe, tensors_of

    # outputs may be structures (an LSTM's output and state): every tensor in the same place (a namedtuple
    # comes back a tuple)
    got_tensors, want_tensors = list(tensors_of(got)), list(tensors_of(want))
    pairs = list(zip(got_tensors, want_tensors))
    if describe(got) != describe(_as_loaded(want)) or not pairs or len(got_tensors) != len(want_tensors):
        return float("inf"), False
    worst = max(((g - w).abs().max().item() if g.numel() and g.shape == w.shape else 0.0) for g, w in pairs)
    return worst, all(_close(g, w) for g, w in pairs)


def _as_loaded(tree: Any, depth: int = 0) -> Any:
    """``tree`` as a loaded export returns it: namedtuples become tuples."""
    if depth > 100:
        return tree
    if isinstance(tree, tuple):
        return tuple(_as_loaded(t, depth + 1) for t in tree)
    if isinstance(tree, list):
        return [_as_loaded(t, depth + 1) for t in tree]
    if isinstance(tree, dict):
        return {k: _as_loaded(v, depth + 1) for k, v in tree.items()}
    return tree


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return False
    return bool(torch.allclose(got, want, rtol=CHECK_RTOL, atol=CHECK_ATOL))


def _check_finite(module: nn.Module) -> None:
    """Refuse NaN or infinite parameters (and NaN buffers; -inf is a usual attention mask): the
    export would compute NaN, and its check against the model could not tell it from a faithful copy."""
    tensors: list[tuple[str, str, torch.Tensor, bool]] = [
        ("parameter", n, t, True) for n, t in module.named_parameters()]
    tensors += [("buffer", n, t, False) for n, t in module.named_buffers()]
    for kind, name, t, strict in tensors:
        if not (t.is_floating_point() or t.is_complex()):
            continue
        with torch.no_grad():
            bad = ~torch.isfinite(t) if strict else torch.isnan(t)
            count = int(bad.sum())
        if count:
            raise DlperfError(f"cannot export {type(module).__name__}: {kind} {name!r} holds {count} "
                              f"{'non-finite' if strict else 'NaN'} value{'s' if count > 1 else ''} "
                              f"(of {t.numel()}); export weights that are finite (retrain or load other weights)")


def _full_disk(exc: BaseException, target: str, doc: dict, tensors: dict[str, torch.Tensor], pt2: bool,
               shown: str) -> FileAccessError | None:
    """A one-line error for an export that ran out of space, or None if ``exc`` is something else.

    safetensors and torch's zip writer do not raise OSError (``SafetensorError: ... No space left``,
    ``RuntimeError: ... unexpected pos``), so a failure is also taken as a full disk when the file
    system now has less room than the export needs.
    """
    needed = (tensor_bytes(tensors) or 0) * (2 if pt2 else 1)
    needed += len(json.dumps(doc)) + (64 << 10)  # graph.json, the safetensors header and file-system slack
    try:
        st = os.statvfs(os.path.dirname(target))
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    text = str(exc)
    spaceless = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT) \
        or "No space left on device" in text or "Disk quota exceeded" in text \
        or (free is not None and free < needed)
    if not spaceless:
        return None
    err = exc.errno if isinstance(exc, OSError) and exc.errno == errno.EDQUOT else errno.ENOSPC
    return no_space_error(shown, needed, err, kept="the previous export", free=free, estimated=True)


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


def _write_files(staging: str, doc: dict, tensors: dict[str, torch.Tensor], program: Any) -> None:
    """Write the export's files into the new directory ``staging`` (flushed and swapped in by the caller)."""
    from safetensors.torch import save_file

    save_file(tensors, os.path.join(staging, PARAMS_FILE),
              metadata={"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)})
    names = [PARAMS_FILE]
    if program is not None:
        torch.export.save(program, os.path.join(staging, PT2_FILE))
        names.append(PT2_FILE)
    for name in names:
        # safetensors creates its file 0600; an export is as readable as any file
        os.chmod(os.path.join(staging, name), 0o666 & ~current_umask())
    doc["files"] = {name: {"sha256": sha256_file(os.path.join(staging, name)),
                           "bytes": os.path.getsize(os.path.join(staging, name))} for name in names}
    doc["content_sha256"] = content_hash(doc)
    with open(os.path.join(staging, GRAPH_FILE), "xb") as f:
        f.write(layout_of(doc).encode())


def _export_program(module: nn.Module, args: tuple, dynamic_batch: bool):
    was_training = module.training
    module.eval()
    try:
        with warnings.catch_warnings():
            # nn.LSTM re-assigns its flat weight list during tracing; torch warns, harmlessly here.
            warnings.simplefilter("ignore", UserWarning)
            if dynamic_batch:
                dims = tree_map(lambda a: {0: torch.export.Dim.AUTO} if a.dim() > 0 else None, args)
                # A batch of 1 would be specialized (size-1 dimensions broadcast), so trace with
                # the example repeated; only shapes and dtypes are taken from it.
                traced = map_tensors(lambda a: torch.cat([a, a]) if a.dim() > 0 and a.shape[0] == 1 else a, args)
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


def _describe(program, state: dict) -> tuple[dict, dict[str, torch.Tensor]]:
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
                                      "shape": list(tensor.shape), "dtype": dtype_name(tensor.dtype)}
        elif node.op == "call_function" and _is_metadata_assert(node):
            continue
        elif node.op == "call_function":
            nodes.append({"name": node.name, "op": op_name(node.target),
                          "inputs": [encode_value(a) for a in node.args],
                          "kwargs": {k: encode_value(v) for k, v in node.kwargs.items()},
                          **_meta(node, dynamic_ok=True)})
        elif node.op == "output":
            outputs = [encode_value(a) for a in node.args[0]]
        else:
            raise DlperfError(f"cannot export graph node {node.op} {node.target}")
    call = program.call_spec
    args_spec = call.in_spec.child(0)  # (args, kwargs): export passes no kwargs
    doc = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "torch_version": torch.__version__,
           "inputs": inputs, "outputs": outputs, "input_tree": tree_of_spec(args_spec, "inputs"),
           "output_tree": tree_of_spec(call.out_spec, "outputs"), "state": state_nodes, "nodes": nodes}
    return doc, tensors


def _is_metadata_assert(node: fx.Node) -> bool:
    """A check torch.export leaves after a dtype cast (``mask.float()``): it produces nothing, and what it
    checks (the dtype and device of a value the graph itself computed) the loader's trial runs check."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "aten" \
        and target._opname == "_assert_tensor_metadata" and not node.users


def _meta(node: fx.Node, dynamic_ok: bool) -> dict:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        shape = [d if isinstance(d, int) else None for d in val.shape]
        return {"shape": shape, "dtype": dtype_name(val.dtype)}
    if isinstance(val, (tuple, list)):
        return {"outputs": [_meta_value(v) for v in val]}
    return {}


def _meta_value(v) -> dict | None:
    if isinstance(v, torch.Tensor):
        return {"shape": [d if isinstance(d, int) else None for d in v.shape], "dtype": dtype_name(v.dtype)}
    return None


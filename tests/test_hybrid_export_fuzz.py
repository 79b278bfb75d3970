"""Property-based attacks on real exports: every mutated export is refused with ExportFormatError or
loads and runs, and nothing a payload names ever happens.

The attacker edits graph.json (and the parameter file) structurally, then recomputes the file
checksums and the content checksum, so only load's validation stands in the way.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dlperf.hybrid import export, load
from dlperf.hybrid.export import ExportFormatError
from dlperf.hybrid.export_tree import build

export_mod = importlib.import_module("dlperf.hybrid.export_format")

MODELS = ("mlp", "lenet")
# What a shell payload would create; it must never appear.
CANARY = Path(tempfile.gettempdir()) / f"dlperf-export-fuzz-{os.getpid()}.canary"
PAYLOAD = f"touch {CANARY}"

# Real operators a mutation may name: resolved before the snapshot of torch.ops.aten is taken.
VALID_OPS = ["aten.relu.default", "aten.relu_.default", "aten.sigmoid.default", "aten.tanh.default",
             "aten.linear.default", "aten.conv2d.default", "aten.add.Tensor", "aten.mul.Tensor",
             "aten.flatten.using_ints", "aten.view.default", "aten.sym_size.int", "aten.zeros.default",
             "aten.max_pool2d.default", "aten.avg_pool2d.default", "aten.t.default", "aten.sum.default",
             "operator.getitem", "operator.mul", "operator.add", "operator.floordiv", "operator.neg"]
ATTACK_OPS = ["aten.__setattr__.__call__", "aten.__getattr__.os", "aten.add.system", "aten.relu.__call__",
              "aten.relu.default.__globals__", "aten._ops.default", "aten.save.default", "aten.from_file.default",
              "aten.warn.default", "aten.Delete.default", "aten.name.default", "aten.__dict__.clear",
              "aten.sparse_coo_tensor.indices", "os.system.default", "torch.ops.aten.relu.default",
              "operator.attrgetter", "builtins.eval.default", "aten..default", "", "aten.Relu.default",
              "aten.relu", "aten.relu.default.extra", "aten.add.system\x00", "aten.ｒelu.default"]
ATTACK_VALUES = ["os", "__builtins__", PAYLOAD, "__class__", "system", "float", "Tensor", "", "float64", "int64",
                 "bfloat16", "bool", "strided", "sparse_coo", "channels_last", "cpu", "cuda:99", "meta",
                 "inf", "1e999", "nan", None, 3, 1.5, True, [], {}, ["float32"]]
ENCODING_KINDS = ["node", "dtype", "device", "layout", "memory_format", "float", "__class__", "eval"]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    from dlperf.models import get_spec

    refs = _Quiet()
    for name in MODELS:
        torch.manual_seed(0)
        spec = get_spec(name)
        model = spec.build().eval()
        x, _ = spec.input.make_batch(3, generator=torch.Generator().manual_seed(1))
        path = tmp_path_factory.mktemp(name)
        export(model, path, (x,))
        with torch.no_grad():
            want = model(x)
            torch.testing.assert_close(load(path)(x), want)
        refs[name] = {"doc": json.loads((path / "graph.json").read_text()),
                      "params": (path / "params.safetensors").read_bytes(), "x": x, "want": want}
    for op in VALID_OPS:
        export_mod.resolve_op(op)
    return refs


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    assert not CANARY.exists()
    return tmp_path_factory.mktemp("fuzz")


class _Quiet(dict):
    """The reference exports; a failing example's report shows its draws, not megabytes of parameters."""

    def __repr__(self):
        return f"<reference exports of {', '.join(self)}>"


# --- mutations: each edits (doc, params) in place and says whether the computation is unchanged -----

def _tensor_specs(doc):
    """Every {"shape", "dtype"} record in the document, as (container, key) pairs for dtype edits."""
    specs = [spec for spec in doc["inputs"]] + list(doc["state"].values())
    specs += [n for n in doc["nodes"] if "dtype" in n]
    specs += [o for n in doc["nodes"] for o in n.get("outputs", []) if o]
    return specs


def _arguments(doc):
    """(container, key) for every argument slot of every node, nested lists included."""
    slots = []

    def walk(container, key):
        slots.append((container, key))
        value = container[key]
        if isinstance(value, list):
            for i in range(len(value)):
                walk(value, i)

    for node in doc["nodes"]:
        for i in range(len(node["inputs"])):
            walk(node["inputs"], i)
        for k in node["kwargs"]:
            walk(node["kwargs"], k)
    return slots


def _paths(value, prefix=()):
    """Every location in a JSON value, for a blind type-confusion edit."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False) | st.text(max_size=12) | st.sampled_from(ATTACK_VALUES[:6]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(ENCODING_KINDS) | st.text(max_size=5),
                                                                  inner, max_size=2),
    max_leaves=8)


def mutate_op(data, doc, params):
    node = data.draw(st.sampled_from(doc["nodes"]))
    new = data.draw(st.sampled_from(VALID_OPS + ATTACK_OPS))
    if data.draw(st.booleans()):
        node["inputs"] = data.draw(st.lists(st.sampled_from(_attack_arguments(doc)), max_size=3))
    preserving = new == node["op"] or {new, node["op"]} == {"aten.relu.default", "aten.relu_.default"}
    node["op"] = new
    return params, preserving


def _attack_arguments(doc):
    return [PAYLOAD, "relu", "linear", "system", 0, {"node": doc["inputs"][0]["name"]}, {"dtype": "float32"},
            {"dtype": "os"}]


def mutate_exploit(data, doc, params):
    """The shapes of the observed exploits: overwrite an attribute of torch.ops.aten, then call through it."""
    node = data.draw(st.sampled_from(doc["nodes"]))
    victim = data.draw(st.sampled_from(["relu", "linear", "add", "conv2d", "system"]))
    node["op"] = data.draw(st.sampled_from(["aten.__setattr__.__call__", "aten.__dict__.__setitem__",
                                            f"aten.{victim}.system", f"aten.{victim}.__call__",
                                            "aten.__getattr__.__call__", f"aten.{victim}.__class__"]))
    node["inputs"] = [victim, data.draw(st.sampled_from(_attack_arguments(doc)))]
    if data.draw(st.booleans()):
        node["inputs"] = [PAYLOAD]
    return params, False


def mutate_dtype(data, doc, params):
    spec = data.draw(st.sampled_from(_tensor_specs(doc)))
    new = data.draw(st.sampled_from(ATTACK_VALUES))
    preserving = new == spec["dtype"]
    spec["dtype"] = new
    return params, preserving


def mutate_encoding(data, doc, params):
    container, key = data.draw(st.sampled_from(_arguments(doc)))
    kind = data.draw(st.sampled_from(ENCODING_KINDS))
    container[key] = {kind: data.draw(st.sampled_from(ATTACK_VALUES))}
    return params, False


def mutate_reference(data, doc, params):
    refs = [(c, k) for c, k in _arguments(doc) if isinstance(c[k], dict) and "node" in c[k]]
    if not refs:
        return params, True
    container, key = data.draw(st.sampled_from(refs))
    names = [n["name"] for n in doc["nodes"]] + list(doc["state"]) + [i["name"] for i in doc["inputs"]]
    target = data.draw(st.sampled_from(names + ["nowhere", "@device", "__class__", ""]))
    preserving = container[key]["node"] == target
    container[key] = {"node": target}
    return params, preserving


def mutate_nodes(data, doc, params):
    nodes = doc["nodes"]
    how = data.draw(st.sampled_from(["delete", "duplicate", "swap", "move-output"]))
    i = data.draw(st.integers(0, len(nodes) - 1))
    j = data.draw(st.integers(0, len(nodes) - 1))
    if how == "delete":
        del nodes[i]
    elif how == "duplicate":
        nodes.insert(j, copy.deepcopy(nodes[i]))
    elif how == "swap":
        nodes[i], nodes[j] = nodes[j], nodes[i]
    else:
        doc["outputs"] = [{"node": nodes[i]["name"]}]
    return params, (how == "swap" and i == j) or (how == "move-output" and i == len(nodes) - 1)


def mutate_rename(data, doc, params):
    """A consistent rename of one node: the same computation under another name."""
    index = data.draw(st.integers(0, len(doc["nodes"]) - 1))
    old = doc["nodes"][index]["name"]
    new = data.draw(st.sampled_from(["renamed", "x_1", "_private", "input", "relu", "p_0_bias"]))
    taken = {n["name"] for n in doc["nodes"]} | set(doc["state"]) | {i["name"] for i in doc["inputs"]}
    text = json.dumps(doc).replace(json.dumps({"node": old}), json.dumps({"node": new}))
    fresh = json.loads(text)
    fresh["nodes"][index]["name"] = new
    doc.clear()
    doc.update(fresh)
    return params, new == old or new not in taken


def mutate_files(data, doc, params):
    how = data.draw(st.sampled_from(["drop", "traversal", "pt2", "bytes", "sha"]))
    files = doc["files"]
    if how == "drop":
        files.clear()
    elif how == "traversal":
        files["../../etc/passwd"] = files["params.safetensors"]
    elif how == "pt2":
        files["model.pt2"] = files["params.safetensors"]
        return params, True  # load does not read model.pt2
    elif how == "bytes":
        files["params.safetensors"]["bytes"] = data.draw(json_values)
    else:
        files["params.safetensors"]["sha256"] = data.draw(st.sampled_from(["", "0" * 64, "G" * 64, None]))
    return params, False


def mutate_shape(data, doc, params):
    spec = data.draw(st.sampled_from(_tensor_specs(doc)))
    spec["shape"] = data.draw(st.sampled_from(
        [[1 << 40], [None] * 100, [10 ** 6, 10 ** 6], [-1, 3], [2.5], ["3"], None, 7, [None, None], [],
         [1 << 62, 1 << 62], [True, 3]]))
    return params, False


def mutate_literal(data, doc, params):
    slots = [(c, k) for c, k in _arguments(doc) if not isinstance(c[k], (dict, list))]
    if not slots:
        return params, True
    container, key = data.draw(st.sampled_from(slots))
    container[key] = data.draw(json_values)
    return params, False


def mutate_blind(data, doc, params):
    """Replace any location of the document with any JSON value."""
    path = data.draw(st.sampled_from(list(_paths(doc))[1:]))
    container = doc
    for step in path[:-1]:
        container = container[step]
    container[path[-1]] = data.draw(json_values)
    return params, False


def mutate_params(data, doc, params):
    how = data.draw(st.sampled_from(["truncate", "flip", "empty", "header", "other-shapes"]))
    if not params:
        return params, False
    if how == "truncate":
        return params[: data.draw(st.integers(0, len(params) - 1))], False
    if how == "flip":
        pos = data.draw(st.integers(0, len(params) - 1))
        return params[:pos] + bytes([params[pos] ^ 0xFF]) + params[pos + 1:], False
    if how == "empty":
        return b"", False
    if how == "header":  # a header that claims a huge tensor
        header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 30, 1 << 30], "data_offsets": [0, 4]}}).encode()
        return len(header).to_bytes(8, "little") + header + b"\0" * 4, False
    from safetensors.torch import save

    return save({info["tensor"]: torch.zeros(2, 2) for info in doc["state"].values()}), False


# Operators whose result may share memory with their first argument, with the rest of their arguments
# ("@" stands for the first argument again); they work on a tensor of any shape.
ALIASING = [("aten.view.default", [[-1]]), ("aten.reshape.default", [[-1]]), ("aten.contiguous.default", []),
            ("aten.flatten.using_ints", []), ("aten.alias.default", []), ("aten.detach.default", []),
            ("aten.squeeze.default", []), ("aten.unsqueeze.default", [0]), ("aten.expand_as.default", ["@"]),
            ("aten.as_strided.default", [[1], [1]]), ("aten.dropout.default", [0.0, False]),
            ("aten.type_as.default", ["@"]), ("aten.unflatten.int", [0, [1, -1]]), ("aten.unbind.int", [])]
# (operator, arguments after the written one, keyword arguments naming the written one)
WRITING = [("aten.add_.Tensor", [1.0], None), ("aten.mul_.Tensor", [2.0], None), ("aten.fill_.Scalar", [3.0], None),
           ("aten.zero_.default", [], None), ("aten.copy_.default", ["@"], None), ("aten.neg.out", [], "out"),
           ("aten.clamp_.default", [0.0], None), ("aten.abs.out", [], "out")]
METADATA = [("aten.detach_.default", []), ("aten.requires_grad_.default", [True]), ("aten.t_.default", []),
            ("aten.unsqueeze_.default", [0]), ("aten.squeeze_.default", []), ("aten.resize_.default", [[1]]),
            ("aten.as_strided_.default", [[1], [1]]), ("aten.transpose_.default", [0, 0]),
            ("aten.swapdims_.default", [0, 0]), ("aten.retain_grad.default", []),
            ("aten.resize_as_.default", ["@"])]


def _roots(doc):
    return [spec["name"] for spec in doc["inputs"]] + list(doc["state"])


def _alias_chain(data, doc, target, at):
    """Nodes taking views of ``target`` one after another; the last one's name."""
    nodes = []
    for k in range(data.draw(st.integers(0, 3), label="aliasing ops")):
        op, rest = data.draw(st.sampled_from(ALIASING))
        name = f"alias_{at}_{k}"
        args = [{"node": target}] + [{"node": target} if a == "@" else copy.deepcopy(a) for a in rest]
        nodes.append({"name": name, "op": op, "inputs": args, "kwargs": {}})
        target = name
        if op == "aten.unbind.int":
            nodes.append({"name": f"{name}_0", "op": "operator.getitem", "inputs": [{"node": name}, 0], "kwargs": {}})
            target = f"{name}_0"
    return nodes, target


def mutate_alias_write(data, doc, params):
    """A write, through a chain of views and may-alias ops, into an input or a parameter."""
    victim = data.draw(st.sampled_from(_roots(doc)))
    at = data.draw(st.integers(0, len(doc["nodes"])))
    nodes, target = _alias_chain(data, doc, victim, at)
    op, rest, out = data.draw(st.sampled_from(WRITING))
    ref = {"node": target}
    if out is None:
        args = [ref] + [ref if a == "@" else copy.deepcopy(a) for a in rest]
        write = {"name": f"write_{at}", "op": op, "inputs": args, "kwargs": {}}
    else:
        write = {"name": f"write_{at}", "op": op, "inputs": [ref], "kwargs": {out: ref}}
    doc["nodes"][at:at] = nodes + [write]
    doc.setdefault("@refusal", r"may write into '\w+', an input or parameter")
    return params, False


def mutate_metadata(data, doc, params):
    """An in-place change of metadata, on an input, a parameter or a view of one."""
    victim = data.draw(st.sampled_from(_roots(doc)))
    at = data.draw(st.integers(0, len(doc["nodes"])))
    nodes, target = _alias_chain(data, doc, victim, at)
    op, rest = data.draw(st.sampled_from(METADATA))
    args = [{"node": target}] + [{"node": target} if a == "@" else copy.deepcopy(a) for a in rest]
    doc["nodes"][at:at] = nodes + [{"name": f"meta_{at}", "op": op, "inputs": args, "kwargs": {}}]
    doc.setdefault("@refusal", "changes a tensor's metadata in place")
    return params, False


# Structure trees as an attacker writes them: the allowed kinds and others, leaves of any number, odd keys.
tree_values = st.recursive(
    st.integers(min_value=-2, max_value=6) | json_values,
    lambda inner: st.dictionaries(st.sampled_from(["tuple", "list", "__class__", "eval"]), st.lists(inner, max_size=4),
                                  min_size=1, max_size=2)
    | st.builds(lambda body: {"dict": body}, st.dictionaries(st.text(max_size=6) | st.sampled_from(ATTACK_VALUES[:4]),
                                                             inner, max_size=3)),
    max_leaves=10)


def mutate_tree(data, doc, params):
    """Replace the input or output structure (or a part of it) with any tree."""
    field = data.draw(st.sampled_from(["input_tree", "output_tree"]))
    tree = doc[field]
    if isinstance(tree, dict) and data.draw(st.booleans(), label="replace a child"):
        (kind, body), = tree.items()
        slots = list(body) if isinstance(body, dict) else list(range(len(body)))
        if slots:
            body[data.draw(st.sampled_from(slots))] = data.draw(tree_values)
            return params, False
    doc[field] = data.draw(tree_values)
    return params, False


# Operators that create a tensor of a size their arguments give (after the size, the rest of their arguments).
FACTORIES = [("aten.zeros.default", []), ("aten.ones.default", []), ("aten.empty.memory_format", []),
             ("aten.full.default", [1.5]), ("aten.rand.default", []), ("aten.randn.default", []),
             ("aten.empty_strided.default", ["strides"])]
FACTORY_SIDES = [2, 3, 1000, 32768, 65536, 1 << 20, 1 << 31]  # float32 squares of 16 B to 16 EiB


def mutate_factory(data, doc, params):
    """A node creating a tensor of a drawn size, with or without a device, its record true or not."""
    op, rest = data.draw(st.sampled_from(FACTORIES))
    side = data.draw(st.sampled_from(FACTORY_SIDES), label="side")
    size = [side, side]
    args = [size] + [[side, 1] if a == "strides" else a for a in rest]
    kwargs = data.draw(st.sampled_from([{}, {"device": {"device": "cpu"}}, {"dtype": {"dtype": "float32"}}]))
    shape = data.draw(st.sampled_from([size, [2, 2], [None, None]]), label="recorded shape")
    at = data.draw(st.integers(0, len(doc["nodes"])))
    doc["nodes"].insert(at, {"name": f"made_{at}", "op": op, "inputs": args, "kwargs": kwargs, "shape": shape,
                             "dtype": "float32"})
    return params, side * side * 4 <= REAL_BYTES_ALLOWED and shape == size


MUTATIONS = [mutate_exploit, mutate_op, mutate_dtype, mutate_encoding, mutate_reference, mutate_nodes, mutate_rename,
             mutate_files, mutate_shape, mutate_literal, mutate_blind, mutate_params, mutate_alias_write,
             mutate_metadata, mutate_tree, mutate_factory]

REAL_BYTES_ALLOWED = 64 << 20
"""Loading these small models allocates far less for real; more, before the trial run on the meta device refused
it, is an allocation the file chose."""


class _RealAllocation(BaseException):
    """Raised by the guard, past load's own handlers, where a factory would allocate too much for real."""


class _AllocationGuard(torch.utils._python_dispatch.TorchDispatchMode):
    """Sizes every tensor an operator creates off the meta device (on the meta device) before it is made."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        creates = any(a.name == "device" and a.kwarg_only for a in func._schema.arguments)
        if creates and (device is None or torch.device(device).type != "meta"):
            made = func(*args, **{**kwargs, "device": torch.device("meta")})
            nbytes = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(made)
                         if isinstance(t, torch.Tensor))
            if nbytes > REAL_BYTES_ALLOWED:
                raise _RealAllocation(f"{func} would allocate {nbytes} bytes on {device or 'the CPU'}")
        return func(*args, **kwargs)


def _aten_state():
    return torch.ops.aten.__class__, dict(vars(torch.ops.aten))


def _assert_aten_unchanged(before):
    cls, attrs = before
    now = vars(torch.ops.aten)
    assert torch.ops.aten.__class__ is cls
    for key, value in attrs.items():
        assert now.get(key) is value, f"torch.ops.aten.{key} changed"
    for key in set(now) - set(attrs):  # torch's own cache filling in a real operator is the only addition
        assert isinstance(now[key], torch._ops.OpOverloadPacket) and now[key]._qualified_op_name == f"aten::{key}"
    for op in (torch.ops.aten.add.Tensor, torch.ops.aten.linear.default, torch.ops.aten.relu.default):
        assert isinstance(op, torch._ops.OpOverload)


def _example_inputs(module):
    xs = []
    for spec in module.doc["inputs"]:
        shape = [3 if d is None else d for d in spec["shape"]]
        dtype = export_mod.DTYPES_BY_NAME[spec["dtype"]]
        xs.append(torch.randn(shape).to(dtype) if dtype.is_floating_point or dtype.is_complex
                  else torch.zeros(shape, dtype=dtype))
    return xs


def _run_and_check_untouched(module, inputs):
    """Run a loaded export: the caller's inputs and the parameters keep their values and flags."""
    kept = [(x.clone(), x.requires_grad, x.shape, x.stride()) for x in inputs]
    state = {n: (t.detach().clone(), t.requires_grad, t.shape) for n, t in module.state_dict(keep_vars=True).items()}
    try:
        module(*build(module._input_tree, inputs))  # the call in the structure graph.json declares
    except ExportFormatError:
        event("loaded, refused in forward")
    for x, (value, grad, shape, stride) in zip(inputs, kept):
        assert (x.requires_grad, x.shape, x.stride()) == (grad, shape, stride)
        torch.testing.assert_close(x, value, rtol=0, atol=0, equal_nan=True)
    for n, t in module.state_dict(keep_vars=True).items():
        value, grad, shape = state[n]
        assert (t.requires_grad, t.shape) == (grad, shape), n
        torch.testing.assert_close(t.detach(), value, rtol=0, atol=0, equal_nan=True)


def _attack(data, references, root, mutations=MUTATIONS, max_mutations=3):
    name = data.draw(st.sampled_from(MODELS))
    ref = references[name]
    doc, params = copy.deepcopy(ref["doc"]), ref["params"]
    preserving = True
    drawn = data.draw(st.lists(st.sampled_from(mutations), min_size=1, max_size=max_mutations))
    for mutation in drawn:
        try:
            params, kept = mutation(data, doc, params)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError):
            kept = False  # an earlier mutation broke the structure this one edits; the document stays as is
        preserving = preserving and kept
    # An aliasing trick alone must be refused by the write check itself, not by whatever else fails.
    refusal = doc.pop("@refusal", None) if isinstance(doc, dict) else None
    refusal = refusal if len(drawn) == 1 else None
    for entry in list(doc["files"].values()) if isinstance(doc.get("files"), dict) else []:
        if isinstance(entry, dict) and data.draw(st.booleans(), label="recompute file checksum"):
            entry.update(sha256=hashlib.sha256(params).hexdigest(), bytes=len(params))
    doc["content_sha256"] = export_mod.content_hash(doc)
    directory = tempfile.mkdtemp(dir=root)
    try:
        with open(os.path.join(directory, "graph.json"), "w") as f:
            f.write(json.dumps(doc, indent=1))
        with open(os.path.join(directory, "params.safetensors"), "wb") as f:
            f.write(params)
        before = _aten_state()
        try:
            with _AllocationGuard():
                module = load(directory)
        except ExportFormatError as exc:
            event(f"refused: {str(exc).split(': ', 1)[-1][:40]}")
            if refusal is not None:
                assert re.search(refusal, str(exc)), str(exc)
            module = None
        assert refusal is None or module is None, "an aliasing trick loaded"
        if module is not None:
            with torch.no_grad():
                inputs = _example_inputs(module)
                _run_and_check_untouched(module, inputs)
                event("loaded and ran" + (", same results" if preserving else ""))
                if preserving:
                    torch.testing.assert_close(module(ref["x"]), ref["want"])
        _assert_aten_unchanged(before)
        assert not CANARY.exists()
    finally:
        shutil.rmtree(directory)


@pytest.mark.timeout(120)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_exports_are_refused_or_run(references, workspace, data):
    _attack(data, references, workspace)


@pytest.mark.timeout(120)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_aliasing_tricks_are_refused_by_the_write_check(references, workspace, data):
    _attack(data, references, workspace, mutations=[mutate_alias_write, mutate_metadata], max_mutations=1)


@pytest.mark.timeout(120)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_factory_ops_of_any_size_allocate_nothing_real_before_they_are_sized(references, workspace, data):
    _attack(data, references, workspace, mutations=[mutate_factory], max_mutations=2)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                    HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_exports_are_refused_or_run_many(references, workspace, data):
    _attack(data, references, workspace)

"""Crafted exports that would write into the caller's tensors or the parameters, or change their
metadata: refused at load whatever the shapes, while graphs that write only into their own results
load and compute what eager PyTorch computes.

The attacker edits graph.json and recomputes every checksum, so only load's checks stand in the way.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from torch import nn

from dlperf.hybrid import export, load
from dlperf.hybrid.export import ExportFormatError
from dlperf.hybrid.export_format import content_hash, decode_value, dtype_name, resolve_op
from dlperf.models import get_spec

aliasing = importlib.import_module("dlperf.hybrid.export_aliasing")
export_load = importlib.import_module("dlperf.hybrid.export_load")


class _Affine(nn.Module):
    """x * w + b, with a running-statistics buffer: one input, two parameters, one buffer."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.b = nn.Parameter(torch.randn(4))
        self.register_buffer("rm", torch.zeros(4))

    def forward(self, x):
        return x * self.w + self.b + self.rm


X_SHAPE = (3, 4)


@pytest.fixture()
def base(tmp_path):
    torch.manual_seed(0)
    model = _Affine().eval()
    export(model, tmp_path, (torch.randn(*X_SHAPE),), dynamic_batch=False)
    doc = json.loads((tmp_path / "graph.json").read_text())
    assert [spec["name"] for spec in doc["inputs"]] == ["x"]
    assert set(doc["state"]) == {"p_w", "p_b", "b_rm"}
    return model, tmp_path, doc


def _env(model, x):
    return {"x": x, "p_w": model.w.detach(), "p_b": model.b.detach(), "b_rm": model.rm, "@device": x.device}


def _craft(path, doc, nodes, output):
    """Replace the graph's nodes with ``nodes`` (name, op, inputs, kwargs) and recompute every checksum.

    Each node's recorded shape and dtype come from running it eagerly on copies of the tensors, so a
    graph that should load is refused by nothing but the write check.
    """
    model_env = {"x": torch.randn(*X_SHAPE), "p_w": torch.randn(4), "p_b": torch.randn(4), "b_rm": torch.zeros(4),
                 "@device": torch.device("cpu")}
    doc = json.loads(json.dumps(doc))
    doc["nodes"] = []
    for name, op, inputs, kwargs in nodes:
        node = {"name": name, "op": op, "inputs": inputs, "kwargs": kwargs}
        try:
            fn = resolve_op(op)
            value = fn(*decode_value(inputs, model_env), **{k: decode_value(v, model_env) for k, v in kwargs.items()})
        except (RuntimeError, ExportFormatError):
            value = None
        if isinstance(value, torch.Tensor):
            node.update(shape=list(value.shape), dtype=dtype_name(value.dtype))
        elif isinstance(value, (tuple, list)):
            node["outputs"] = [{"shape": list(v.shape), "dtype": dtype_name(v.dtype)} for v in value]
        model_env[name] = value
        doc["nodes"].append(node)
    doc["outputs"] = [{"node": output}]
    doc["content_sha256"] = content_hash(doc)
    (path / "graph.json").write_text(json.dumps(doc))


def N(name):
    return {"node": name}


# --- writes into an input or a parameter, through every kind of alias -----------------------------

WRITES = {
    # the observed exploit: contiguous() returns its argument only when it is already contiguous
    "transpose-contiguous-add_": ([("t", "aten.transpose.int", [N("x"), 0, 1], {}),
                                   ("c", "aten.contiguous.default", [N("t")], {}),
                                   ("a", "aten.add_.Tensor", [N("c"), 100.0], {})], "x"),
    "expand-bias-add_": ([("e", "aten.expand.default", [N("p_b"), [3, 4]], {}),
                          ("c", "aten.contiguous.default", [N("e")], {}),
                          ("a", "aten.add_.Tensor", [N("c"), 1.0], {})], "p_b"),
    "view-add_": ([("v", "aten.view.default", [N("x"), [12]], {}),
                   ("a", "aten.add_.Tensor", [N("v"), 1.0], {})], "x"),
    "reshape-copy_": ([("r", "aten.reshape.default", [N("x"), [12]], {}),
                       ("z", "aten.zeros.default", [[12]], {}),
                       ("a", "aten.copy_.default", [N("r"), N("z")], {})], "x"),
    "as_strided-mul_": ([("s", "aten.as_strided.default", [N("p_w"), [2, 2], [1, 1]], {}),
                         ("a", "aten.mul_.Tensor", [N("s"), 3.0], {})], "p_w"),
    "slice-select-fill_": ([("s", "aten.slice.Tensor", [N("x"), 0, 1, 3], {}),
                            ("e", "aten.select.int", [N("s"), 0, 0], {}),
                            ("a", "aten.fill_.Scalar", [N("e"), 7.0], {})], "x"),
    "split-getitem-add_": ([("s", "aten.split.Tensor", [N("x"), 1], {}),
                            ("g", "operator.getitem", [N("s"), 0], {}),
                            ("a", "aten.add_.Tensor", [N("g"), 1.0], {})], "x"),
    "buffer-add_": ([("a", "aten.add_.Tensor", [N("b_rm"), 1.0], {})], "b_rm"),
    "out=input": ([("a", "aten.add.out", [N("p_w"), N("p_w")], {"out": N("x")})], "x"),
    "out=expand-of-parameter": ([("e", "aten.expand.default", [N("p_b"), [3, 4]], {}),
                                 ("a", "aten.mul.out", [N("x"), N("x")], {"out": N("e")})], "p_b"),
    "out=view-positional-kwarg": ([("v", "aten.view.default", [N("p_w"), [2, 2]], {}),
                                   ("a", "aten.abs.out", [N("v")], {"out": N("v")})], "p_w"),
    # compositions whose schema promises nothing: dropout and type_as return their argument
    "dropout-eval-add_": ([("d", "aten.dropout.default", [N("x"), 0.5, False], {}),
                           ("a", "aten.add_.Tensor", [N("d"), 1.0], {})], "x"),
    "type_as-add_": ([("d", "aten.type_as.default", [N("p_b"), N("p_b")], {}),
                      ("a", "aten.add_.Tensor", [N("d"), 1.0], {})], "p_b"),
    "flatten-add_": ([("f", "aten.flatten.using_ints", [N("x")], {}),
                      ("a", "aten.add_.Tensor", [N("f"), 1.0], {})], "x"),
    "alias-in-list-index_put_": ([("i", "aten.zeros.default", [[1]], {"dtype": {"dtype": "int64"}}),
                                  ("v", "aten.zeros.default", [[1, 4]], {}),
                                  ("a", "aten.index_put_.default", [N("x"), [N("i")], N("v")], {})], "x"),
    # batch_norm's schema does not say it updates the running statistics in training mode
    "batch_norm-training": ([("n", "aten.batch_norm.default",
                              [N("x"), None, None, N("b_rm"), N("p_w"), True, 0.1, 1e-5, False], {})], "b_rm"),
}


@pytest.mark.parametrize("case", list(WRITES))
def test_writes_into_inputs_or_parameters_are_refused_at_load(base, case):
    model, path, doc = base
    nodes, victim = WRITES[case]
    _craft(path, doc, nodes, nodes[-1][0])
    with pytest.raises(ExportFormatError, match=f"may write into '{victim}', an input or parameter"):
        load(path)


def test_the_reported_exploit_on_a_dynamic_batch_is_refused(tmp_path):
    """forward(zeros(1, 512)) used to leave the caller's x.sum() == 51200: the trial runs used other batches."""
    torch.manual_seed(0)
    export(get_spec("mlp").build().eval(), tmp_path, (torch.randn(2, 512),))
    doc = json.loads((tmp_path / "graph.json").read_text())
    name = doc["inputs"][0]["name"]
    doc["nodes"][:0] = [
        {"name": "t", "op": "aten.transpose.int", "inputs": [N(name), 0, 1], "kwargs": {}, "shape": [512, None],
         "dtype": "float32"},
        {"name": "c", "op": "aten.contiguous.default", "inputs": [N("t")], "kwargs": {}, "shape": [512, None],
         "dtype": "float32"},
        {"name": "a", "op": "aten.add_.Tensor", "inputs": [N("c"), 100], "kwargs": {}, "shape": [512, None],
         "dtype": "float32"}]
    doc["content_sha256"] = content_hash(doc)
    (tmp_path / "graph.json").write_text(json.dumps(doc))
    with pytest.raises(ExportFormatError, match=f"node 'a' .*may write into '{name}'"):
        load(tmp_path)


# --- metadata changed in place ----------------------------------------------------------------------

METADATA = {
    "detach_-parameter": [("a", "aten.detach_.default", [N("p_w")], {})],
    "requires_grad_-input": [("a", "aten.requires_grad_.default", [N("x"), True], {})],
    "requires_grad_-parameter": [("a", "aten.requires_grad_.default", [N("p_b"), False], {})],
    "retain_grad": [("a", "aten.retain_grad.default", [N("x")], {})],
    "transpose_-own-result": [("r", "aten.relu.default", [N("x")], {}), ("a", "aten.transpose_.default",
                                                                          [N("r"), 0, 1], {})],
    "t_": [("a", "aten.t_.default", [N("x")], {})],
    "squeeze_": [("a", "aten.squeeze_.default", [N("p_w")], {})],
    "unsqueeze_": [("a", "aten.unsqueeze_.default", [N("p_w"), 0], {})],
    "swapdims_": [("a", "aten.swapdims_.default", [N("x"), 0, 1], {})],
    "as_strided_": [("a", "aten.as_strided_.default", [N("x"), [2], [1]], {})],
    "resize_": [("r", "aten.relu.default", [N("x")], {}), ("a", "aten.resize_.default", [N("r"), [100]], {})],
    "resize_as_": [("a", "aten.resize_as_.default", [N("p_b"), N("x")], {})],
}


@pytest.mark.parametrize("case", list(METADATA))
def test_in_place_metadata_changes_are_refused_outright(base, case):
    model, path, doc = base
    nodes = METADATA[case]
    _craft(path, doc, nodes, nodes[-1][0])
    x = torch.randn(*X_SHAPE)
    with pytest.raises(ExportFormatError, match="changes a tensor's metadata in place"):
        load(path)
    assert model.w.requires_grad and model.b.requires_grad and not x.requires_grad


def test_set_is_not_even_an_operator_a_graph_may_name(base):
    model, path, doc = base
    _craft(path, doc, [("a", "aten.set_.source_Tensor", [N("p_w"), N("x")], {})], "a")
    with pytest.raises(ExportFormatError, match="reaches beyond tensors"):
        load(path)


# --- writes into the graph's own results: loaded, and the same as eager ------------------------------

OWN_WRITES = {
    "relu-then-add_": [("r", "aten.relu.default", [N("x")], {}), ("a", "aten.add_.Tensor", [N("r"), N("p_b")], {})],
    "clone-contiguous-add_": [("c", "aten.clone.default", [N("x")], {}),
                              ("t", "aten.transpose.int", [N("c"), 0, 1], {}),
                              ("k", "aten.contiguous.default", [N("t")], {}),
                              ("a", "aten.mul_.Tensor", [N("k"), 3.0], {})],
    "out=fresh": [("z", "aten.zeros.default", [[3, 4]], {"device": {"device": "cpu"}}),
                  ("a", "aten.mul.out", [N("x"), N("p_w")], {"out": N("z")})],
    "linear-relu_": [("e", "aten.expand.default", [N("p_w"), [4, 4]], {}),
                     ("l", "aten.linear.default", [N("x"), N("e"), N("p_b")], {}),
                     ("a", "aten.relu_.default", [N("l")], {})],
    "batch_norm-eval-relu_": [("n", "aten.batch_norm.default",
                               [N("x"), N("p_w"), N("p_b"), N("b_rm"), N("b_rm"), False, 0.1, 1e-5, False], {}),
                              ("a", "aten.relu_.default", [N("n")], {})],
}


def _eager(nodes, env):
    for name, op, inputs, kwargs in nodes:
        fn = resolve_op(op)
        env[name] = fn(*decode_value(inputs, env), **{k: decode_value(v, env) for k, v in kwargs.items()})
    return env[nodes[-1][0]]


@pytest.mark.parametrize("case", list(OWN_WRITES))
def test_writes_into_own_results_load_and_match_eager(base, case):
    model, path, doc = base
    nodes = OWN_WRITES[case]
    _craft(path, doc, nodes, nodes[-1][0])
    loaded = load(path)
    params = {n: t.clone() for n, t in loaded.named_parameters()} | {n: t.clone() for n, t in loaded.named_buffers()}
    for _ in range(3):
        x = torch.randn(*X_SHAPE)
        kept = x.clone()
        with torch.no_grad():
            got = loaded(x)
            want = _eager(nodes, _env(model, x.clone()))
        torch.testing.assert_close(got, want)
        assert torch.equal(x, kept)
    for n, t in list(loaded.named_parameters()) + list(loaded.named_buffers()):
        assert torch.equal(t, params[n]), n


# --- the trust list of compositions: their results are always new --------------------------------

def _samples():
    x4 = torch.randn(2, 3, 8, 8)
    w = torch.randn(4, 3, 3, 3)
    seq = torch.randn(2, 5, 3)
    return {
        "conv1d": (torch.randn(2, 3, 8), torch.randn(4, 3, 3)), "conv2d": (x4, w),
        "conv3d": (torch.randn(1, 3, 4, 4, 4), torch.randn(2, 3, 1, 1, 1)),
        "conv_transpose1d": (torch.randn(2, 3, 8), torch.randn(3, 4, 3)),
        "conv_transpose2d": (x4, torch.randn(3, 4, 1, 1)),
        "conv_transpose3d": (torch.randn(1, 3, 2, 2, 2), torch.randn(3, 2, 1, 1, 1)),
        "linear": (torch.randn(3, 4), torch.eye(4)),
        "batch_norm": (x4, None, None, torch.zeros(3), torch.ones(3), False, 0.1, 1e-5, False),
        "instance_norm": (x4, None, None, None, None, True, 0.1, 1e-5, False),
        "layer_norm": (x4, [8]), "group_norm": (x4, 1),
        "max_pool1d": (torch.randn(2, 3, 8), [1]), "max_pool2d": (x4, [1, 1]), "max_pool3d": (x4, [1, 1, 1]),
        "adaptive_avg_pool1d": (torch.randn(2, 3, 8), [8]), "adaptive_avg_pool2d": (x4, [8, 8]),
        "adaptive_avg_pool3d": (x4, [3, 8, 8]),
        "lstm": (seq, [torch.zeros(1, 2, 2), torch.zeros(1, 2, 2)],
                 [torch.randn(8, 3), torch.randn(8, 2)], False, 1, 0.0, False, False, True),
        "gru": (seq, torch.zeros(1, 2, 2), [torch.randn(6, 3), torch.randn(6, 2)], False, 1, 0.0, False, False, True),
        "rnn_tanh": (seq, torch.zeros(1, 2, 2), [torch.randn(2, 3), torch.randn(2, 2)], False, 1, 0.0, False, False,
                     True),
        "rnn_relu": (seq, torch.zeros(1, 2, 2), [torch.randn(2, 3), torch.randn(2, 2)], False, 1, 0.0, False, False,
                     True),
    }


def _storages(value):
    if isinstance(value, torch.Tensor):
        return {value.untyped_storage().data_ptr()} if value.numel() else set()
    if isinstance(value, (list, tuple)):
        return set().union(*(_storages(v) for v in value)) if value else set()
    return set()


@pytest.mark.parametrize("name", sorted(aliasing._NEW_RESULT_COMPOSITES))
def test_trusted_compositions_return_new_tensors_even_where_they_could_return_the_input(name):
    """Sizes chosen so that returning the argument would be a correct result (1x1 kernels, identity
    pools): a composition that took that shortcut would alias, and must not be on the list."""
    args = _samples()[name]
    packet = getattr(torch.ops.aten, name)
    op = packet.default if "default" in packet.overloads() else getattr(packet, packet.overloads()[0])
    if name in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
        op = packet.input
    with torch.no_grad():
        result = op(*args)
    assert not _storages(result) & _storages(list(args)), name


# --- every load failure is an ExportFormatError --------------------------------------------------

@pytest.mark.parametrize("dtype", ["qint8", "quint8", "qint32", "bits8", "uint1"])
def test_inputs_of_dtypes_without_plain_tensors_are_refused(base, dtype):
    model, path, doc = base
    doc = json.loads(json.dumps(doc))
    doc["inputs"][0]["dtype"] = dtype
    doc["content_sha256"] = content_hash(doc)
    (path / "graph.json").write_text(json.dumps(doc))
    with pytest.raises(ExportFormatError, match=f"inputs\\[0\\].dtype: {dtype} is not a dtype of plain tensors"):
        load(path)


# --- load time: linear in the nodes, bounded by MAX_NODES -------------------------------------------

def _chain(tmp_path, n):
    export(nn.ReLU(), tmp_path, (torch.randn(2, 4),))
    doc = json.loads((tmp_path / "graph.json").read_text())
    first, prev, nodes = doc["nodes"][0], doc["inputs"][0]["name"], []
    for i in range(n):
        nodes.append(dict(first, name=f"r{i}", inputs=[N(prev)]))
        prev = f"r{i}"
    doc["nodes"], doc["outputs"] = nodes, [N(prev)]
    doc["content_sha256"] = content_hash(doc)
    (tmp_path / "graph.json").write_text(json.dumps(doc))


def _work_to_load(tmp_path, n, monkeypatch):
    """(kernel calls, schema look-ups) that loading a chain of n nodes takes."""
    calls = {"kernels": 0}
    real_call = export_load._call

    def counting(step, env):
        calls["kernels"] += 1
        return real_call(step, env)

    _chain(tmp_path / str(n), n)  # (export loads its own files back: that is not the work counted here)
    monkeypatch.setattr(export_load, "_call", counting)
    from dlperf.hybrid import export_format

    export_format._resolve_valid_name.cache_clear()
    loaded = load(tmp_path / str(n))
    with torch.no_grad():
        x = torch.randn(5, 4)
        torch.testing.assert_close(loaded(x), torch.relu(x))
    return calls["kernels"] - 1 * n, export_format._resolve_valid_name.cache_info().misses


def test_load_work_is_linear_in_the_nodes(tmp_path, monkeypatch):
    """Three trial runs of one kernel call per node, and one dispatcher look-up per distinct operator:
    no per-node cost grows with the graph (the time per node is given in docs/export.md)."""
    small = _work_to_load(tmp_path, 50, monkeypatch)
    large = _work_to_load(tmp_path, 200, monkeypatch)
    assert small == (3 * 50, 1) and large == (3 * 200, 1)


def test_more_nodes_than_the_limit_are_refused_before_anything_runs(tmp_path, monkeypatch):
    from dlperf.hybrid.export_format import MAX_NODES

    _chain(tmp_path, MAX_NODES + 1)
    monkeypatch.setattr(export_load, "_call", lambda step, env: pytest.fail("ran a node"))
    with pytest.raises(ExportFormatError, match=f"nodes: is an array of {MAX_NODES + 1}"):
        load(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_maximal_export_loads(tmp_path):
    from dlperf.hybrid.export_format import MAX_NODES

    _chain(tmp_path, MAX_NODES)
    loaded = load(tmp_path)
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), torch.relu(x))

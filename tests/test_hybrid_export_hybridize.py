"""hybridize(load(path)): a loaded export replays its graph as a hybridized in-memory model does, never eagerly."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dlperf.hybrid import ExportedModule, ExportFormatError, HybridizeWarning, export, hybridize, load
from dlperf.models import get_spec
from test_hybrid_export_structure import DictInDictOut, _assert_same_structure, _dict_batch


@pytest.fixture
def interpreted(monkeypatch):
    """How many calls went through the loaded module's own interpreter (its eager path)."""
    calls = [0]
    interpret = ExportedModule._interpret

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return interpret(self, *args, **kwargs)

    monkeypatch.setattr(ExportedModule, "_interpret", counting)
    return calls


def _exported(tmp_path, name, batch):
    torch.manual_seed(0)
    spec = get_spec(name)
    model = spec.build().eval()
    export(model, tmp_path, (spec.input.make_batch(batch)[0],))
    return spec, model, load(tmp_path)


@pytest.mark.parametrize("name,backend", [("mlp", "auto"), ("mlp", "native"), ("mlp", "graph"),
                                          ("lenet", "auto"), ("lenet", "graph")])
def test_a_loaded_export_replays_its_graph(tmp_path, interpreted, name, backend):
    spec, model, loaded = _exported(tmp_path, name, 3)
    net = hybridize(loaded, backend=backend)
    g = torch.Generator().manual_seed(5)

    def check(x, got):
        torch.testing.assert_close(got, loaded(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)

    with torch.no_grad():
        x = spec.input.make_batch(4, generator=g)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("error", HybridizeWarning)  # a fallback to eager would warn
            check(x, net(x))
        for batch in (4, 4, 7, 7):
            x = spec.input.make_batch(batch, generator=g)[0]
            known = any(k[0][0] == batch for k in net.choices)
            before = interpreted[0]
            if known:
                got = net(x)
                replayed = "eager" not in {c.backend for c in net.choices.values()}
                assert interpreted[0] == before or not replayed, "a prepared signature must replay, not interpret"
            else:
                with pytest.warns(HybridizeWarning, match="signature changed"):
                    got = net(x)
            check(x, got)
    assert net.state == "replay" and len(net.choices) == 2
    chosen = {c.backend for c in net.choices.values()}
    if backend == "auto":  # it times the replays against the interpreter and keeps the fastest, named
        assert all(c.backend != "eager" or " vs graph " in c.reason for c in net.choices.values()), repr(net)
    else:
        assert chosen == {backend}, repr(net)


def test_training_through_a_hybridized_loaded_export_has_eagers_gradients(tmp_path, interpreted):
    spec, _, loaded = _exported(tmp_path, "lenet", 2)
    net = hybridize(loaded, backend="graph")
    g = torch.Generator().manual_seed(9)
    x, y = spec.input.make_batch(6, generator=g)
    net(x)  # prepares the autograd signature
    before = interpreted[0]
    loss = spec.loss(net(x), y)
    grads = torch.autograd.grad(loss, list(loaded.parameters()))
    assert interpreted[0] == before
    expected = torch.autograd.grad(spec.loss(loaded(x), y), list(loaded.parameters()))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_loaded_export_with_dict_inputs_and_outputs_replays(tmp_path, interpreted):
    g = torch.Generator().manual_seed(2)
    model = DictInDictOut().eval()
    export(model, tmp_path, _dict_batch(4, g))
    loaded = load(tmp_path)
    net = hybridize(loaded, backend="graph")
    with torch.no_grad():
        net(_dict_batch(5, g))
        fresh = _dict_batch(5, g)
        before = interpreted[0]
        got = net(fresh)
        assert interpreted[0] == before
        _assert_same_structure(got, loaded(fresh))
        _assert_same_structure(got, model(fresh))
    # a structured call is served by one flat-input hybrid per structure, as for an in-memory model
    assert {c.backend for c in net.choices.values()} == {"graph"} and "state='replay'" in repr(net), repr(net)


def test_a_loaded_export_inside_a_model_is_copied_into_its_graph(tmp_path, interpreted):
    spec, model, loaded = _exported(tmp_path, "mlp", 2)
    outer = nn.Sequential(nn.Linear(512, 512), loaded, nn.Softmax(dim=-1))
    net = hybridize(outer, backend="graph")
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        x = torch.randn(3, 512, generator=g)
        net(x)
        before = interpreted[0]
        torch.testing.assert_close(net(x), torch.softmax(model(outer[0](x)), -1), rtol=1e-4, atol=1e-6)
        assert interpreted[0] == before
    assert net.state == "replay"


def test_names_from_the_file_never_reach_the_generated_code(tmp_path, interpreted):
    """torch.fx writes placeholder names into Python source; the file's input names must not be those names."""
    from test_hybrid_export import _rewrite

    spec, model, _ = _exported(tmp_path, "mlp", 2)

    def rename(doc):
        old = doc["inputs"][0]["name"]
        doc["inputs"][0]["name"] = "lambda"  # a valid graph.json name, and a Python keyword
        for node in doc["nodes"]:
            node["inputs"] = [{"node": "lambda"} if a == {"node": old} else a for a in node["inputs"]]

    _rewrite(tmp_path, rename)
    loaded = load(tmp_path)
    net = hybridize(loaded, backend="graph")
    x = torch.randn(4, 512)
    with torch.no_grad():
        net(x)
        torch.testing.assert_close(net(x), model(x), rtol=1e-4, atol=1e-5)
    assert net.state == "replay"
    graph_module = next(iter(net.choices.values())).run.__self__
    assert "lambda" not in graph_module.code and "input_0" in graph_module.code


def test_keyword_names_must_be_the_operators_own(tmp_path):
    from test_hybrid_export import _rewrite

    _, _, loaded = _exported(tmp_path, "mlp", 2)
    # A node whose keywords the operator does not take cannot load (the trial run calls it) ...
    _rewrite(tmp_path, lambda d: d["nodes"][1].update(kwargs={"evil": 1}))
    with pytest.raises(ExportFormatError):
        load(tmp_path)
    # ... and the graph builder checks them again, whatever passed before it.
    loaded._program[1] = loaded._program[1]._replace(kwargs={"evil": 1})
    with pytest.raises(ExportFormatError, match="'evil' is not an argument"):
        loaded.graph_of_call((torch.randn(2, 512),))


def test_python_operators_and_created_tensors_replay_as_interpreted(tmp_path, interpreted):
    """LSTM's export: operator.getitem on the LSTM's results, zero states made on the input's device."""
    spec, model, loaded = _exported(tmp_path, "lstm", 2)
    net = hybridize(loaded, backend="graph")
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        net(spec.input.make_batch(3, generator=g)[0])
        x = spec.input.make_batch(3, generator=g)[0]
        before = interpreted[0]
        got = net(x)
        assert interpreted[0] == before
        torch.testing.assert_close(got, loaded(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)
    code = next(iter(net.choices.values())).run.__self__.code
    assert "_checked_operator" in code and "_device_of" in code


@pytest.mark.parametrize("args, match", [(("ab", 10 ** 9), "applied to str, int"), ((1, 0), "ZeroDivisionError"),
                                         ((1 << 62, 4), "beyond 64-bit")])
def test_replayed_python_operators_keep_the_interpreters_checks(args, match):
    from dlperf.hybrid.export_load import _checked_operator

    op = "operator.floordiv" if args == (1, 0) else "operator.mul"
    with pytest.raises(ExportFormatError, match=f"node 'n' \\({op}\\).*{match}"):
        _checked_operator("n", op, *args)


def test_a_wrong_input_is_the_loaded_modules_own_error_and_replay_goes_on(tmp_path):
    from dlperf.errors import DlperfError

    spec, model, loaded = _exported(tmp_path, "mlp", 2)
    net = hybridize(loaded, backend="graph")
    for bad in (torch.randn(3, 511), torch.randn(3, 512, dtype=torch.float64)):
        with pytest.raises(DlperfError, match="expected float32\\['N', 512\\]"), torch.no_grad():
            net(bad)
    x = torch.randn(3, 512)
    with torch.no_grad():
        torch.testing.assert_close(net(x), model(x), rtol=1e-4, atol=1e-5)
    assert net.state == "replay" and {c.backend for c in net.choices.values()} == {"graph"}

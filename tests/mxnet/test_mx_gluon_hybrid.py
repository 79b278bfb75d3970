"""What MXNet 1.9.1's tests/python/unittest/test_gluon.py expects of hybridized blocks, asked of dlperf's hybridize.

``test_hybrid_stale_cache``: a block changed after its first hybridized call (a layer appended, a child
replaced) computes with its new structure. ``check_layer_forward`` (test_batchnorm, test_instancenorm,
test_layernorm, ...): a layer hybridized alone gives the eager output and input gradient. And a forward
whose parameter has a default is captured when the call leaves it out, as a HybridBlock's is.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from dlperf.hybrid import HybridizeWarning, hybridize


def _quietly(fn, *args):
    """``fn(*args)`` and the HybridizeWarnings it gave."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [str(w.message) for w in seen if issubclass(w.category, HybridizeWarning)]


def _served_by_a_graph(net) -> bool:
    return net.state == "replay" and bool(net.choices) and all(c.backend != "eager" for c in net.choices.values())


# -- test_hybrid_stale_cache ----------------------------------------------------------------------------
def test_a_layer_appended_after_capture_is_computed():
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(5, 10))
    net = hybridize(body, backend="graph")
    x = torch.ones(2, 3, 5)
    assert net(x).shape == (2, 3, 10)
    body.append(nn.Flatten())
    out, said = _quietly(net, x)
    assert out.shape == (2, 30)
    torch.testing.assert_close(out, body(x))
    assert len(said) == 1 and "changed since it was captured (layer 1 set); capturing it again" in said[0]
    assert _served_by_a_graph(net)
    _, again = _quietly(net, x)
    assert again == []  # said once


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 10)
        self.fc2 = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


def test_a_replaced_child_is_computed():
    torch.manual_seed(0)
    body = TwoLayers()
    net = hybridize(body, backend="graph")
    x = torch.ones(2, 3, 5)
    assert net(x).shape == (2, 3, 10)
    body.fc2 = nn.Sequential(nn.Flatten(), nn.Linear(30, 10))  # MXNet's Dense(10, flatten=True)
    out, said = _quietly(net, x)
    assert out.shape == (2, 10)
    torch.testing.assert_close(out, body(x))
    assert len(said) == 1 and "layer fc2 set" in said[0]


@pytest.mark.parametrize("change,what", [
    (lambda b: setattr(b.fc1, "weight", nn.Parameter(torch.zeros(10, 5))), "parameter fc1.weight set"),
    (lambda b: b.fc1.register_buffer("scale", torch.ones(1)), "buffer fc1.scale set"),
    (lambda b: b.fc1.add_module("extra", nn.ReLU()), "layer fc1.extra set"),
])
def test_a_change_deep_in_the_tree_is_noticed_once(change, what):
    torch.manual_seed(0)
    body = TwoLayers()
    net = hybridize(body, backend="graph")
    x = torch.randn(4, 5)
    net(x)
    change(body)
    change(body)  # two changes before the next call: one warning
    out, said = _quietly(net, x)
    assert len(said) == 1 and what in said[0], said
    torch.testing.assert_close(out, body(x))


def test_a_structure_change_of_an_unrelated_module_is_not_news():
    net = hybridize(TwoLayers(), backend="graph")
    x = torch.randn(4, 5)
    net(x)
    other = nn.Sequential(nn.Linear(2, 2))
    other.append(nn.ReLU())
    _, said = _quietly(net, x)
    assert said == [] and _served_by_a_graph(net)


# -- check_layer_forward on normalization layers hybridized alone ---------------------------------------------
@pytest.mark.parametrize("layer,shape", [
    (lambda: nn.BatchNorm2d(10), (2, 10, 10, 10)),
    (lambda: nn.InstanceNorm2d(10, affine=True), (2, 10, 10, 10)),
    (lambda: nn.BatchNorm1d(10), (4, 10)),
    (lambda: nn.LayerNorm(10), (2, 10, 10, 10)),
    (lambda: nn.GroupNorm(2, 10), (2, 10, 10, 10)),
], ids=["BatchNorm2d", "InstanceNorm2d", "BatchNorm1d", "LayerNorm", "GroupNorm"])
@pytest.mark.parametrize("training", [True, False])
def test_a_normalization_layer_alone_is_captured_and_matches_eager(layer, shape, training):
    torch.manual_seed(0)
    eager = layer().train(training)
    with torch.no_grad():
        for p in eager.parameters():
            p.uniform_(0.5, 1.5)
    hybrid_copy = copy.deepcopy(eager)
    x = torch.randn(shape) + 1.0
    x_eager = x.clone().requires_grad_()
    out_eager = eager(x_eager)
    out_eager.sum().backward()
    net = hybridize(hybrid_copy, backend="graph")
    x_hybrid = x.clone().requires_grad_()
    out, said = _quietly(net, x_hybrid)
    out.sum().backward()
    assert said == [], said
    assert _served_by_a_graph(net)
    torch.testing.assert_close(out, out_eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_hybrid.grad, x_eager.grad, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(eager.state_dict().items(), hybrid_copy.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)  # running statistics updated once, alike


# -- defaulted parameters ----------------------------------------------------------------------------
class WithMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 2.0) -> torch.Tensor:
        out = self.fc(x) * scale
        return out if mask is None else out * mask


def test_a_call_relying_on_default_arguments_is_captured():
    torch.manual_seed(0)
    body = WithMask()
    net = hybridize(body, backend="graph")
    x = torch.randn(4, 3)
    out, said = _quietly(net, x)
    assert said == [] and _served_by_a_graph(net)
    torch.testing.assert_close(out, body(x))


def test_a_call_giving_the_defaulted_input_too_is_captured_as_well():
    torch.manual_seed(0)
    body = WithMask()
    net = hybridize(body, backend="graph")
    x, mask = torch.randn(4, 3), (torch.rand(4, 3) > 0.5).float()
    net(x)
    out, said = _quietly(net, x, mask)
    assert not any("eager" in s for s in said), said
    torch.testing.assert_close(out, body(x, mask))
    assert len(net.choices) == 2 and all(c.backend == "graph" for c in net.choices.values())


# -- SymbolBlock.cast on a loaded export: a documented difference, refused where it is asked -------------------
def test_a_loaded_export_refuses_a_dtype_cast_at_the_call_and_keeps_working(tmp_path):
    from dlperf.hybrid import export, load

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    x = torch.randn(2, 3, dtype=torch.float64)
    export(model, tmp_path / "net", x)
    loaded = load(tmp_path / "net")
    for cast in (lambda m: m.float(), lambda m: m.half(), lambda m: m.to(torch.float32)):
        with pytest.raises(Exception, match="cannot cast a loaded export from float64 to float") as info:
            cast(loaded)
        assert "\n" not in str(info.value) and "export the model again" in str(info.value)
    assert all(p.dtype == torch.float64 for p in loaded.parameters())
    loaded.to("cpu")  # a move is not a cast
    torch.testing.assert_close(loaded(x), model(x))

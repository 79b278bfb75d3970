"""The native backend: a C++ plan (or its Python fallback) checked against eager on random inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dlperf.hybrid import hybridize
from dlperf.hybrid.backends import BackendUnsupported, native
from dlperf.hybrid.capture import capture


def _compiled_or_skip():
    try:
        return native.load_extension()
    except RuntimeError as exc:
        pytest.skip(f"no C++ toolchain: {exc}")


def _net(model: nn.Module):
    return hybridize(model, backend="native")


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64])  # kernel path up to 8 rows, BLAS above
@pytest.mark.parametrize("act", [nn.ReLU, nn.Sigmoid, nn.Tanh])
def test_plan_matches_eager_on_fresh_inputs(rows, act):
    _compiled_or_skip()
    torch.manual_seed(rows)
    model = nn.Sequential(nn.Linear(37, 19), act(), nn.Linear(19, 5, bias=False), act(), nn.Linear(5, 3))
    net = _net(model)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(rows, 37)
            torch.testing.assert_close(net(x), model(x), rtol=1e-5, atol=1e-6)
    (choice,) = net.choices.values()
    assert choice.backend == "native" and "C++ plan" in choice.reason


def test_plan_handles_flatten_add_and_unfused_activation():
    _compiled_or_skip()

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.flat = nn.Flatten()
            self.a = nn.Linear(12, 6)
            self.b = nn.Linear(12, 6)

        def forward(self, x):
            h = self.flat(x)
            u = self.a(h)
            return torch.relu(u) + u * self.b(h)  # u has two users: relu is not fused

    model = Branchy()
    net = _net(model)
    with torch.no_grad():
        for rows in (1, 2, 20):
            x = torch.randn(rows, 3, 4)
            torch.testing.assert_close(net(x), model(x), rtol=1e-5, atol=1e-6)


def test_outputs_kept_by_the_caller_are_never_overwritten():
    _compiled_or_skip()
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 4), nn.Flatten())
    net = _net(model)
    with torch.no_grad():
        xs = [torch.randn(1, 8) for _ in range(4)]
        outs = [net(x) for x in xs]
        for x, out in zip(xs, outs):
            torch.testing.assert_close(out, model(x))


def test_parameter_updates_are_visible_to_the_plan():
    _compiled_or_skip()
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    net = _net(model)
    x = torch.randn(1, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with torch.no_grad():
        net(x)
    model(x).sum().backward()
    opt.step()
    with torch.no_grad():
        torch.testing.assert_close(net(x), model(x))


def test_grad_mode_never_uses_the_inference_plan():
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    net = hybridize(copy.deepcopy(model), candidates=["native", "graph"])
    out = net(torch.randn(2, 8))
    assert out.grad_fn is not None
    (choice,) = net.choices.values()
    assert choice.backend == "graph" and "inference only" in choice.reason


def test_unsupported_graph_is_refused_and_auto_moves_on():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten())
    with pytest.raises(BackendUnsupported, match="conv2d"):
        native.build_code(capture(model, (torch.randn(1, 1, 5, 5),)).graph_module)
    net = hybridize(model, candidates=["native", "graph"])
    with torch.no_grad():
        x = torch.randn(1, 1, 5, 5)
        torch.testing.assert_close(net(x), model(x))
    (choice,) = net.choices.values()
    assert choice.backend == "graph" and "native: conv2d is not supported" in choice.reason


def test_python_fallback_without_a_compiler(monkeypatch):
    def no_compiler():
        raise RuntimeError("cannot build the native plan interpreter: no g++")

    monkeypatch.setattr(native, "load_extension", no_compiler)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    net = _net(model)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(3, 8)
            torch.testing.assert_close(net(x), model(x))
    (choice,) = net.choices.values()
    assert "Python graph replay" in choice.reason and "no g++" in choice.reason

"""Small random models with the features a graph can lose, through every ``train_step`` backend against eager.

Each model is a chain of linear blocks, some of them wrapped in what a recorded graph does not keep by itself:
``torch.no_grad()``, ``set_grad_enabled(False)``, ``inference_mode`` (its result cloned, as eager requires),
``enable_grad`` inside ``no_grad``, ``detach``, ``.data``, frozen weights or biases, forward hooks and tensor
hooks, residual adds, BatchNorm and dropout. After a few steps every backend's weights, buffers and losses
must equal those of the plain eager step (tests/support/training.py), and frozen weights must not move: a
backend either reproduces a feature or is not used.
"""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dlperf.hybrid import HybridizeWarning
from dlperf.hybrid.train_step import train_step
from support.training import reference_step

FEATURES = ("no_grad", "grad_disabled", "inference_mode", "enable_grad_in_no_grad", "detach", "data",
            "frozen", "frozen_bias", "forward_hook", "tensor_hook", "residual", "batchnorm", "dropout", "plain")
ACTIVATIONS = ("relu", "tanh", "sigmoid", "none")
BACKENDS = ("eager", "graph", "native", "auto")
SEEDS = range(16)
STEPS = 3
RTOL, ATOL = 1e-4, 1e-5
WIDTH_IN, CLASSES, ROWS = 6, 3, 5


@dataclass(frozen=True)
class Block:
    feature: str
    width: int
    activation: str


def model_spec(seed: int) -> list[Block]:
    """Two to four blocks; the first seeds take the features in turn, so that every one is covered."""
    rng = random.Random(seed)
    blocks = []
    for i in range(rng.randint(2, 4)):
        feature = FEATURES[(seed + i * 5) % len(FEATURES)] if i < 2 else rng.choice(FEATURES)
        blocks.append(Block(feature, rng.choice((4, 6, 8)), rng.choice(ACTIVATIONS)))
    return blocks


class Fuzzed(nn.Module):
    """The model a spec describes; Python branches on the spec only, so every model is one graph."""

    def __init__(self, spec: list[Block]):
        super().__init__()
        self.spec = spec
        widths = [WIDTH_IN] + [b.width for b in spec]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.norms = nn.ModuleDict({str(i): nn.BatchNorm1d(b.width) for i, b in enumerate(spec)
                                    if b.feature == "batchnorm"})
        self.head = nn.Linear(widths[-1], CLASSES)
        for block, layer in zip(spec, self.layers):
            if block.feature == "frozen":
                layer.requires_grad_(False)
            elif block.feature == "frozen_bias":
                layer.bias.requires_grad_(False)
            elif block.feature == "forward_hook":
                layer.register_forward_hook(lambda m, inputs, out: out * 0.5)

    def forward(self, x):
        h = x
        for i, (block, layer) in enumerate(zip(self.spec, self.layers)):
            h = self._block(i, block, layer, h)
            h = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}.get(block.activation, _same)(h)
        return self.head(h)

    def _block(self, i: int, block: Block, layer: nn.Linear, h):
        feature = block.feature
        if feature == "no_grad":
            with torch.no_grad():
                return layer(h)
        if feature == "grad_disabled":
            with torch.set_grad_enabled(False):
                return layer(h)
        if feature == "inference_mode":
            with torch.inference_mode():
                out = layer(h)
            return out.clone()  # an inference tensor cannot be saved for backward; its clone can
        if feature == "enable_grad_in_no_grad":
            with torch.no_grad(), torch.enable_grad():
                return layer(h)
        if feature == "detach":
            return layer(h).detach()
        if feature == "data":
            return layer(h).data
        if feature == "tensor_hook":
            out = layer(h)
            if out.requires_grad:
                out.register_hook(lambda g: g * 2.0)
            return out
        if feature == "residual" and layer.in_features == layer.out_features:
            return h + layer(h)
        if feature == "batchnorm":
            return self.norms[str(i)](layer(h))
        if feature == "dropout":
            return F.dropout(layer(h), 0.25, self.training)
        return layer(h)


def _same(h):
    return h


def make_optimizer(seed: int, params):
    params = [p for p in params if p.requires_grad]
    if seed % 3 == 0:
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9 if seed % 3 == 1 else 0.0, weight_decay=1e-3)


def batches(seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(ROWS, WIDTH_IN, generator=g).to(device), torch.randint(0, CLASSES, (ROWS,), generator=g)
             .to(device)) for _ in range(STEPS)]


def train(model: nn.Module, seed: int, backend: str | None, device: str = "cpu"):
    """``STEPS`` steps of ``model`` (the reference step for ``backend=None``); the losses, and the error if any."""
    optimizer = make_optimizer(seed, model.parameters())
    step = (lambda x, y: reference_step(model, F.cross_entropy, optimizer, x, y)) if backend is None else \
        train_step(model, F.cross_entropy, optimizer, backend=backend)
    losses = []
    try:
        for i, (x, y) in enumerate(batches(seed, device)):
            torch.manual_seed(seed * 100 + i)  # dropout: the same masks for every backend
            losses.append(step(x, y).detach())
    except RuntimeError as exc:
        return losses, type(exc), step
    return losses, None, step


def check_backend(seed: int, backend: str, device: str = "cpu") -> None:
    torch.manual_seed(seed)
    model = Fuzzed(model_spec(seed)).to(device)
    reference = copy.deepcopy(model)
    ref_losses, ref_error, _ = train(reference, seed, None, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HybridizeWarning)  # falling back to eager is allowed; being wrong is not
        losses, error, step = train(model, seed, backend, device)
    where = f"seed {seed}, {model.spec}, backend {backend}: {step!r}"
    assert error is ref_error, where
    for got, expected in zip(losses, ref_losses):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"loss, {where}: {m}")
    for (name, got), (_, expected) in zip(model.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}, {where}: {m}")


def _frozen_stay(seed: int) -> None:
    torch.manual_seed(seed)
    model = Fuzzed(model_spec(seed))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HybridizeWarning)
        train(model, seed, "auto")
    for name, value in before.items():
        assert torch.equal(dict(model.named_parameters())[name], value), name


def test_every_feature_is_fuzzed():
    seen = {b.feature for seed in SEEDS for b in model_spec(seed)}
    assert seen == set(FEATURES)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", SEEDS)
def test_every_backend_trains_as_eager(seed, backend):
    check_backend(seed, backend)


@pytest.mark.parametrize("seed", [s for s in SEEDS if any(b.feature.startswith("frozen") for b in model_spec(s))])
def test_frozen_weights_do_not_move(seed):
    _frozen_stay(seed)


def test_native_is_refused_for_what_it_cannot_keep_and_serves_the_rest():
    """The plan runs a plain chain of linear layers; a grad-mode change or a frozen weight is refused, saying so."""
    for feature in ("plain", "no_grad", "grad_disabled", "frozen", "frozen_bias"):
        torch.manual_seed(0)
        model = Fuzzed([Block(feature, 6, "relu"), Block("plain", 4, "tanh")])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, _, step = train(model, 1, "native")
        messages = " ".join(str(w.message) for w in caught)
        if feature == "plain":
            assert step.runs_on == "native" and not messages, (repr(step), messages)
        else:
            assert step.runs_on == "eager", repr(step)
            assert "backend 'native' cannot serve" in messages and any(
                why in messages for why in ("autograd mode", "requires_grad=False", "does not reach")), messages


def test_a_backend_whose_first_step_differs_from_eager_is_not_used(monkeypatch):
    """The check itself: a runner that is wrong by a little is refused, whatever the reason it is wrong."""
    from dlperf.hybrid import train_replay

    real = train_replay.graph_runner

    def off_by_a_little(joint, update, x, y, keep_grads):
        step = real(joint, update, x, y, keep_grads)

        def wrong(x, y):
            loss = step(x, y)
            with torch.no_grad():
                joint.params[0].add_(1e-3)
            return loss

        return wrong

    monkeypatch.setattr(train_replay, "graph_runner", off_by_a_little)
    torch.manual_seed(3)
    model = Fuzzed([Block("plain", 6, "relu")])
    reference = copy.deepcopy(model)
    train(reference, 2, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, error, step = train(model, 2, "graph")
    assert error is None and step.runs_on == "eager", repr(step)
    assert any("first step differs from eager's (layers.0.weight" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    for got, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", SEEDS)
def test_cuda_graphs_trains_as_eager(seed):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    check_backend(seed, "cuda_graphs", "cuda")
    check_backend(seed, "auto", "cuda")


COMPILE_SEEDS = (0, 1, 5)


@pytest.mark.slow
def test_compile_trains_as_eager():
    # In a child process: inductor keeps a compile thread pool alive for the life of the process.
    script = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_hybrid_train_fuzz as t\n"
              f"for seed in {COMPILE_SEEDS!r}:\n    t.check_backend(seed, 'compile')\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=900)

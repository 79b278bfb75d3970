from __future__ import annotations

import pytest
import torch

from dlperf.errors import UsageError
from dlperf.models import get_model, get_spec, model_names, num_params

# Parameter counts of the reference implementations (Shi et al.'s scripts and d2l chapter 12).
EXPECTED_PARAMS = {
    "fcn-s": 117_997_696,
    "alexnet-s": 62_378_344,
    "resnet-50": 25_557_032,
    "fcn-r": 14_205_962,
    "alexnet-r": 85_098,
    "resnet-56": 855_050,
    "lstm": 6_182_672,  # PyTorch's LSTM keeps two biases per gate: 2,048 more than the reference
    "lenet": 129_068,
    "resnet18": 11_175_818,
    "mlp": 164_482,
}
PAPER_BATCHES = {  # (Table 9 CPU, Table 7 GPU)
    "fcn-s": (64, 64), "alexnet-s": (16, 16), "resnet-50": (16, 16), "fcn-r": (1024, 1024),
    "alexnet-r": (128, 1024), "resnet-56": (128, 128), "lstm": (256, 128),
}


def test_registry_lists_the_paper_networks_in_table_order():
    assert model_names(paper_only=True) == list(PAPER_BATCHES)
    assert set(model_names()) == set(EXPECTED_PARAMS)


@pytest.mark.parametrize("name", list(EXPECTED_PARAMS))
def test_parameter_counts_match_the_references(name):
    with torch.device("meta"):  # fcn-s alone is 118M parameters: count without allocating
        model = get_model(name)
    assert num_params(model) == EXPECTED_PARAMS[name]


@pytest.mark.parametrize("name", list(PAPER_BATCHES))
def test_batch_sizes_are_the_papers(name):
    spec = get_spec(name)
    assert (spec.batch_size_for("cpu"), spec.batch_size_for("gpu")) == PAPER_BATCHES[name]


@pytest.mark.parametrize("name", [n for n in EXPECTED_PARAMS if n != "fcn-s"])
def test_forward_backward_on_a_synthetic_batch(name):
    spec = get_spec(name)
    torch.manual_seed(0)
    model = spec.build()
    x, y = spec.input.make_batch(2, generator=torch.Generator().manual_seed(1))
    out = model(x)
    loss = spec.loss(out, y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
    if spec.input.kind == "tokens":
        assert out.shape == (2, *spec.input.shape, spec.input.num_classes)
        assert int(x.max()) < spec.input.num_classes
    else:
        assert out.shape == (2, spec.input.num_classes)


def test_fcn_s_shapes_on_meta():
    spec = get_spec("fcn-s")
    with torch.device("meta"):
        model = spec.build()
    x, _ = spec.input.make_batch(3)
    assert model(x.to("meta")).shape == (3, 26752)


def test_batches_are_reproducible_and_on_the_device():
    spec = get_spec("alexnet-r")
    a = spec.input.make_batch(4, "cpu", torch.Generator().manual_seed(3))
    b = spec.input.make_batch(4, "cpu", torch.Generator().manual_seed(3))
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert a[0].shape == (4, 3, 32, 32) and a[1].dtype == torch.int64


def test_unknown_network_lists_the_choices():
    with pytest.raises(UsageError, match="unknown network 'vgg'; valid choices: fcn-s, alexnet-s"):
        get_spec("vgg")


def test_alexnet_r_pools_round_down():
    net = get_model("alexnet-r")
    feats = net[:-2](torch.zeros(1, 3, 32, 32))
    assert feats.shape == (1, 64, 3, 3)


def test_resnet56_shortcut_is_parameter_free_option_a():
    from dlperf.models.resnet import CifarBasicBlock

    block = CifarBasicBlock(16, 32, stride=2)
    x = torch.randn(2, 16, 8, 8)
    assert block(x).shape == (2, 32, 4, 4)
    assert num_params(block) == sum(p.numel() for p in block.body.parameters())

"""d2l 12.6, the concise multi-GPU implementation, with dlperf's names.

Gluon's ``net.initialize(ctx=devices)`` keeps one copy of the parameters per device: that is
``replicate(net, devices)`` (or the copies a :class:`~dlperf.parallel.Trainer` makes), and
``gluon.Trainer(...).step(batch_size)`` is ``Trainer.step(batch_size)``, which sums the
replicas' gradients with allreduce and updates every copy. ``evaluate_accuracy_gpus`` is
``dlperf.parallel.evaluate_accuracy``. The book's ResNet-18 is ``get_model("resnet18")``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dlperf.data import load_data
from dlperf.devices import device_of, try_all_gpus
from dlperf.models import get_model
from dlperf.parallel import Trainer, evaluate_accuracy, replicate, split_and_load, split_batch


def small_net() -> nn.Module:
    """A LeNet-sized network without BatchNorm, so one device and k devices compute the same thing."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(),
                         nn.Linear(6 * 14 * 14, 10))


def loss(y_hat, y):  # Gluon's loss: one value per example, summed by backward
    return F.cross_entropy(y_hat, y, reduction="sum")


def test_the_network_on_several_devices_computes_where_its_input_is():
    net = get_model("resnet18")
    devices = try_all_gpus(2)
    replicas = replicate(net, devices)  # net.initialize(ctx=devices)
    x = torch.rand(4, 1, 28, 28)
    x_shards = split_and_load(x, devices)
    outs = [rep.eval()(xs) for rep, xs in zip(replicas, x_shards)]
    assert [tuple(o.shape) for o in outs] == [(2, 10), (2, 10)]
    assert [device_of(o) for o in outs] == devices
    # every device holds the same initial weights
    first = [rep[0].weight if isinstance(rep, nn.Sequential) else next(rep.parameters()) for rep in replicas]
    assert [device_of(w) for w in first] == devices
    assert torch.equal(first[0].detach().cpu(), first[1].detach().cpu())


def test_evaluate_accuracy_on_all_devices_matches_one_device():
    net = small_net()
    _, test_iter = load_data(64, train=64, test=256)
    devices = try_all_gpus(2)
    acc_k = evaluate_accuracy(replicate(net, devices), test_iter, devices)
    acc_1 = evaluate_accuracy(replicate(net, devices[:1]), test_iter, devices[:1])
    assert acc_k == acc_1 and 0.0 <= acc_k <= 1.0


def _train_book_loop(num_gpus, batches, lr):
    """The book's loop: split, a loss per device, backward on each, ``trainer.step(batch_size)``."""
    devices = try_all_gpus(num_gpus)
    with Trainer(small_net(), devices, "sgd", {"lr": lr}) as trainer:
        for features, labels in batches:
            trainer.zero_grad()
            Xs, ys = split_batch(features, labels, devices)
            losses = [loss(net(X), y) for net, X, y in zip(trainer.replicas, Xs, ys)]
            assert [device_of(device_loss) for device_loss in losses] == devices
            for device_loss in losses:
                device_loss.backward()
            trainer.step(features.shape[0])
        assert trainer.max_replica_difference() == 0.0
        return [p.detach().cpu().clone() for p in trainer.module.parameters()]


def _batches(n, batch_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(batch_size, 1, 28, 28, generator=g), torch.randint(0, 10, (batch_size,), generator=g))
            for _ in range(n)]


@pytest.mark.timeout(120)
def test_one_device_and_two_devices_train_the_same_model():
    batches = _batches(3, 16)
    one = _train_book_loop(1, batches, lr=0.1)
    two = _train_book_loop(2, batches, lr=0.1)
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(one, small_net().parameters()))


@pytest.mark.timeout(120)
def test_train_step_is_the_same_step_in_one_call():
    batches = _batches(2, 16)
    ref = _train_book_loop(2, batches, lr=0.1)
    with Trainer(small_net(), try_all_gpus(2), "sgd", {"lr": 0.1}) as trainer:
        for X, y in batches:
            trainer.train_step(X, y)  # mean loss: the same gradient as the summed loss / batch size
        got = [p.detach().cpu() for p in trainer.module.parameters()]
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def train(num_gpus, batch_size, lr, num_epochs, train_size):
    train_iter, test_iter = load_data(batch_size, train=train_size, test=512)
    devices = try_all_gpus(num_gpus)
    torch.manual_seed(0)
    with Trainer(get_model("resnet18"), devices, "sgd", {"lr": lr}) as trainer:
        for _ in range(num_epochs):
            for features, labels in train_iter:
                trainer.train_step(features, labels)
        return trainer.evaluate_accuracy(test_iter), trainer.max_replica_difference()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_experiment_resnet18_on_one_and_two_devices():
    # BatchNorm's running statistics need a second epoch before evaluation mode predicts well
    acc1, _ = train(num_gpus=1, batch_size=64, lr=0.05, num_epochs=2, train_size=1024)
    acc2, diff = train(num_gpus=2, batch_size=64, lr=0.05, num_epochs=2, train_size=1024)
    assert diff == 0.0  # the replicas stay identical
    assert acc1 > 0.4 and acc2 > 0.4, (acc1, acc2)

"""Oracle across launchers: one step of PyTorch DDP over gloo (2 processes) equals the threaded Trainer."""

from __future__ import annotations

import pytest
import torch

from dlperf.devices import cpu
from dlperf.models import get_spec
from dlperf.parallel import Trainer
from dlperf.parallel.launchers import ProcessLauncher, rank_info

BATCH = 16


def _batch():
    spec = get_spec("lenet")
    torch.manual_seed(0)
    net = spec.build()
    X, y = spec.input.make_batch(BATCH, generator=torch.Generator().manual_seed(1))
    return spec, net, X, y


def _rank() -> list:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = rank_info().rank
    torch.set_num_threads(1)
    spec, net, X, y = _batch()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    spec.loss(model(X[half]), y[half]).backward()
    opt.step()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_ddp_two_processes_equals_trainer_on_two_logical_devices():
    results = ProcessLauncher(2, backend="gloo", join_timeout_s=120).launch(_rank)

    spec, net, X, y = _batch()
    with Trainer(net, [cpu(0), cpu(1)], "sgd", {"lr": 0.1}, loss=spec.loss) as trainer:
        trainer.train_step(X, y)
        for ours, theirs0, theirs1 in zip(trainer.module.parameters(), results[0], results[1]):
            torch.testing.assert_close(ours.detach().contiguous(), theirs0, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(theirs0, theirs1)

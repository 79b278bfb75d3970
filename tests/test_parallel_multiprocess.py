"""The Trainer across processes: the same update as one process and as PyTorch DDP, uneven batches,
parameters without gradients, a batch too small to split, and evaluation over every process.

Starting processes costs seconds (fresh interpreters import torch), so one launch of 2 processes runs
every scenario and returns what each process saw; the tests compare those results with references
computed here, in one process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dlperf.devices import cpu
from dlperf.errors import UsageError
from dlperf.models import get_spec
from dlperf.parallel import Trainer
from dlperf.parallel.communication.process_group import local_parts
from dlperf.parallel.launchers import ProcessLauncher, rank_info

BATCH = 16
STEPS = 3
UNEVEN = 7  # 7 examples on 2 or 4 devices: parts of different sizes
LR = 0.1


def _batches():
    spec = get_spec("lenet")
    g = torch.Generator().manual_seed(1)
    even = [spec.input.make_batch(BATCH, generator=g) for _ in range(STEPS)]
    return even, spec.input.make_batch(UNEVEN, generator=g)


def _lenet():
    spec = get_spec("lenet")
    torch.manual_seed(0)
    return spec, spec.build()


class TwoHeads(nn.Module):
    """Which head runs depends on the data: one process uses ``a``, the other ``b``; ``never`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(8, 3)
        self.never = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return self.a(h) if float(x[:, 0].mean()) > 0 else self.b(h)


def _two_heads_data():
    g = torch.Generator().manual_seed(3)
    X = torch.randn(8, 4, generator=g)
    X[:4, 0], X[4:, 0] = 1.0, -1.0  # first half (process 0) takes head a, second half head b
    return X, torch.randint(0, 3, (8,), generator=g)


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().contiguous().clone() for p in module.parameters()]


def _trainer_run(devices, steps_only: bool = False):
    spec, net = _lenet()
    even, uneven = _batches()
    with Trainer(net, devices, "sgd", {"lr": LR}, loss=spec.loss) as trainer:
        for X, y in even:
            trainer.train_step(X, y)
        after_even = _params(trainer.module)
        if steps_only:
            return after_even, None
        trainer.train_step(*uneven)
        return after_even, _params(trainer.module)


def _ddp_run() -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world, _ = rank_info()
    spec, net = _lenet()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for X, y in _batches()[0]:
        mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        opt.zero_grad()
        spec.loss(model(X[mine]), y[mine]).backward()  # DDP averages over ranks: equal halves, the global mean
        opt.step()
    return _params(net)


def _too_small() -> tuple[str, list[torch.Tensor]]:
    spec, net = _lenet()
    even, _ = _batches()
    with Trainer(net, [cpu(0)], "sgd", {"lr": LR}, loss=spec.loss) as trainer:
        try:
            trainer.train_step(even[0][0][:1], even[0][1][:1])  # 1 example, 2 processes
            message = "no error"
        except UsageError as exc:
            message = str(exc)
        trainer.train_step(*even[0])  # the processes are still in step
        return message, _params(trainer.module)


def _unused() -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = TwoHeads()
    X, y = _two_heads_data()
    # tiny buckets: each head in its own; the unused head's bucket completes only when backward ends
    with Trainer(net, [cpu(0)], "sgd", {"lr": LR}, bucket_bytes=64) as trainer:
        trainer.train_step(X, y)
        return _params(trainer.module)


def _evaluate() -> tuple[float, float, int]:
    spec, net = _lenet()
    even, uneven = _batches()
    with Trainer(net, [cpu(0)], "sgd", {"lr": LR}, loss=spec.loss) as trainer:
        acc = trainer.evaluate_accuracy([*even, uneven])
        total = trainer.sum_across_processes(torch.tensor([float(rank_info().rank + 1)]))
        return acc, float(total), trainer.world


def _scenarios() -> dict:
    torch.set_num_threads(1)
    return {"one_device": _trainer_run([cpu(0)]), "two_devices": _trainer_run([cpu(0), cpu(1)]),
            "ddp": _ddp_run(), "too_small": _too_small(), "unused": _unused(), "evaluate": _evaluate()}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return ProcessLauncher(2, backend="gloo", join_timeout_s=120).launch(_scenarios)


def _close(ours, theirs) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_processes_equal_one_process_two_devices_and_ddp(runs):
    before = _params(_lenet()[1])
    ref_even, ref_uneven = _trainer_run([cpu(0), cpu(1)])
    for r in runs:
        _close(r["one_device"][0], ref_even)
        _close(r["ddp"], ref_even)
        _close(r["one_device"][1], ref_uneven)  # 7 examples: parts 4 and 3, weighted by their share
    # the comparison can fail: training moved the weights
    assert max(float((a - b).abs().max()) for a, b in zip(before, ref_even)) > 1e-3


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_hierarchical_two_processes_of_two_devices_equal_four_devices(runs):
    ref_even, ref_uneven = _trainer_run([cpu(i) for i in range(4)])
    for r in runs:
        _close(r["two_devices"][0], ref_even)
        _close(r["two_devices"][1], ref_uneven)  # 7 examples on 4 devices: 2, 2, 2, 1


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_batch_smaller_than_all_devices_fails_in_every_process_and_training_goes_on(runs):
    spec, net = _lenet()
    even, _ = _batches()
    with Trainer(net, [cpu(0), cpu(1)], "sgd", {"lr": LR}, loss=spec.loss) as trainer:
        trainer.train_step(*even[0])
        ref = _params(trainer.module)
    for r in runs:
        message, params = r["too_small"]
        assert "a batch of 1 example cannot be split across 2 devices" in message
        _close(params, ref)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_parameters_without_gradient_in_some_process(runs):
    torch.manual_seed(0)
    net = TwoHeads()
    X, y = _two_heads_data()
    # plain reference: the mean loss over both halves, each through its own head, one SGD step
    loss = 0.5 * nn.functional.cross_entropy(net(X[:4]), y[:4]) + 0.5 * nn.functional.cross_entropy(net(X[4:]), y[4:])
    loss.backward()
    with torch.no_grad():
        for p in net.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    for r in runs:
        _close(r["unused"], _params(net))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_evaluation_and_sums_span_every_process(runs):
    spec, net = _lenet()
    even, uneven = _batches()
    with Trainer(net, [cpu(0)], "sgd", {"lr": LR}, loss=spec.loss) as trainer:
        ref = trainer.evaluate_accuracy([*even, uneven])
    for r in runs:
        assert r["evaluate"] == (pytest.approx(ref), 3.0, 2)


def test_local_parts_cover_the_global_batch_in_order():
    for n in (4, 7, 10, 257):
        for world, k in ((2, 1), (2, 2), (3, 2)):
            if n < world * k:
                continue
            spans = [local_parts(n, world, r, k) for r in range(world)]
            starts = [s for s, _ in spans]
            assert starts == sorted(starts) and starts[0] == 0
            assert sum(sum(sizes) for _, sizes in spans) == n
            for (s, sizes), nxt in zip(spans, [*starts[1:], n]):
                assert s + sum(sizes) == nxt and max(sizes) - min(sizes) <= 1

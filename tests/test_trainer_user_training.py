"""The Trainer on training as users write it: their loss (or the model's own), mapping batches and outputs,
AdamW with a schedule, accumulation and clipping, each checked against a plain PyTorch loop."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dlperf.devices import cpu
from dlperf.errors import UsageError
from dlperf.parallel import Trainer
from support.training import TinyHF


def assert_same(a: nn.Module, b: nn.Module, atol: float = 1e-6) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=atol, msg=name)


class Regressor(nn.Module):
    """A GRU over a sequence with a one-column head: float targets, no classes."""

    def __init__(self, flat: bool = False) -> None:
        super().__init__()
        self.gru = nn.GRU(3, 8, batch_first=True)
        self.head = nn.Linear(8, 1)
        self.flat = flat

    def forward(self, x):
        out, _ = self.gru(x)
        y = self.head(out[:, -1])
        return y.squeeze(1) if self.flat else y


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(2, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x, z):
        return self.head(torch.relu(self.a(x) + self.b(z)))


def regression_batches(n: int, batch: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(batch, 5, 3, generator=g)
        out.append((x, x[:, -1].mean(1, keepdim=True)))  # learnable: the last step's mean
    return out


def hf_batches(n: int, batch: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 20, (batch, 7), generator=g)
        labels = torch.bucketize((ids < 10).sum(1), torch.tensor([2, 4]))  # learnable from the mean embedding
        out.append({"input_ids": ids, "attention_mask": torch.ones(batch, 7, dtype=torch.int64), "labels": labels})
    return out


@pytest.mark.parametrize("flat", [False, True], ids=["head [B,1]", "head [B]"])
def test_a_regression_head_without_a_loss_is_one_line_naming_loss(flat):
    X, y = regression_batches(1)[0]
    with Trainer(Regressor(flat), [cpu(0)], "sgd", {"lr": 0.1}) as trainer:
        with pytest.raises(UsageError, match=r"name the loss: loss='mse'") as info:
            trainer.train_step(X, y.squeeze(1) if flat else y)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("flat", [False, True], ids=["head [B,1]", "head [B]"])
def test_a_regressor_with_mse_learns_and_matches_a_plain_loop(flat):
    torch.manual_seed(0)
    model = Regressor(flat)
    data = regression_batches(40)
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(plain.parameters(), lr=0.2)
    for X, y in data:
        opt.zero_grad()
        target = y.squeeze(1) if flat else y
        nn.functional.mse_loss(plain(X), target).backward()
        opt.step()
    losses = []
    with Trainer(model, [cpu(0)], "sgd", {"lr": 0.2}, loss="mse") as trainer:
        for X, y in data:
            losses.append(float(trainer.train_step(X, y.squeeze(1) if flat else y)))
        assert_same(trainer.module, plain)
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])


def test_a_huggingface_style_model_trains_on_its_own_loss_across_two_devices():
    torch.manual_seed(0)
    model = TinyHF()
    data = hf_batches(30)
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(plain.parameters(), lr=0.05)
    for batch in data:
        opt.zero_grad()
        plain(**batch)["loss"].backward()
        opt.step()
    losses = []
    with Trainer(model, [cpu(0), cpu(1)], "adamw", {"lr": 0.05}) as trainer:
        for batch in data:
            losses.append(float(trainer.train_step(batch)))
        assert_same(trainer.module, plain, atol=1e-5)
        assert trainer.evaluate_accuracy(hf_batches(3, seed=9)) > 0.6
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])


def test_a_two_input_model_and_a_custom_loss_function():
    torch.manual_seed(0)
    model = TwoInputs()
    g = torch.Generator().manual_seed(1)
    data = [((torch.randn(10, 4, generator=g), torch.randn(10, 2, generator=g)),
             torch.randint(0, 3, (10,), generator=g)) for _ in range(5)]

    def smoothed(outputs, targets):
        return nn.functional.cross_entropy(outputs, targets, label_smoothing=0.1)

    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for (x, z), y in data:
        opt.zero_grad()
        smoothed(plain(x, z), y).backward()
        opt.step()
    with Trainer(model, [cpu(0), cpu(1)], "sgd", {"lr": 0.1}, loss=smoothed) as trainer:
        for X, y in data:
            trainer.train_step(X, y)
        assert_same(trainer.module, plain)


@pytest.mark.parametrize("devices", [1, 2])
def test_adamw_with_a_cosine_schedule_accumulation_and_clipping_match_a_plain_loop(devices):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(2)
    micro = [(torch.randn(8, 6, generator=g) * 3, torch.randint(0, 4, (8,), generator=g)) for _ in range(12)]
    accumulate, updates = 3, 4
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(plain.parameters(), lr=0.02, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=updates)
    for u in range(updates):
        opt.zero_grad()
        X = torch.cat([m[0] for m in micro[u * accumulate:(u + 1) * accumulate]])
        y = torch.cat([m[1] for m in micro[u * accumulate:(u + 1) * accumulate]])
        nn.functional.cross_entropy(plain(X), y).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        opt.step()
        sched.step()
    with Trainer(model, [cpu(i) for i in range(devices)], "adamw", {"lr": 0.02, "weight_decay": 0.01},
                 lr_schedule="cosine", schedule_steps=updates, accumulate=accumulate, clip_grad_norm=0.5) as trainer:
        for X, y in micro:
            trainer.train_step(X, y)
        assert trainer.steps == updates
        assert_same(trainer.module, plain, atol=1e-5)
        assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(sched.get_last_lr()[0])


def test_an_epoch_that_does_not_divide_into_accumulate_updates_on_what_it_has():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    batches = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(3)]
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for group in (batches[:2], batches[2:]):
        opt.zero_grad()
        X, y = torch.cat([b[0] for b in group]), torch.cat([b[1] for b in group])
        nn.functional.cross_entropy(plain(X), y).backward()
        opt.step()
    with Trainer(model, [cpu(0)], "sgd", {"lr": 0.1}, accumulate=2) as trainer:
        for X, y in batches:
            trainer.train_step(X, y)
        trainer.flush()
        assert trainer.steps == 2
        assert_same(trainer.module, plain)


def test_an_optimizer_class_takes_its_parameters():
    with Trainer(nn.Linear(2, 2), [cpu(0)], torch.optim.RMSprop, {"lr": 0.01, "alpha": 0.9}) as trainer:
        assert type(trainer.optimizers[0]) is torch.optim.RMSprop
        assert trainer.optimizers[0].param_groups[0]["alpha"] == 0.9


@pytest.mark.parametrize("options, words", [
    ({"accumulate": 0}, "accumulate=0: expected an integer from 1 to 4096"),
    ({"clip_grad_norm": -1.0}, "clip_grad_norm=-1.0: expected a positive number"),
    ({"lr_schedule": "sawtooth"}, "unknown learning-rate schedule 'sawtooth'"),
    ({"loss": "hinge"}, "unknown loss 'hinge'"),
    ({"lr_schedule": "cosine"}, "lr_schedule='cosine' needs the run's length"),
    ({"clip_grad_norm": 1.0, "kvstore": "local", "update_on_kvstore": True}, "the store runs the update"),
])
def test_bad_training_options_are_one_line(options, words):
    with pytest.raises(UsageError, match=words):
        Trainer(nn.Linear(2, 2), [cpu(0), cpu(1)], "sgd", {"lr": 0.1}, **options).close()


def test_a_scheduled_accumulating_trainer_resumes_bit_identically_from_its_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(4)
    micro = [(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(16)]
    options = {"lr_schedule": "cosine", "schedule_steps": 8, "accumulate": 2, "clip_grad_norm": 0.5}
    with Trainer(copy.deepcopy(model), [cpu(0), cpu(1)], "adamw", {"lr": 0.02}, **options) as straight:
        for X, y in micro:
            straight.train_step(X, y)
        want = copy.deepcopy(straight.module)
    with Trainer(copy.deepcopy(model), [cpu(0), cpu(1)], "adamw", {"lr": 0.02}, **options) as first:
        for X, y in micro[:8]:
            first.train_step(X, y)
        state = first.state_dict()
    with Trainer(copy.deepcopy(model), [cpu(0), cpu(1)], "adamw", {"lr": 0.02}, **options) as second:
        second.load_state_dict(state)
        for X, y in micro[8:]:
            second.train_step(X, y)
        assert second.steps == 8
        for p, q in zip(second.module.parameters(), want.parameters()):
            assert torch.equal(p, q)

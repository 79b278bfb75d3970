"""Real models of every batch structure through every verb that calls a model, against eager PyTorch.

Three small models as users write them: a Transformer-encoder classifier on integer token ids that
takes a tuple ``(ids, padding_mask)``, a CNN with BatchNorm on one float tensor, and a model that
takes a dict (token ids, features) and returns a dict (logits, a regression score) trained on a dict
of targets. Each goes through the Trainer (every in-process strategy, one and two devices; two
processes over gloo), DataParallel, evaluation and export/load, on fresh random inputs, and each
result is compared with a plain one-device eager reference:

* weights after SGD steps equal eager SGD on the whole batch (the mean loss over the batch);
* with BatchNorm in training mode each device normalizes its own part (as DDP without SyncBatchNorm
  does), so the reference runs the same parts one after the other and sums their weighted losses.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dlperf.batch import call_model, split_tree
from dlperf.devices import cpu
from dlperf.errors import UsageError
from dlperf.hybrid import export, load
from dlperf.parallel import DataParallel, Trainer, split_sizes
from dlperf.parallel.launchers import ProcessLauncher

VOCAB, SEQ, CLASSES = 40, 6, 3
LR = 0.1
STEPS = 2
BATCH = 8


class TokenTransformer(nn.Module):
    """Token ids and a padding mask (a tuple of inputs) -> class scores."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(ids), src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).float()
        return self.head((h * keep).sum(1) / keep.sum(1).clamp(min=1.0))


class BatchNormCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class DictModel(nn.Module):
    """A dict of token ids and features in, a dict of logits and a score out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(VOCAB, 8, mode="mean")
        self.feats = nn.Linear(5, 8)
        self.logits = nn.Linear(8, CLASSES)
        self.score = nn.Linear(8, 1)

    def forward(self, batch: dict) -> dict:
        h = torch.relu(self.embed(batch["ids"]) + self.feats(batch["feats"]))
        return {"logits": self.logits(h), "score": self.score(h).squeeze(-1)}


def cross_entropy(out, y):
    return nn.functional.cross_entropy(out, y)


def dict_loss(out, y):
    return nn.functional.cross_entropy(out["logits"], y["label"]) + nn.functional.mse_loss(out["score"], y["score"])


def make_batch(kind: str, n: int, g: torch.Generator):
    """(inputs, targets) of the structure ``kind``'s model takes."""
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    if kind == "transformer":
        ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        padding = torch.zeros(n, SEQ, dtype=torch.bool)
        padding[:, SEQ - 2:] = torch.rand(n, 2, generator=g) > 0.5  # some sequences end early
        return (ids, padding), labels
    if kind == "cnn":
        return torch.randn(n, 1, 6, 6, generator=g), labels
    inputs = {"ids": torch.randint(0, VOCAB, (n, SEQ), generator=g), "feats": torch.randn(n, 5, generator=g)}
    return inputs, {"label": labels, "score": torch.randn(n, generator=g)}


MODELS = {"transformer": (TokenTransformer, cross_entropy), "cnn": (BatchNormCNN, cross_entropy),
          "dict": (DictModel, dict_loss)}


def build(kind: str, seed: int = 0) -> tuple[nn.Module, object]:
    torch.manual_seed(seed)
    cls, loss = MODELS[kind]
    return cls(), loss


def fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def reference_steps(model: nn.Module, loss_fn, batches, parts: int) -> tuple[nn.Module, list[float]]:
    """Eager SGD on one device: each batch's loss the share-weighted sum over ``parts`` parts of it
    (one part: the plain mean loss; several: what per-device BatchNorm computes)."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for X, y in batches:
        n = len(y) if isinstance(y, torch.Tensor) else len(y["label"])
        sizes = split_sizes(n, parts)
        opt.zero_grad()
        total = sum(loss_fn(call_model(model, xp), yp) * (s / n)
                    for xp, yp, s in zip(split_tree(X, sizes), split_tree(y, sizes), sizes))
        total.backward()
        opt.step()
        losses.append(float(total.detach()))
    return model, losses


def assert_params_close(got: nn.Module, want: nn.Module) -> None:
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-4, atol=1e-5, msg=name)


STRATEGIES = [([cpu(0)], {}), ([cpu(0), cpu(1)], {}), ([cpu(0), cpu(1)], {"kvstore": "local"}),
              ([cpu(0), cpu(1)], {"kvstore": "device"}),
              ([cpu(0), cpu(1)], {"kvstore": "local", "update_on_kvstore": True})]


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("devices,options", STRATEGIES,
                         ids=["one-device", "allreduce", "kvstore-local", "kvstore-device", "update-on-kvstore"])
def test_trainer_in_one_process_equals_eager(kind, devices, options):
    model, loss_fn = build(kind)
    g = fresh_generator()
    batches = [make_batch(kind, BATCH + i, g) for i in range(STEPS)]  # the second batch splits unevenly
    # per-device BatchNorm is DDP's semantics; every other model equals the whole batch's mean loss
    parts = len(devices) if kind == "cnn" else 1
    want, want_losses = reference_steps(model, loss_fn, batches, parts)
    with Trainer(model, devices, "sgd", {"lr": LR}, loss=loss_fn, processes=None, **options) as trainer:
        losses = [float(trainer.train_step(X, y)) for X, y in batches]
        assert trainer.max_replica_difference() == 0.0
        assert_params_close(trainer.module, want)
    assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
    if kind == "cnn" and len(devices) == 1:
        for a, b in zip(trainer.module.buffers(), want.buffers()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["transformer", "cnn"])
def test_evaluate_accuracy_equals_eager_argmax(kind):
    model, loss_fn = build(kind)
    g = fresh_generator()
    data = [make_batch(kind, n, g) for n in (7, 5, 1)]  # the last batch is smaller than the devices
    model.eval()
    with torch.no_grad():
        right = sum(int((call_model(model, X).argmax(-1) == y).sum()) for X, y in data)
    with Trainer(model, [cpu(0), cpu(1)], "sgd", {"lr": LR}, loss=loss_fn, processes=None) as trainer:
        assert trainer.evaluate_accuracy(data) == pytest.approx(right / 13)


def test_evaluate_accuracy_of_a_dict_output_is_one_error_naming_it():
    model, loss_fn = build("dict")
    with Trainer(model, [cpu(0), cpu(1)], "sgd", {"lr": LR}, loss=loss_fn, processes=None) as trainer:
        with pytest.raises(UsageError, match=r"returned dict\{logits: float32\[2,3\], score: float32\[2\]\}"):
            trainer.evaluate_accuracy([make_batch("dict", 4, fresh_generator())])


@pytest.mark.parametrize("kind", list(MODELS))
def test_data_parallel_equals_eager_forward_and_gradients(kind):
    model, loss_fn = build(kind)
    model.eval()  # BatchNorm with running statistics: the same on any split
    X, y = make_batch(kind, 7, fresh_generator())
    want_model = copy.deepcopy(model)
    want = call_model(want_model, X)
    loss_fn(want, y).backward()
    with DataParallel(model, [cpu(0), cpu(1)], threads=[1, 1]) as dp:
        got = call_model(dp, X)
        loss_fn(got, y).backward()
    if isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(model.named_parameters(), want_model.parameters()):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", list(MODELS))
def test_export_and_load_equal_eager_on_another_batch(kind, tmp_path):
    model, _ = build(kind)
    model.eval()
    g = fresh_generator()
    X, _ = make_batch(kind, 3, g)
    export(model, tmp_path, X if isinstance(X, tuple) else (X,))
    loaded = load(tmp_path)
    fresh, _ = make_batch(kind, 6, g)
    with torch.no_grad():
        got, want = call_model(loaded, fresh), call_model(model, fresh)
    if isinstance(want, dict):
        assert type(got) is dict and list(got) == list(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# --- across two processes ------------------------------------------------------------------------------

def _train_in_process(batches_by_kind):
    """In each process: every model trained on the same global batches; weights, losses, an accuracy."""
    torch.set_num_threads(1)
    results = {}
    for kind, batches in batches_by_kind.items():
        model, loss_fn = build(kind)
        with Trainer(model, [cpu(0)], "sgd", {"lr": LR}, loss=loss_fn) as trainer:
            losses = [float(trainer.train_step(X, y)) for X, y in batches]  # the batch's mean in every process
            accuracy = trainer.evaluate_accuracy(batches) if kind != "dict" else None
            results[kind] = {"params": [p.detach().clone() for p in trainer.module.parameters()], "losses": losses,
                             "accuracy": accuracy, "world": trainer.world,
                             "strategy": trainer.strategy.name}
    return results


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_trainer_across_two_processes_equals_eager():
    g = fresh_generator()
    batches = {kind: [make_batch(kind, BATCH + i, g) for i in range(STEPS)] for kind in MODELS}
    runs = ProcessLauncher(2, backend="gloo", join_timeout_s=180).launch(_train_in_process, batches)
    for kind, kind_batches in batches.items():
        model, loss_fn = build(kind)
        want, want_losses = reference_steps(model, loss_fn, kind_batches, 2 if kind == "cnn" else 1)
        for run in runs:
            got = run[kind]
            assert got["world"] == 2 and got["strategy"] == "processes"
            assert got["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
            for a, b in zip(got["params"], want.parameters()):
                torch.testing.assert_close(a, b.detach(), rtol=1e-4, atol=1e-5)
        if kind != "dict":
            # the weights after training, in eval mode: every process evaluated half the batches
            model_after = copy.deepcopy(model)
            with torch.no_grad():
                for p, q in zip(model_after.parameters(), runs[0][kind]["params"]):
                    p.copy_(q)
            model_after.eval()
            right = sum(int((call_model(model_after, X).argmax(-1) == y).sum()) for X, y in kind_batches)
            seen = sum(len(y) for _, y in kind_batches)
            if kind != "cnn":  # BatchNorm's running statistics are per process: not comparable here
                assert runs[0][kind]["accuracy"] == pytest.approx(right / seen)
            assert runs[0][kind]["accuracy"] == runs[1][kind]["accuracy"]


def test_the_default_loss_on_a_dict_output_is_one_error_naming_it():
    model, _ = build("dict")
    X, y = make_batch("dict", 4, fresh_generator())
    with Trainer(model, [cpu(0), cpu(1)], "sgd", {"lr": LR}, processes=None) as trainer:
        with pytest.raises(UsageError, match=r"default loss, cross-entropy, .* returned dict\{logits: float32\[2,3\], "
                                             r"score: float32\[2\]\} for targets dict\{label: int64\[2\], score: "
                                             r"float32\[2\]\}; name the loss: loss="):
            trainer.train_step(X, y)

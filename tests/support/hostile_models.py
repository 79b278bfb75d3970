"""Models and data factories that go wrong the ways users' do, for ``--model``/``--data``/``--input MODULE:FACTORY``.

Each factory is named after what is wrong with it; the batches are small (8 examples of LeNet's 1x28x28).
"""

from __future__ import annotations

import torch
from torch import nn

ROWS = 8


def _image(g: torch.Generator, rows: int = ROWS) -> torch.Tensor:
    return torch.randn(rows, 1, 28, 28, generator=g)


def _labels(g: torch.Generator, rows: int = ROWS) -> torch.Tensor:
    return torch.randint(0, 10, (rows,), generator=g)


def _batches(inputs=_image, targets=_labels, n: int = 3) -> list:
    g = torch.Generator().manual_seed(0)
    return [(inputs(g), targets(g)) for _ in range(n)]


# --- data ------------------------------------------------------------------------------------------------------

def labels_out_of_range():
    return _batches(targets=lambda g: torch.full((ROWS,), 12))


def labels_negative():
    return _batches(targets=lambda g: torch.full((ROWS,), -3))


def labels_float():
    return _batches(targets=lambda g: torch.rand(ROWS, generator=g))


def wrong_shape():
    return _batches(inputs=lambda g: torch.randn(ROWS, 3, 32, 32, generator=g))


def dict_inputs():
    return _batches(inputs=lambda g: {"x": _image(g)})


def no_batches():
    return []


def empty_batches():
    return _batches(inputs=lambda g: _image(g, 0), targets=lambda g: _labels(g, 0))


def dry_after_one_epoch():
    """A generator for training (one pass only), a list for testing."""
    return (batch for batch in _batches()), _batches()


def dry_without_a_test_set():
    """One generator: trained on in epoch 1, then evaluated, by which time it has run dry."""
    return (batch for batch in _batches())


class _Failing:
    """An iterable whose third batch raises, as a reader of a damaged file would."""

    def __iter__(self):
        for i, batch in enumerate(_batches()):
            if i == 2:
                raise OSError("damaged record in shard 7")
            yield batch


def data_raising():
    return _Failing()


def dict_batch():
    return {"x": _image(torch.Generator().manual_seed(0))}


def two_tensors():
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, 12, generator=g), torch.randn(ROWS, 4, generator=g)


# --- models ----------------------------------------------------------------------------------------------------

class NoParameters(nn.Module):
    def forward(self, x):
        return x.flatten(1)[:, :10]


def no_parameters():
    return NoParameters()


def frozen():
    from dlperf.models.lenet import lenet

    model = lenet()
    model.requires_grad_(False)
    return model


def on_meta_device():
    from dlperf.models.lenet import lenet

    with torch.device("meta"):
        return lenet()


class ParametersRaise(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(784, 10)

    def parameters(self, recurse: bool = True):
        raise RuntimeError("parameters() is broken")

    def forward(self, x):
        return self.fc(x.flatten(1))


def parameters_raise():
    return ParametersRaise()


class FailsOnCall(nn.Module):
    """A forward that raises on its ``n``-th call (a bad record, a shape the model meets late)."""

    def __init__(self, n: int):
        super().__init__()
        self.fc = nn.Linear(784, 10)
        self.n, self.calls = n, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.n:
            raise ValueError(f"forward fails on call {self.n}")
        return self.fc(x.flatten(1))


def fails_on_call_3():
    return FailsOnCall(3)


def fails_on_call_4():
    return FailsOnCall(4)


def one_column():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 1))


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(12, 3), nn.Linear(4, 3)

    def forward(self, x, z):
        return self.a(x) + self.b(z)


def two_inputs():
    return TwoInputs()


class DictInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(784, 10)

    def forward(self, batch):
        return self.fc(batch["x"].flatten(1))


def dict_input():
    return DictInput()

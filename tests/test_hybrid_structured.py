"""hybridize on structured batches (dicts, lists, tuples of tensors of any dtype), and warnings at the user's line."""

from __future__ import annotations

import copy
import inspect
import warnings

import torch
from torch import nn

from dlperf.hybrid import HybridizeWarning, hybridize


class TokenDict(nn.Module):
    """int64 token ids and a float mask in a dict; a dict with a nested tuple out."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 6)
        self.fc = nn.Linear(6, 3)

    def forward(self, batch, mode="mean"):
        h = self.emb(batch["ids"]) * batch["mask"].unsqueeze(-1)
        h = h.mean(1) if mode == "mean" else h.sum(1)
        return {"logits": self.fc(h), "extra": (h, batch["ids"].shape[1])}


class ListPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 4), nn.Linear(3, 4)

    def forward(self, xs):
        return torch.relu(self.a(xs[0]) + self.b(xs[1]))


def _batch(g):
    return {"ids": torch.randint(0, 40, (4, 7), generator=g), "mask": (torch.rand(4, 7, generator=g) > 0.3).float()}


def test_dict_of_token_ids_in_dict_out_matches_eager_with_and_without_autograd():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = TokenDict()
    ref, net = copy.deepcopy(model), hybridize(model)
    for mode in ("mean", "sum", "mean"):
        batch = _batch(g)
        out, expected = net(batch, mode), ref(batch, mode)
        assert out.keys() == expected.keys() and out["extra"][1] == expected["extra"][1] == 7
        torch.testing.assert_close(out["logits"], expected["logits"])
        out["logits"].square().sum().backward()
        expected["logits"].square().sum().backward()
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        with torch.no_grad():
            torch.testing.assert_close(net(batch, mode)["logits"], ref(batch, mode)["logits"])
    text = repr(net)
    assert "dict{ids: int64[4,7], mask: float32[4,7]}" in text and "state='replay'" in text, text
    assert net.choices, text


def test_list_input():
    torch.manual_seed(1)
    model = ListPair()
    net = hybridize(copy.deepcopy(model), backend="graph")
    xs = [torch.randn(2, 5), torch.randn(2, 3)]
    with torch.no_grad():
        torch.testing.assert_close(net(xs), model(xs))
        torch.testing.assert_close(net(xs), model(xs))
    assert {c.backend for c in net.choices.values()} == {"graph"}


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        if x.sum() > 0:  # the line the warning must point at
            return self.fc(x)
        return -self.fc(x)


def test_capture_warning_is_located_at_the_users_line():
    net = hybridize(DataDependent())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net(torch.ones(2, 3))
    (warning,) = [w for w in caught if issubclass(w.category, HybridizeWarning)]
    source, start = inspect.getsourcelines(DataDependent.forward)
    expected = start + next(i for i, line in enumerate(source) if "x.sum() > 0" in line)
    assert (warning.filename, warning.lineno) == (__file__, expected), (warning.filename, warning.lineno)
    assert net.state == "eager"


def test_signature_warning_is_located_at_the_call():
    net = hybridize(nn.Linear(3, 2), backend="graph")
    with torch.no_grad():
        net(torch.ones(1, 3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            net(torch.ones(2, 3)); line = inspect.currentframe().f_lineno  # noqa: E702
    (warning,) = [w for w in caught if issubclass(w.category, HybridizeWarning)]
    assert (warning.filename, warning.lineno) == (__file__, line)

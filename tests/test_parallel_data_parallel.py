from __future__ import annotations

import pytest
import torch
from torch import nn

from dlperf.devices import copy_to, cpu, device_of, gpu
from dlperf.errors import DeviceMismatchError, UsageError
from dlperf.parallel import DataParallel


class Dummy(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        print("Dummy.forward", tuple(x.shape), device_of(x))
        return self.m(x)


def test_dummy_prints_one_line_per_device_with_its_share(capsys):
    model = Dummy(nn.Linear(10, 5))
    with DataParallel(model, [cpu(0), cpu(1)], threads=[1, 1]) as dp:
        y = dp(torch.randn(50, 10))
    assert y.shape == (50, 5)
    lines = sorted(capsys.readouterr().out.splitlines())
    assert lines == ["Dummy.forward (25, 10) cpu(0)", "Dummy.forward (25, 10) cpu(1)"]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_outputs_and_gradients_match_the_plain_module(k):
    torch.manual_seed(k)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    ref = copy_to(net, cpu(0))
    X, y = torch.randn(11, 1, 8, 8), torch.randint(0, 3, (11,))
    nn.functional.cross_entropy(ref(X), y).backward()
    with DataParallel(net, [cpu(i) for i in range(k)]) as dp:
        out = dp(X)
        torch.testing.assert_close(out, ref(X))
        nn.functional.cross_entropy(out, y).backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_no_grad_forward_builds_no_graph():
    net = nn.Linear(3, 2)
    with DataParallel(net, [cpu(0), cpu(1)]) as dp, torch.no_grad():
        assert not dp(torch.randn(4, 3)).requires_grad


def test_module_on_other_device_than_first_is_rejected():
    net = copy_to(nn.Linear(3, 2), cpu(1))
    with pytest.raises(DeviceMismatchError, match="the module is on cpu\\(1\\) but devices\\[0\\] is cpu\\(0\\)"):
        DataParallel(net, [cpu(0), cpu(1)])


def test_duplicate_devices_rejected():
    with pytest.raises(UsageError, match="listed twice"):
        DataParallel(nn.Linear(3, 2), [cpu(0), cpu(0)])


@pytest.mark.gpu
def test_data_parallel_on_gpus():
    n = torch.cuda.device_count()
    net = nn.Linear(10, 5).to("cuda:0")
    with DataParallel(net, [gpu(i) for i in range(n)]) as dp:
        x = torch.randn(8, 10, device="cuda:0")
        torch.testing.assert_close(dp(x), net(x))


def test_default_devices_are_every_gpu_or_the_modules_own_device(capsys):
    model = Dummy(nn.Linear(10, 5))
    if torch.cuda.is_available():
        model.to("cuda:0")
    with DataParallel(model) as dp:  # torch.nn.DataParallel's default: all GPUs
        y = dp(torch.randn(8, 10, device=dp.devices[0].torch_device))
        assert dp.devices == ([gpu(i) for i in range(torch.cuda.device_count())] or [cpu(0)])
    assert y.shape == (8, 5) and len(capsys.readouterr().out.splitlines()) == len(dp.devices)
    if not torch.cuda.is_available():
        with DataParallel(copy_to(nn.Linear(2, 2), cpu(1))) as dp:
            assert dp.devices == [cpu(1)]


def test_output_is_on_the_first_device_and_uneven_batches_split():
    net = copy_to(nn.Linear(3, 2), cpu(1))
    with DataParallel(net, [cpu(1), cpu(0)], threads=[1, 1]) as dp:
        out = dp(torch.randn(5, 3))  # 3 + 2 rows: the wrapper splits as evenly as it can
    assert out.shape == (5, 2) and device_of(out) == cpu(1)


seen: list = []  # (mode, device) per replica's forward


class Structured(nn.Module):
    """Positional token ids, a dict of options with a plain value; returns a dict with a tuple and a scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, ids, extra):
        h = self.embed(ids).mean(1) * extra["scale"]
        seen.append((extra["mode"], str(device_of(h))))
        return {"logits": self.out(h), "pair": (h.sum(-1), ids[:, 0]), "mode": extra["mode"], "total": h.sum()}


def test_structured_inputs_and_outputs_match_the_plain_module():
    torch.manual_seed(0)
    net = Structured()
    ref = copy_to(net, cpu(0))
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    ids, scale = torch.randint(0, 20, (5, 3), generator=g), torch.rand(5, 1, generator=g)
    extra = {"scale": scale, "mode": "train"}
    want = ref(ids, extra)
    seen.clear()
    with DataParallel(net, [cpu(0), cpu(1)], threads=[1, 1]) as dp:
        got = dp(ids, extra)
    assert sorted(seen) == [("train", "cpu(0)"), ("train", "cpu(1)")]  # the plain value went to every device
    assert list(got) == list(want)
    torch.testing.assert_close(got["logits"], want["logits"])
    torch.testing.assert_close(got["pair"][0], want["pair"][0])
    assert torch.equal(got["pair"][1], want["pair"][1]) and got["mode"] == "train"
    # a 0-d output is gathered as one value per device, as torch.nn.DataParallel does
    parts = ref(ids[:3], {"scale": scale[:3], "mode": "train"})["total"], ref(ids[3:], {"scale": scale[3:],
                                                                                       "mode": "train"})["total"]
    torch.testing.assert_close(got["total"], torch.stack(parts))
    assert device_of(got["logits"]) == cpu(0)


def test_outputs_of_different_structures_are_one_error():
    class Moody(nn.Module):
        def forward(self, x):
            return {"a": x} if float(x[0, 0]) > 0 else {"b": x}

    x = torch.tensor([[1.0], [-1.0]])
    with DataParallel(Moody(), [cpu(0), cpu(1)], threads=[1, 1]) as dp:
        with pytest.raises(UsageError, match=r"differ in structure \(dict\{a: float32\[1,1\]\} and dict\{b: "):
            dp(x)

"""make_step(): the hybrid training step equals the eager step on fresh random inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dlperf.hybrid import HybridizeWarning
from dlperf.hybrid.bench_mode import make_step
from dlperf.models import get_spec, model_names

HEAVY = {"fcn-s", "alexnet-s", "resnet-50"}


def _eager_step(model, loss_fn, optimizer, x, y):
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n
                                  for n in model_names()])
def test_hybrid_step_equals_eager_step(name):
    torch.manual_seed(0)
    spec = get_spec(name)
    eager = spec.build()
    hybrid = copy.deepcopy(eager)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    opt_h = torch.optim.SGD(hybrid.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    ex, ey = spec.input.make_batch(2, generator=g)
    step = make_step(hybrid, spec.loss, opt_h, ex, ey)
    for _ in range(3):
        x, y = spec.input.make_batch(2, generator=g)
        lh = step(x, y)
        le = _eager_step(eager, spec.loss, opt_e, x, y)
        torch.testing.assert_close(lh, le, rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(hybrid.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    for b, c in zip(hybrid.buffers(), eager.buffers()):
        torch.testing.assert_close(b, c)


def test_uncapturable_model_falls_back_to_eager_with_warning():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x) if x.mean() > 0 else -self.fc(x)

    torch.manual_seed(0)
    model = Branchy()
    ref = copy.deepcopy(model)
    opt, opt_r = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    loss_fn = nn.functional.cross_entropy
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 1])
    with pytest.warns(HybridizeWarning, match="control flow"):
        step = make_step(model, loss_fn, opt, x, y)
    torch.testing.assert_close(step(x, y), _eager_step(ref, loss_fn, opt_r, x, y))
    assert step.hybrid_module.state == "eager"


@pytest.mark.timeout(120)
def test_the_hybrid_step_does_not_import_bench():
    import subprocess
    import sys

    code = ("import sys, dlperf.hybrid, dlperf.hybrid.bench_mode, dlperf.hybrid.export; "
            "print(sorted(m for m in sys.modules if m.startswith('dlperf.bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=True)
    assert out.stdout.strip() == "[]"

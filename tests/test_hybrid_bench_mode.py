"""The training steps behind ``dlperf bench``'s hybrid variants (dlperf.hybrid.bench_mode): ``make_captured_step``
(``--mode hybrid``, the whole step captured) and ``make_step`` (the forward replayed) each train to the eager
step's losses and weights on fresh random inputs, and a model that cannot be captured runs eagerly and says why."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dlperf.bench import report
from dlperf.bench.modes import get_mode
from dlperf.bench.runner import BenchConfig, run_bench
from dlperf.devices import cpu
from dlperf.hybrid import HybridizeWarning, TrainStep
from dlperf.hybrid.bench_mode import make_step
from dlperf.models import get_spec, model_names
from dlperf.models.spec import unregister, user_network
from support.training import Branchy, branchy_batch, reference_step

STEPS = 12
HEAVY = {"fcn-s", "alexnet-s", "resnet-50"}


def _train_side_by_side(make, model, loss_fn, make_batch, seed, *, steps=STEPS, tol=(1e-4, 1e-5), **make_kwargs):
    """The step ``make`` builds and the eager step, each on its own copy, over the same fresh batches: losses,
    weights and buffers agree within ``tol`` (rtol, atol)."""
    rtol, atol = tol
    torch.manual_seed(seed)
    eager = copy.deepcopy(model)
    opt_h = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    g = torch.Generator().manual_seed(seed + 1)
    ex, ey = make_batch(g)
    step = make(model, loss_fn, opt_h, ex, ey, **make_kwargs)
    for _ in range(steps):
        x, y = make_batch(g)
        torch.testing.assert_close(step(x, y), reference_step(eager, loss_fn, opt_e, x, y), rtol=rtol, atol=atol)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=name)
    for b, c in zip(model.buffers(), eager.buffers()):
        torch.testing.assert_close(b, c)
    return step


# -- make_captured_step: what ``dlperf bench --mode hybrid`` times ---------------------------------------------
@pytest.mark.parametrize("name,backend", [("mlp", "native"), ("mlp", "graph"), ("mlp", "auto"),
                                          ("lenet", "graph"), ("lenet", "auto")])
def test_the_hybrid_mode_step_trains_to_eagers_weights(name, backend):
    spec = get_spec(name)
    torch.manual_seed(3)
    step = _train_side_by_side(get_mode("hybrid"), spec.build(), spec.loss,
                               lambda g: spec.input.make_batch(4, generator=g), 7, backend=backend)
    assert isinstance(step, TrainStep) and step.state == "replay"
    if backend != "auto":  # auto may time the eager step fastest; then it says so, see below
        assert step.runs_on == backend and step.eager_reason is None
    elif step.runs_on == "eager":
        assert step.eager_reason and ("fastest step" in step.eager_reason or "kept within noise" in step.eager_reason)


def test_a_model_that_cannot_be_captured_trains_eagerly_and_says_why():
    torch.manual_seed(0)
    with pytest.warns(HybridizeWarning, match="control flow"):
        step = _train_side_by_side(get_mode("hybrid"), Branchy(), nn.functional.cross_entropy, branchy_batch, 11)
    assert step.state == "eager" and step.runs_on == "eager"
    assert "control flow" in step.eager_reason and "\n" not in step.eager_reason


def test_a_bench_cell_names_what_stepped_it_and_why_eager():
    name = "test_hybrid_bench_mode:branchy"
    user_network(name, Branchy, lambda model, g: torch.randn(4, 6, generator=g))
    try:
        config = BenchConfig(networks=[name, "mlp"], devices=[cpu()], threads=[1], warmup=1, steps=2, mode="hybrid")
        with pytest.warns(HybridizeWarning, match="control flow"):
            result = run_bench(config)
    finally:
        unregister(name)
    branchy, mlp = result.cells
    assert branchy.error is None and mlp.error is None
    assert branchy.backend == "eager" and "control flow" in branchy.eager_reason
    assert branchy.to_dict()["eager_reason"] == branchy.eager_reason
    assert mlp.backend in ("native", "graph", "eager") and mlp.to_dict()["mode"] == "hybrid"
    assert (mlp.eager_reason is None) == (mlp.backend != "eager")
    notes = report.footnotes(result)
    assert any(line.startswith(f"  {name}, cpu(0) 1 thread: eager, ") and "control flow" in line for line in notes)


def test_the_mode_is_registered_as_the_captured_step():
    from dlperf.hybrid.bench_mode import make_captured_step

    assert get_mode("hybrid") is make_captured_step


# -- make_step: the forward replayed, autograd recording through it --------------------------------------------
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n
                                  for n in model_names()])
def test_hybrid_step_equals_eager_step(name):
    torch.manual_seed(0)
    spec = get_spec(name)
    _train_side_by_side(make_step, spec.build(), spec.loss, lambda g: spec.input.make_batch(2, generator=g), 0,
                        steps=3, tol=(1e-5, 1e-6))


def test_uncapturable_model_falls_back_to_eager_with_warning():
    torch.manual_seed(0)
    with pytest.warns(HybridizeWarning, match="control flow"):
        step = _train_side_by_side(make_step, Branchy(), nn.functional.cross_entropy, branchy_batch, 0,
                                   tol=(1.3e-6, 1e-5))
    assert step.hybrid_module.state == "eager"


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_the_hybrid_step_does_not_import_bench():
    import subprocess
    import sys

    code = ("import sys, dlperf.hybrid, dlperf.hybrid.bench_mode, dlperf.hybrid.export; "
            "print(sorted(m for m in sys.modules if m.startswith('dlperf.bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=True)
    assert out.stdout.strip() == "[]"

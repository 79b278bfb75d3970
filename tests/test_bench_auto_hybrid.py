"""``dlperf bench --mode auto``'s ``hybrid`` candidate is ``--mode hybrid``'s captured training step: eager's
weights on fresh random batches, applied to the caller's model when chosen, eager with a note when it cannot be."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dlperf.bench import auto, report
from dlperf.bench.runner import BenchConfig, run_bench
from dlperf.devices import cpu
from dlperf.hybrid import HybridizeWarning, TrainStep
from dlperf.models import get_spec
from dlperf.timing import Timing
from support.training import Branchy, branchy_batch, reference_step

STEPS = 6


@pytest.fixture(autouse=True)
def no_planner_no_compile(monkeypatch):
    # The hybrid candidate is under test: the planner's plan and torch.compile are other candidates. (The
    # cache stays the user's: the native backend's build is kept there, minutes to make again under load.)
    monkeypatch.setattr(auto, "USE_PLANNER", False)
    monkeypatch.setattr(auto, "COMPILE_BOUND_S", 0.0)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)


def _train_beside_eager(step, model, reference, loss_fn, make_batch, g):
    """``step`` (training ``model``) and the eager step (training ``reference``) on the same fresh batches."""
    opt_e = _sgd(reference)
    for _ in range(STEPS):
        x, y = make_batch(g)
        torch.testing.assert_close(step(x, y), reference_step(reference, loss_fn, opt_e, x, y), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    for b, c in zip(model.buffers(), reference.buffers()):
        torch.testing.assert_close(b, c)


@pytest.mark.parametrize("name,backend", [("mlp", "native"), ("mlp", "graph"), ("lenet", "graph"), ("mlp", "auto")])
def test_the_hybrid_candidate_is_the_captured_step_and_trains_to_eagers_weights(monkeypatch, name, backend):
    monkeypatch.setattr(auto, "HYBRID_BACKEND", backend)
    spec = get_spec(name)
    torch.manual_seed(5)
    model = spec.build()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(6)
    ex, ey = spec.input.make_batch(4, generator=g)
    step = auto.candidates(model, spec.loss, ex, ey, 1, 0.0, {})["hybrid"](model, _sgd(model))
    assert isinstance(step, TrainStep) and step.state == "replay"
    if backend != "auto":  # auto may time the eager step fastest; then auto's search leaves it out
        assert step.runs_on == backend and step.eager_reason is None
    # the capture on the example batch changed nothing: the first step starts from eager's weights
    _train_beside_eager(step, model, reference, spec.loss, lambda g: spec.input.make_batch(4, generator=g), g)


def _time_hybrid_faster(monkeypatch, keep=("eager", "hybrid")):
    """Candidates cut to ``keep``, and timings that make the captured step twice as fast as eager: which one
    wins is fixed here, so that what a win does to the caller's model is under test."""
    real = auto.candidates

    def candidates(*args, **kwargs):
        return {name: b for name, b in real(*args, **kwargs).items() if name in keep}

    def time_steps(fn, *, warmup, steps, threads=None, **kwargs):
        fn()  # the candidate's twin really steps
        return Timing.from_samples([0.005 if isinstance(fn.func, TrainStep) else 0.010] * steps)

    monkeypatch.setattr(auto, "candidates", candidates)
    monkeypatch.setattr(auto, "time_steps", time_steps)


def test_when_hybrid_is_chosen_the_callers_model_and_optimizer_train(monkeypatch):
    monkeypatch.setattr(auto, "HYBRID_BACKEND", "graph")
    _time_hybrid_faster(monkeypatch)
    spec = get_spec("mlp")
    torch.manual_seed(8)
    model = spec.build()
    reference, initial = copy.deepcopy(model), copy.deepcopy(model)
    g = torch.Generator().manual_seed(9)
    ex, ey = spec.input.make_batch(4, generator=g)
    optimizer = _sgd(model)
    step = auto.make_step(model, spec.loss, optimizer, ex, ey, rounds=2)
    assert step.mode_chosen == "hybrid" and step.gain_over_eager == pytest.approx(2.0)
    assert step.backend == "graph"
    assert step.auto_reason.startswith("hybrid (captured step, graph): 2.00x over eager")
    # the search stepped copies: the caller's weights and optimizer are as they were, and now train
    assert not optimizer.state
    for p, q in zip(model.parameters(), initial.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    _train_beside_eager(step, model, reference, spec.loss, lambda g: spec.input.make_batch(4, generator=g), g)
    assert all("momentum_buffer" in optimizer.state[p] for p in model.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), initial.parameters()))


def test_under_the_auto_backend_the_callers_model_gets_the_backend_that_was_timed(monkeypatch):
    """The caller's capture is told the backend the candidate's timing chose: left to choose again, it would
    time the backends a second time, on the caller's model, and might keep another one."""
    from dlperf.hybrid import bench_mode

    monkeypatch.setattr(auto, "HYBRID_BACKEND", "auto")
    _time_hybrid_faster(monkeypatch)
    asked = []
    real = bench_mode.make_captured_step

    def make_captured_step(*args, backend, **kwargs):
        asked.append(backend)
        return real(*args, backend=backend, **kwargs)

    monkeypatch.setattr(bench_mode, "make_captured_step", make_captured_step)
    spec = get_spec("mlp")
    torch.manual_seed(3)
    model = spec.build()
    ex, ey = spec.input.make_batch(4, generator=torch.Generator().manual_seed(4))
    step = auto.make_step(model, spec.loss, _sgd(model), ex, ey, rounds=2)
    timed = step.auto_choice.runs_on["hybrid"]
    assert step.mode_chosen == "hybrid" and timed in auto.REPLAY_BACKENDS
    assert asked == ["auto", timed] and step.runs_on == timed and step.backend == timed


def test_a_chosen_step_that_falls_back_to_eager_says_why_in_the_cell(monkeypatch):
    monkeypatch.setattr(auto, "HYBRID_BACKEND", "graph")
    _time_hybrid_faster(monkeypatch)
    spec = get_spec("mlp")
    model = spec.build()
    ex, ey = spec.input.make_batch(4, generator=torch.Generator().manual_seed(5))
    step = auto.make_step(model, spec.loss, _sgd(model), ex, ey, rounds=2)
    assert step.eager_reason is None and step.runs_on == "graph"
    monkeypatch.setattr(TrainStep, "eager_reason", property(lambda self: "a new input signature cannot be captured"))
    monkeypatch.setattr(TrainStep, "runs_on", property(lambda self: "eager"))
    # what runs the step is read when asked: the report follows a fallback after the choice
    assert step.eager_reason == "a new input signature cannot be captured" and step.backend == "eager"


def test_a_model_that_cannot_be_captured_runs_eagerly_with_the_reason_in_a_note(recwarn):
    torch.manual_seed(1)
    model = Branchy()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    loss_fn = nn.functional.cross_entropy
    step = auto.make_step(model, loss_fn, _sgd(model), *branchy_batch(g), rounds=1)
    choice = step.auto_choice
    assert "hybrid" not in choice.medians and step.mode_chosen != "hybrid"
    assert choice.notes["hybrid"].startswith("not applicable (runs eagerly: cannot capture the training step")
    assert "control flow" in choice.notes["hybrid"] and "hybrid: not applicable" in step.auto_reason
    assert not [w for w in recwarn if issubclass(w.category, HybridizeWarning)]  # a note, not a warning
    _train_beside_eager(step, model, reference, loss_fn, branchy_batch, g)


def test_a_captured_step_that_keeps_the_eager_step_is_left_out_with_its_reason(monkeypatch):
    monkeypatch.setattr(auto, "HYBRID_BACKEND", "eager")  # as when its own timing finds eager fastest
    spec = get_spec("mlp")
    model = spec.build()
    x, y = spec.input.make_batch(4)
    choice, _ = auto.choose(model, spec.loss, _sgd(model), x, y, rounds=1)
    assert "hybrid" not in choice.medians and choice.chosen != "hybrid"
    assert choice.notes["hybrid"] == "not applicable (the captured step runs eagerly: requested)"


def test_a_bench_cell_that_chose_hybrid_names_the_captured_steps_backend(monkeypatch):
    monkeypatch.setattr(auto, "HYBRID_BACKEND", "native")
    _time_hybrid_faster(monkeypatch)
    result = run_bench(BenchConfig(networks=["mlp"], devices=[cpu()], threads=[1], warmup=1, steps=2, mode="auto"))
    (cell,) = result.cells
    assert cell.error is None and cell.mode_chosen == "hybrid" and cell.backend == "native"
    doc = cell.to_dict()
    assert doc["backend"] == "native" and doc["mode_chosen"] == "hybrid"
    assert doc["auto_reason"].startswith("hybrid (captured step, native): 2.00x over eager")
    assert cell.eager_reason is None
    header, rows = report.table_grid(result)
    by_label = {row[2]: row[3] for row in rows}
    assert by_label["backend"] == "native" and by_label["auto choice"] == "hybrid"

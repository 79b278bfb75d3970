"""hybridize(): the state machine, capture diagnostics, and eager equality for every zoo model."""

from __future__ import annotations

import copy
import logging
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from dlperf.errors import UsageError
from dlperf.hybrid import CaptureError, HybridizeWarning, backend_names, hybridize
from dlperf.models import get_spec, model_names

HEAVY = {"fcn-s", "alexnet-s", "resnet-50"}  # hundreds of MB or seconds per step: slow set only


def _zoo(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in names]


def _batch(name: str, n: int, seed: int):
    return get_spec(name).input.make_batch(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backend", ["graph", "auto"])
@pytest.mark.parametrize("name", _zoo(model_names()))
def test_forward_and_gradients_equal_eager(name, backend):
    torch.manual_seed(0)
    spec = get_spec(name)
    eager = spec.build()
    hybrid_inner = copy.deepcopy(eager)
    net = hybridize(hybrid_inner, backend=backend)
    for seed in (1, 2):  # the second call replays
        x, y = _batch(name, 2, seed)
        with warnings.catch_warnings():
            warnings.simplefilter("error", HybridizeWarning)  # no fallback, no re-capture
            out = net(x)
        ref = eager(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        spec.loss(out, y).backward()
        spec.loss(ref, y).backward()
    assert net.state == "replay"
    for (pn, p), (_, q) in zip(hybrid_inner.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=pn)
    # Auto's trial calls must not leave extra BatchNorm updates behind.
    for (bn, b), (_, c) in zip(hybrid_inner.named_buffers(), eager.named_buffers()):
        torch.testing.assert_close(b, c, msg=bn)


def test_inference_under_no_grad_matches_eager_on_fresh_inputs():
    torch.manual_seed(0)
    model = get_spec("mlp").build()
    net = hybridize(model)
    with torch.no_grad():
        for seed in range(5):
            x, _ = _batch("mlp", 1, seed)
            torch.testing.assert_close(net(x), model(x), rtol=1e-5, atol=1e-6)


def test_state_machine_transitions():
    net = hybridize(nn.Sequential(nn.Linear(3, 2)), backend="graph")
    assert net.state == "capture"
    net(torch.randn(4, 3))
    assert net.state == "replay"
    net.eager()
    assert net.state == "eager" and not net.choices
    net.reset()
    assert net.state == "capture"
    net.capture(torch.randn(4, 3))
    assert net.state == "replay" and not net.choices  # captured, no runner prepared yet


def test_signature_change_warns_and_reprepares():
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
    net = hybridize(model, backend="graph")
    net(torch.randn(4, 3))
    with pytest.warns(HybridizeWarning, match=r"signature changed to \(float32\[5, 3\]"):
        out = net(torch.randn(5, 3))
    assert out.shape == (5, 2)
    with pytest.warns(HybridizeWarning, match="float64"):
        out = net.double()(torch.randn(5, 3, dtype=torch.float64))
    assert out.dtype == torch.float64
    assert len(net.choices) == 3


def test_max_signatures_then_eager_with_one_warning():
    model = nn.Linear(3, 2)
    net = hybridize(model, backend="graph", max_signatures=1)
    net(torch.randn(1, 3))
    x2 = torch.randn(2, 3)
    with pytest.warns(HybridizeWarning, match="max_signatures=1"):
        out = net(x2)
    torch.testing.assert_close(out, model(x2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", HybridizeWarning)
        x = torch.randn(3, 3)
        torch.testing.assert_close(net(x), model(x))  # eager, silently after the one warning


def test_train_eval_switch_is_a_new_signature():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    net = hybridize(model, backend="graph")
    x = torch.randn(8, 4)
    net(x)
    net.eval()
    with pytest.warns(HybridizeWarning, match="eval"):
        out = net(x)
    torch.testing.assert_close(out, model(x))


class DataDependentIf(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        if x.sum() > 0:  # the offending line
            return self.fc(x)
        return -x


class AsNumpy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        x.numpy()  # d2l exercise: asnumpy() inside forward
        return self.fc(x)


class PythonLoop(nn.Module):
    """Control flow on Python values only: captured by unrolling."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(3))
        self.double_last = True

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        if self.double_last:
            x = x * 2
        return x


def test_data_dependent_control_flow_reports_the_line():
    with pytest.raises(CaptureError, match=r"control flow.*test_hybrid\.py:\d+: if x\.sum\(\) > 0"):
        hybridize(DataDependentIf(), strict=True)(torch.randn(2, 3))


def test_data_dependent_control_flow_falls_back_to_eager_with_warning():
    model = DataDependentIf()
    net = hybridize(model)
    x = torch.randn(2, 3)
    with pytest.warns(HybridizeWarning, match=r"if x\.sum\(\) > 0"):
        out = net(x)
    assert net.state == "eager"
    torch.testing.assert_close(out, model(x))
    assert "eager because" in repr(net)
    torch.testing.assert_close(net(-x.abs() - 1), model(-x.abs() - 1))  # both branches still right


def test_numpy_inside_forward_is_refused_with_the_line():
    with pytest.raises(CaptureError, match=r"numpy\(\).*x\.numpy\(\)"):
        hybridize(AsNumpy(), strict=True)(torch.randn(2, 3))


def test_python_control_flow_is_unrolled():
    model = PythonLoop()
    net = hybridize(model, backend="graph")
    for _ in range(2):
        x = torch.randn(2, 3)
        torch.testing.assert_close(net(x), model(x))
    assert net.state == "replay"


class Printing(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(3, 4)
        self.output = nn.Linear(4, 2)

    def forward(self, x):
        print("value x:", x)
        return self.output(torch.relu(self.hidden(x)))


def test_print_in_forward_runs_at_capture_only(capsys):
    model = Printing()
    x = torch.randn(1, 3)
    model(x)
    assert "tensor(" in capsys.readouterr().out  # eager prints numbers
    net = hybridize(model, backend="graph")
    first = net(x)
    printed = capsys.readouterr().out
    # Capture prints the symbolic stand-in (as MXNet printed a Symbol), and the eager reference
    # run that checks the new runner prints once more.
    assert "value x: Proxy(x)" in printed and printed.count("value x:") == 2
    second = net(x)
    assert capsys.readouterr().out == ""  # replay: no Python runs, nothing printed
    torch.testing.assert_close(first, second)


class Counting(nn.Module):
    """Records every run of forward's Python outside the module, as a print there would print."""

    def __init__(self, runs: list):
        super().__init__()
        self.hidden = nn.Linear(3, 4)
        self.output = nn.Linear(4, 2)
        self.record = runs.append  # a bound method: calling it changes no attribute of the module

    def forward(self, x):
        self.record(type(x).__name__)
        return self.output(torch.relu(self.hidden(x)))


@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "no_grad"])
@pytest.mark.parametrize("backend", ["graph", "auto"])
def test_forward_python_runs_a_documented_number_of_times(backend, grad):
    # graph: capture (symbolic) + the eager reference run that checks the replay.
    # auto: the same + AUTO_PYTHON_TRIALS timing runs of eager + the call itself if eager wins.
    from dlperf.hybrid.hybridize import AUTO_PYTHON_TRIALS

    record: list[str] = []
    model = Counting(record)
    net = hybridize(model, backend=backend)
    x = torch.randn(2, 3)
    with torch.set_grad_enabled(grad):
        first = net(x)
        runs = list(record)
        for _ in range(5):
            torch.testing.assert_close(net(x), first)
    assert runs[0] == "Proxy" and set(runs[1:]) == {"Tensor"}
    (choice,) = net.choices.values()
    expected = 2 if backend == "graph" else 2 + AUTO_PYTHON_TRIALS + (choice.backend == "eager")
    assert len(runs) == expected, (runs, choice)
    assert len(record) == len(runs)  # later calls replay: forward's Python never runs again
    assert AUTO_PYTHON_TRIALS <= 3


def test_auto_says_which_backend_and_why(caplog):
    net = hybridize(get_spec("mlp").build())
    with caplog.at_level(logging.INFO, logger="dlperf.hybrid"), torch.no_grad():
        net(torch.randn(1, 512))
    (choice,) = net.choices.values()
    assert choice.backend in backend_names()
    assert "us/call" in choice.reason or "only candidate" in choice.reason
    assert choice.reason in repr(net)
    assert any(choice.backend in r.message and "us" in r.message for r in caplog.records)


def test_unknown_backend_lists_choices():
    with pytest.raises(UsageError, match="valid choices: auto, .*graph"):
        hybridize(nn.Linear(2, 2), backend="tvm")


def test_keyword_inputs_run_eagerly_with_warning_and_plain_values_are_captured():
    class Scale(nn.Module):
        def forward(self, x, k=2.0):
            return x * k

    net = hybridize(Scale(), backend="graph")
    with pytest.warns(HybridizeWarning, match="keyword"):
        assert torch.equal(net(torch.ones(2), k=3.0), torch.full((2,), 3.0))
    # A plain value beside the tensors is part of the input structure: each value gets its own graph.
    with torch.no_grad():
        assert torch.equal(net(torch.ones(2), 4.0), torch.full((2,), 4.0))
        assert torch.equal(net(torch.ones(2), 5.0), torch.full((2,), 5.0))
        assert torch.equal(net(torch.ones(2), 4.0), torch.full((2,), 4.0))
    assert len(net.choices) == 2 and "inputs tuple(float32[2], float)" in repr(net), repr(net)


def test_state_dict_is_the_wrapped_modules():
    model = nn.Linear(2, 2)
    net = hybridize(model)
    assert net.state_dict().keys() == model.state_dict().keys()
    assert list(net.parameters()) == list(model.parameters())


def test_optimizer_updates_are_seen_by_replay():
    model = get_spec("mlp").build()
    net = hybridize(model)
    x = torch.randn(1, 512)
    with torch.no_grad():
        net(x)
        for p in model.parameters():
            p.add_(0.5)
        torch.testing.assert_close(net(x), model(x), rtol=1e-5, atol=1e-6)


COMPILE_SCRIPT = """
import copy, torch
from dlperf.hybrid import hybridize
from dlperf.models import get_spec
torch.manual_seed(0)
model = get_spec("mlp").build()
net = hybridize(copy.deepcopy(model), backend="compile")
for _ in range(2):
    x = torch.randn(4, 512)
    torch.testing.assert_close(net(x), model(x), rtol=1e-4, atol=1e-5)
assert [c.backend for c in net.choices.values()] == ["compile"]
"""


@pytest.mark.slow
def test_compile_backend_matches_eager():
    # In a child process: inductor keeps a compile thread pool alive for the life of the process.
    subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], check=True, timeout=600)


@pytest.mark.gpu
def test_cuda_graphs_inference_and_training_match_eager():
    torch.manual_seed(0)
    model = get_spec("resnet-56").build().cuda()
    ref = copy.deepcopy(model)
    net = hybridize(model, backend="cuda_graphs")
    x, y = (t.cuda() for t in _batch("resnet-56", 4, 0))
    with torch.no_grad():
        net.eval(), ref.eval()
        torch.testing.assert_close(net(x), ref(x), rtol=1e-4, atol=1e-4)
        x2 = torch.randn_like(x)
        kept = net(x)
        torch.testing.assert_close(net(x2), ref(x2), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kept, ref(x), rtol=1e-4, atol=1e-4)  # not overwritten by replay
    net.train(), ref.train()
    out = net(x)
    spec = get_spec("resnet-56")
    spec.loss(out, y).backward()
    spec.loss(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)
    assert all(c.backend == "cuda_graphs" for c in net.choices.values())


@pytest.mark.gpu
def test_auto_on_gpu_picks_a_working_backend_for_the_mlp():
    model = get_spec("mlp").build().cuda()
    net = hybridize(copy.deepcopy(model))
    x = torch.randn(1, 512, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(net(x), model(x), rtol=1e-5, atol=1e-6)
    assert "us/call" in repr(net)


def test_a_backend_with_wrong_gradients_is_never_used():
    from dlperf.hybrid.backends import registry

    def detached(captured, example_args):
        # Right values, wrong autograd history: the gradients w.r.t. parameters vanish.
        return lambda x: captured.module(x).detach().requires_grad_()

    registry.register_backend(registry.Backend(
        name="test-detached", prepare=detached, supports_grad=True, devices=("cpu",), in_auto=False,
        description="test double"))
    try:
        model = nn.Linear(3, 2)
        net = hybridize(model, candidates=["test-detached", "graph"])
        out = net(torch.randn(4, 3))
        (choice,) = net.choices.values()
        assert choice.backend == "graph"
        assert "test-detached: gradients differ from eager" in choice.reason
        out.sum().backward()
        assert model.weight.grad is not None
    finally:
        registry._BACKENDS.remove("test-detached")


def test_auto_in_training_times_forward_and_backward():
    net = hybridize(get_spec("mlp").build(), candidates=["eager", "graph"])
    net(torch.randn(2, 512))
    (choice,) = net.choices.values()
    assert "us/forward+backward" in choice.reason


def test_layers_with_hooks_keep_running_their_hooks():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    seen = []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    net = hybridize(model, backend="graph")
    net(torch.randn(2, 3))
    before = len(seen)
    net(torch.randn(2, 3))
    assert len(seen) == before + 1  # the replay still ran the hook
    assert "call_module" in {n.op for n in net._captured.graph_module.graph.nodes}


def test_two_input_module_replays_without_re_preparing():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(4, 2)

        def forward(self, x, z):
            return self.a(x) * self.b(z)

    model = Pair()
    net = hybridize(model, backend="graph")
    with warnings.catch_warnings():
        warnings.simplefilter("error", HybridizeWarning)
        for _ in range(3):
            x, z = torch.randn(2, 3), torch.randn(2, 4)
            torch.testing.assert_close(net(x, z), model(x, z))
    assert len(net.choices) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("modifies_inputs", [True, False])
def test_auto_trials_time_an_input_mutating_forward_on_fresh_copies(modifies_inputs):
    from dlperf.hybrid.capture import ModuleState

    net = hybridize(nn.Linear(3, 3), backend="auto")
    seen = []

    def run(x):  # halves its input in place, as `x.mul_(0.5)` in a forward would
        seen.append(x.detach().clone())
        return x.mul_(0.5)

    from dlperf.decide import decide
    from dlperf.hybrid.backends.registry import get_backend

    x = torch.full((2, 3), 8.0)
    with torch.no_grad():
        candidate = net._candidate(get_backend("graph"), run, (x,), torch.device("cpu"), ModuleState(net.module),
                                   modifies_inputs)
        verdict = decide([candidate], rounds=3, steps=5, warmup=1)
    assert verdict.best_s["graph"] > 0 and len(seen) >= 4  # one warm-up, at least a timed call a round
    assert torch.equal(x, torch.full((2, 3), 8.0))  # the caller's input is never the one mutated
    # With fresh copies every timed trial starts from the caller's values; without, they decay.
    first = [s[0, 0].item() for s in seen[:6]]
    assert first == ([8.0] * 6 if modifies_inputs else [8.0 * 0.5 ** i for i in range(6)])
    assert all(torch.equal(s, seen[0]) for s in seen) == modifies_inputs

"""d2l §12.1 (compilers and interpreters) as a reader writes it with dlperf's names.

The book's MXNet names and dlperf's: ``nn.HybridSequential`` + ``net.hybridize()`` ->
``dlperf.hybrid.hybridize(net)``; ``net.export('my_mlp')`` -> ``dlperf.hybrid.export(net, dir,
(x,))``; ``SymbolBlock.imports`` -> ``dlperf.hybrid.load(dir)``; ``np.random.normal`` ->
``dlperf.engine.array.random.normal``; ``npx.waitall()`` -> ``dlperf.engine.waitall()``.
"""

from __future__ import annotations

import json
import time
import warnings

import pytest
import torch
from torch import nn

from dlperf.engine import array as np
from dlperf.engine import create_engine, waitall
from dlperf.hybrid import CaptureError, HybridizeWarning, export, hybridize, load
from dlperf.hybrid.hybridize import AUTO_PYTHON_TRIALS


@pytest.fixture
def eng():
    with create_engine(cpu_threads=1) as e:
        yield e


def test_imperative_program_runs_statement_by_statement():
    def add(a, b):
        return a + b

    def fancy_func(a, b, c, d):
        e = add(a, b)
        f = add(c, d)
        return add(e, f)

    assert fancy_func(1, 2, 3, 4) == 10


def test_symbolic_program_is_built_as_text_then_compiled_and_run(capsys):
    # The idea of §12.1.1: the whole program exists before it runs, so it could be optimized.
    parts = ["def add(a, b):\n    return a + b\n",
             "def fancy_func(a, b, c, d):\n    return add(add(a, b), add(c, d))\n",
             "print(fancy_func(1, 2, 3, 4))\n"]
    program = compile("".join(parts), "<fancy>", "exec")
    exec(program, {})
    assert capsys.readouterr().out == "10\n"


def get_net() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 2))


def test_hybridized_mlp_gives_the_same_output_on_engine_arrays(eng):
    torch.manual_seed(0)
    x = np.random.normal(size=(1, 512), engine=eng)
    net = get_net()
    before = net(x)
    assert before.shape == (1, 2)  # inferred: the frontend has not waited yet
    net = hybridize(net)
    after = net(x)
    torch.testing.assert_close(after.tensor(), before.tensor())
    torch.testing.assert_close(net(x).tensor(), before.tensor())  # a replay
    assert net.state == "replay"


def _time_1000(net, x) -> float:
    t0 = time.perf_counter()
    for _ in range(1000):
        net(x)
    waitall()
    return time.perf_counter() - t0


@pytest.mark.timeout(120)
def test_benchmark_with_and_without_hybridization_runs_and_agrees():
    # The book times 1000 calls of net(x); dlperf's win is biggest without autograd (see
    # docs/from-the-book.md for figures). Here: both run, and give the same output.
    torch.manual_seed(1)
    x = torch.randn(1, 512)
    net = get_net()
    with torch.no_grad():
        eager_s = _time_1000(net, x)
        hybrid = hybridize(net)
        hybrid(x)  # the first call prepares the replay
        hybrid_s = _time_1000(hybrid, x)
        torch.testing.assert_close(hybrid(x), net(x))
    assert eager_s > 0 and hybrid_s > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hybridization_pays_without_autograd_at_batch_1():
    torch.manual_seed(1)
    x = torch.randn(1, 512)
    net = get_net()
    with torch.no_grad():
        hybrid = hybridize(net)
        hybrid(x)
        eager_s = min(_time_1000(net, x) for _ in range(3))
        hybrid_s = min(_time_1000(hybrid, x) for _ in range(3))
    assert hybrid_s < eager_s, (eager_s, hybrid_s)


def test_export_and_load_round_trip(tmp_path):
    torch.manual_seed(2)
    x = torch.randn(1, 512)
    net = hybridize(get_net())
    with torch.no_grad():
        expected = net(x)
    files = export(net.module, tmp_path / "my_mlp", (x,))
    names = sorted(p.name for p in (tmp_path / "my_mlp").iterdir())
    assert names == ["graph.json", "params.safetensors"], files
    graph = json.loads((tmp_path / "my_mlp" / "graph.json").read_text())
    assert "nodes" in graph  # the program, apart from the (binary) parameters
    loaded = load(tmp_path / "my_mlp")  # no Python class of the model needed
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), expected)
        torch.testing.assert_close(loaded(torch.randn(4, 512)).shape, torch.Size([4, 2]))


class HybridNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(3, 4)
        self.output = nn.Linear(4, 2)

    def forward(self, x):
        print("value x:", type(x).__name__)
        x = torch.relu(self.hidden(x))
        print("result:", type(x).__name__)
        return self.output(x)


def test_print_in_forward_shows_stand_ins_at_capture_then_nothing(capsys):
    torch.manual_seed(3)
    net = HybridNet()
    x = torch.randn(1, 3)
    y = net(x)
    assert capsys.readouterr().out == "value x: Tensor\nresult: Tensor\n"
    net = hybridize(net, backend="graph")
    torch.testing.assert_close(net(x), y)
    printed = capsys.readouterr().out.splitlines()
    # Capture sees symbolic stand-ins (MXNet: Symbols), then one eager reference run checks the replay.
    assert printed == ["value x: Proxy", "result: Proxy", "value x: Tensor", "result: Tensor"]
    torch.testing.assert_close(net(x), y)
    assert capsys.readouterr().out == ""  # replays skip the Python


def test_print_count_with_auto_is_bounded_and_documented(capsys):
    net = hybridize(HybridNet())
    x = torch.randn(1, 3)
    with torch.no_grad():
        for _ in range(4):
            net(x)
    runs = capsys.readouterr().out.count("value x:")
    (choice,) = net.choices.values()
    assert runs == 2 + AUTO_PYTHON_TRIALS + (choice.backend == "eager")


# ------------------------------------------------------------------------------------------ exercises
class Concurrent(nn.Module):
    """Exercise 1: branches applied to the same input, outputs concatenated (HybridConcurrent)."""

    def __init__(self, *branches: nn.Module):
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x):
        return torch.cat([b(x) for b in self.branches], dim=1)


def test_exercise_1_concurrent_branches_hybridize():
    torch.manual_seed(4)
    net = Concurrent(nn.Linear(8, 3), nn.Sequential(nn.Linear(8, 4), nn.Tanh()), nn.Identity())
    x = torch.randn(5, 8)
    hybrid = hybridize(net, backend="graph")
    torch.testing.assert_close(hybrid(x), net(x))
    torch.testing.assert_close(hybrid(x), net(x))
    assert hybrid.state == "replay" and hybrid(x).shape == (5, 15)


class NumpyInForward(HybridNet):
    def forward(self, x):
        x.numpy()
        return super().forward(x)


def test_exercise_2_asnumpy_in_forward_is_refused_with_the_line():
    with pytest.warns(HybridizeWarning, match="x.numpy()"):
        net = hybridize(NumpyInForward())
        net(torch.randn(1, 3))
    assert net.state == "eager"  # falls back, and still computes
    with pytest.raises(CaptureError, match="x.numpy()"):
        hybridize(NumpyInForward(), strict=True)(torch.randn(1, 3))


class ValueBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        if x.sum() > 0:  # decided by data: a graph cannot hold both branches
            return self.fc(x)
        return -x


class PythonLoop(nn.Module):
    def __init__(self, depth: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:  # decided by Python values: unrolled at capture
            x = torch.relu(layer(x))
        return x


def test_exercise_3_control_flow_on_data_runs_eagerly_on_python_values_is_unrolled():
    x = torch.randn(2, 3)
    model = ValueBranch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = hybridize(model)
        torch.testing.assert_close(net(x), model(x))
        torch.testing.assert_close(net(-x.abs() - 1), model(-x.abs() - 1))
    assert net.state == "eager" and any("x.sum() > 0" in str(w.message) for w in caught)
    loop = PythonLoop()
    hybrid = hybridize(loop, backend="graph")
    torch.testing.assert_close(hybrid(x), loop(x))
    assert hybrid.state == "replay"


@pytest.mark.parametrize("name", ["lenet", "mlp"])
def test_exercise_4_models_of_earlier_chapters_hybridize(name):
    from dlperf.models import get_spec

    torch.manual_seed(5)
    spec = get_spec(name)
    model = spec.build().eval()
    x, _ = spec.input.make_batch(2)
    hybrid = hybridize(model, backend="graph")
    with torch.no_grad():
        torch.testing.assert_close(hybrid(x), model(x))
        torch.testing.assert_close(hybrid(x), model(x))
    assert hybrid.state == "replay"

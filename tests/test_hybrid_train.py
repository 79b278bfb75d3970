"""The captured training step against the eager step: weights, buffers, optimizer state, fallbacks."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dlperf.batch import map_tensors
from dlperf.hybrid import HybridizeWarning
from dlperf.hybrid.train_step import make_train_step, train_step
from dlperf.steps import eager_step

STEPS = 100
RTOL, ATOL = 1e-4, 1e-5


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


class BNDropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(self.drop(F.relu(self.bn(self.conv(x)))).flatten(1))


class DictTokens(nn.Module):
    """Takes a dict with int64 token ids, as a text model does."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, batch):
        h = self.emb(batch["ids"]).mean(1) * batch["scale"]
        return {"logits": self.fc(h)}


def dict_loss(out, y):
    return F.cross_entropy(out["logits"], y)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd_momentum_wd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True),
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.3, maximize=False),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),  # through its own step()
}


def batches(kind: str, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        if kind == "mlp":
            yield torch.randn(5, 12, generator=g), torch.randint(0, 3, (5,), generator=g)
        elif kind == "cnn":
            yield torch.randn(4, 2, 6, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        else:
            ids = torch.randint(0, 50, (6, 7), generator=g)
            yield {"ids": ids, "scale": torch.rand(6, 1, generator=g)}, torch.randint(0, 3, (6,), generator=g)


def run_both(model: nn.Module, make_opt, kind: str, loss=F.cross_entropy, steps: int = STEPS, seed: int = 0,
             backend: str = "graph", **kwargs):
    reference = copy.deepcopy(model)
    opt_e, opt_c = make_opt(reference.parameters()), make_opt(model.parameters())
    eager, captured = eager_step(reference, loss, opt_e), train_step(model, loss, opt_c, backend=backend, **kwargs)
    for i, (x, y) in enumerate(batches(kind, steps, seed)):
        torch.manual_seed(seed * 1000 + i)  # dropout draws the same masks in both
        le = eager(map_tensors(torch.clone, x), y)  # each its own batch: a forward may change it
        torch.manual_seed(seed * 1000 + i)
        lc = captured(map_tensors(torch.clone, x), y)
        torch.testing.assert_close(lc.detach(), le.detach(), rtol=RTOL, atol=ATOL)
    return reference, model, opt_e, opt_c, captured


def assert_same_state(a: nn.Module, b: nn.Module, opt_a=None, opt_b=None):
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(y, x, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    if opt_a is not None:
        sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
        assert sa.keys() == sb.keys()
        for k in sa:
            for key in sa[k]:
                torch.testing.assert_close(sb[k][key], sa[k][key], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("backend", ["graph", "native"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_100_steps_match_eager_for_every_optimizer(opt, backend):
    seed = sum(map(ord, opt))
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HybridizeWarning)  # rmsprop has no native update: eager, said once
        ref, net, oe, oc, step = run_both(mlp(), OPTIMIZERS[opt], "mlp", seed=seed, backend=backend)
    assert step.state == "replay", repr(step)
    expected = "eager" if backend == "native" and opt == "rmsprop" else backend
    assert set(step.choices.values()) == {expected}, repr(step)
    assert_same_state(ref, net, oe, oc)


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_native_step_with_residual_add_mul_and_flatten_matches_eager(rows):
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.flat = nn.Flatten()
            self.a, self.b, self.c = nn.Linear(12, 12), nn.Linear(12, 12), nn.Linear(12, 3)

        def forward(self, x):
            x = self.flat(x)
            h = torch.relu(self.a(x))
            return self.c(torch.sigmoid(self.b(h)) * h + h)

    torch.manual_seed(rows)
    g = torch.Generator().manual_seed(rows)
    net, make = Residual(), OPTIMIZERS["sgd_momentum_wd"]
    ref = copy.deepcopy(net)
    oe, oc = make(ref.parameters()), make(net.parameters())
    eager, captured = eager_step(ref, F.cross_entropy, oe), train_step(net, F.cross_entropy, oc, backend="native")
    for _ in range(30):
        x, y = torch.randn(rows, 3, 4, generator=g), torch.randint(0, 3, (rows,), generator=g)
        eager(x, y), captured(x, y)
    assert set(captured.choices.values()) == {"native"}, repr(captured)
    assert_same_state(ref, net, oe, oc)


@pytest.mark.parametrize("backend", ["graph", "auto"])
def test_batchnorm_statistics_and_dropout_follow_eager(backend):
    torch.manual_seed(3)
    ref, net, oe, oc, step = run_both(BNDropNet(), OPTIMIZERS["sgd_momentum_wd"], "cnn", steps=30, seed=3,
                                      backend=backend)
    assert step.state == "replay", repr(step)
    assert int(net.bn.num_batches_tracked) == 30 == int(ref.bn.num_batches_tracked)
    assert_same_state(ref, net, oe, oc)
    net.eval(), ref.eval()  # eval mode is its own signature: running statistics used, not updated
    ref, net, oe, oc, step = run_both(net, OPTIMIZERS["adam"], "cnn", steps=5, seed=4, backend=backend)
    assert int(net.bn.num_batches_tracked) == 30


def test_dict_batch_with_token_ids_and_dict_output():
    torch.manual_seed(5)
    ref, net, oe, oc, step = run_both(DictTokens(), OPTIMIZERS["adamw"], "dict", loss=dict_loss, steps=40, seed=5)
    assert step.state == "replay", repr(step)
    assert_same_state(ref, net, oe, oc)


@pytest.mark.parametrize("backend", ["graph", "native"])
@pytest.mark.parametrize("opt", ["sgd_momentum_wd", "adam"])
def test_grads_visible_when_asked(backend, opt):
    torch.manual_seed(6)
    ref, net, *_ = run_both(mlp(), OPTIMIZERS[opt], "mlp", steps=3, seed=6, keep_grads=True, backend=backend)
    for p, q in zip(ref.parameters(), net.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("backend", ["graph", "native"])
def test_lr_scheduler_changes_take_effect(backend):
    torch.manual_seed(7)
    ref, net = mlp(), None
    net = copy.deepcopy(ref)
    oe, oc = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(net.parameters(), lr=0.1,
                                                                                        momentum=0.9)
    se, sc = torch.optim.lr_scheduler.StepLR(oe, 3, 0.3), torch.optim.lr_scheduler.StepLR(oc, 3, 0.3)
    eager, captured = eager_step(ref, F.cross_entropy, oe), train_step(net, F.cross_entropy, oc, backend=backend)
    for x, y in batches("mlp", 12, 7):
        eager(x, y), captured(x, y)
        se.step(), sc.step()
    assert oc.param_groups[0]["lr"] < 0.01
    assert_same_state(ref, net, oe, oc)
    # Without the schedule the weights would differ: the schedule is not frozen into the graph.
    frozen = copy.deepcopy(ref)
    of = torch.optim.SGD(frozen.parameters(), lr=0.1, momentum=0.9)
    step = train_step(frozen, F.cross_entropy, of, backend="graph")
    for x, y in batches("mlp", 3, 8):
        step(x, y)
    assert not torch.allclose(frozen[0].weight, ref[0].weight)


def test_eager_optimizer_continues_from_captured_state():
    torch.manual_seed(8)
    ref, net, oe, oc, _ = run_both(mlp(), OPTIMIZERS["adam"], "mlp", steps=10, seed=8)
    eager_e, eager_c = eager_step(ref, F.cross_entropy, oe), eager_step(net, F.cross_entropy, oc)
    for x, y in batches("mlp", 5, 9):
        eager_e(x, y), eager_c(x, y)
    assert_same_state(ref, net, oe, oc)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 3)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return self.fc(x)
        return self.fc(-x)


class MutatesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 3)

    def forward(self, x):
        x.mul_(2)
        return self.fc(x)


def _hooked():
    net = mlp()
    net[0].register_forward_hook(lambda m, i, o: None)
    return net


@pytest.mark.parametrize("make, expected", [(Branchy, "control flow"), (MutatesInput, "in place"),
                                            (_hooked, "hooks")])
def test_uncapturable_steps_fall_back_with_reason_and_one_warning_at_the_callers_line(make, expected):
    torch.manual_seed(9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref, net, oe, oc, step = run_both(make(), OPTIMIZERS["sgd_momentum_wd"], "mlp", steps=4, seed=9)
    ours = [w for w in caught if issubclass(w.category, HybridizeWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert ours[0].filename == __file__, ours[0].filename
    assert step.state == "eager" and expected in repr(step), repr(step)
    assert_same_state(ref, net, oe, oc)


@pytest.mark.parametrize("backend, make", [("eager", mlp), ("auto", Branchy), ("graph", _hooked), ("graph", mlp),
                                           ("native", mlp)])
def test_every_step_returns_the_loss_without_history(backend, make):
    """As documented: the eager step (asked for, or fallen back to) too, so holding losses keeps no graph alive."""
    torch.manual_seed(13)
    net = make()
    step = train_step(net, F.cross_entropy, torch.optim.SGD(net.parameters(), lr=0.1), backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HybridizeWarning)
        losses = [step(x, y) for x, y in batches("mlp", 3, 13)]
    assert all(loss.grad_fn is None and not loss.requires_grad for loss in losses), (repr(step), losses)


@pytest.mark.parametrize("backend", ["graph", "auto"])
def test_tensor_hyperparameters_train_as_eager(backend):
    """Adam(betas=(tensor, tensor)): the functional update refuses them, so the optimizer's own step() runs."""
    def adam(ps):
        return torch.optim.Adam(ps, lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.999)))

    torch.manual_seed(14)
    ref, net, oe, oc, step = run_both(mlp(), adam, "mlp", steps=5, seed=14, backend=backend)
    assert step.state == "replay", repr(step)
    assert_same_state(ref, net, oe, oc)


STDIN_SCRIPT = """
import torch
from dlperf.hybrid import train_step
net = torch.nn.Linear(4, 2)
step = train_step(net, torch.nn.functional.mse_loss, torch.optim.SGD(net.parameters(), lr=0.1),
                  backend="cuda_graphs" if not torch.cuda.is_available() else "native")
loss = step(torch.randn(3, 4, device=next(net.parameters()).device), torch.randn(3, 2))
"""


def test_a_refused_backend_of_a_script_read_from_standard_input_warns_at_its_line():
    """``python - < train.py``: ``__main__``'s loader cannot give the source of <stdin>, so the warning goes without."""
    import importlib.machinery

    script = {"__name__": "__main__", "__loader__": importlib.machinery.BuiltinImporter, "__builtins__": __builtins__}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(STDIN_SCRIPT, "<stdin>", "exec"), script)
    ours = [w for w in caught if issubclass(w.category, HybridizeWarning)]
    assert [(w.filename, w.lineno) for w in ours] == [("<stdin>", 7)], [str(w.message) for w in ours]
    assert "cannot serve this step" in str(ours[0].message)


def test_make_train_step_is_a_make_step_and_leaves_no_trace_of_its_capture():
    torch.manual_seed(10)
    net = BNDropNet()
    before = copy.deepcopy(net.state_dict())
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = next(batches("cnn", 1, 10))
    step = make_train_step(net, F.cross_entropy, opt, x, y)
    assert step.state == "replay"
    for k, v in net.state_dict().items():
        torch.testing.assert_close(v, before[k])
    assert not opt.state or all(not s for s in opt.state.values())


def test_auto_says_what_it_chose():
    torch.manual_seed(11)
    ref, net, oe, oc, step = run_both(mlp(), OPTIMIZERS["sgd_momentum_wd"], "mlp", steps=20, seed=11, backend="auto")
    text = repr(step)
    assert "fastest step" in text and "eager" in text, text
    assert_same_state(ref, net, oe, oc)


def test_unknown_backend_is_one_line():
    from dlperf.errors import UsageError

    with pytest.raises(UsageError, match="backend 'fast'"):
        train_step(mlp(), F.cross_entropy, torch.optim.SGD(mlp().parameters(), lr=0.1), backend="fast")


@pytest.mark.gpu
@pytest.mark.parametrize("opt", ["sgd_momentum_wd", "adam_capturable"])
def test_cuda_graph_step_matches_eager_and_follows_lr_changes(opt):
    makers = {**OPTIMIZERS, "adam_capturable": lambda ps: torch.optim.Adam(ps, lr=1e-2, capturable=True)}
    torch.manual_seed(12)
    net = mlp().cuda()
    ref = copy.deepcopy(net)
    oe, oc = makers[opt](ref.parameters()), makers[opt](net.parameters())
    eager = eager_step(ref, F.cross_entropy, oe)
    captured = train_step(net, F.cross_entropy, oc, backend="cuda_graphs")
    for i, (x, y) in enumerate(batches("mlp", 40, 12)):
        if i == 20:  # a schedule's change re-records the graph
            for group in (*oe.param_groups, *oc.param_groups):
                group["lr"] *= 0.5
        x, y = x.cuda(), y.cuda()
        torch.testing.assert_close(captured(x, y), eager(x, y).detach(), rtol=RTOL, atol=ATOL)
    assert set(captured.choices.values()) == {"cuda_graphs"}, repr(captured)
    assert_same_state(ref, net, oe, oc)


COMPILE_SCRIPT = """
import copy, torch
from torch.nn import functional as F
from dlperf.hybrid import train_step
from dlperf.steps import eager_step
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
ref = copy.deepcopy(net)
oe = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
oc = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
eager, captured = eager_step(ref, F.cross_entropy, oe), train_step(net, F.cross_entropy, oc, backend="compile")
for _ in range(10):
    x, y = torch.randn(5, 12), torch.randint(0, 3, (5,))
    torch.testing.assert_close(captured(x, y), eager(x, y).detach(), rtol=1e-4, atol=1e-5)
for p, q in zip(net.parameters(), ref.parameters()):
    torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
assert set(captured.choices.values()) == {"compile"}, repr(captured)
"""


@pytest.mark.slow
def test_compile_backend_matches_eager():
    # In a child process: inductor keeps a compile thread pool alive for the life of the process.
    subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], check=True, timeout=600)


def test_native_cross_entropy_honours_ignore_index_and_other_losses_trace():
    torch.manual_seed(14)
    g = torch.Generator().manual_seed(14)
    for loss in (F.cross_entropy, lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1),
                 lambda out, y: F.mse_loss(out, F.one_hot(y.clamp(min=0), 3).float())):
        net = mlp()
        ref = copy.deepcopy(net)
        oe, oc = OPTIMIZERS["sgd_nesterov"](ref.parameters()), OPTIMIZERS["sgd_nesterov"](net.parameters())
        eager, captured = eager_step(ref, loss, oe), train_step(net, loss, oc, backend="native")
        for _ in range(10):
            x, y = torch.randn(6, 12, generator=g), torch.randint(0, 3, (6,), generator=g)
            y[::3] = -100  # ignored rows: no loss, no gradient
            torch.testing.assert_close(captured(x, y), eager(x, y).detach(), rtol=RTOL, atol=ATOL)
        assert set(captured.choices.values()) == {"native"}, repr(captured)
        assert_same_state(ref, net, oe, oc)


def test_a_step_is_captured_once_engine_arrays_are_done_with():
    """Engine arrays leave the engine's global module hooks behind until a later module call finds nothing
    tracked; a training step captured right after must not run eagerly because of them."""
    import gc

    from dlperf.engine import array as dnp
    from dlperf.engine import create_engine, external

    with create_engine("threaded") as eng:
        a, plain = dnp.array(torch.randn(3, 4), engine=eng), torch.randn(3, 4)
        torch.testing.assert_close((a + plain).tensor(), a.tensor() + plain)  # the engine tracks ``plain``
        del a, plain
    gc.collect()
    assert external.hooks_installed()  # what the step meets: hooks left behind, nothing tracked
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    step = make_train_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), x, y,
                           backend="graph")
    assert step.runs_on == "graph" and step.eager_reason is None
    assert not external.hooks_installed()

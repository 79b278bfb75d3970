from __future__ import annotations

import copy
import re
import threading
import time

import pytest
import torch
from torch import nn

from dlperf.devices import copy_to, cpu, gpu
from dlperf.errors import DeviceMismatchError, DeviceUnavailableError, UsageError
from dlperf.models import get_spec
from dlperf.parallel import Trainer, split_and_load
from dlperf.parallel.training.trainer import make_optimizer

ALGORITHMS = ["naive", "cpu", "sharded", "ring"]


def _devices(k):
    return [cpu(i) for i in range(k)]


def _lenet_batch(n, seed=0):
    torch.manual_seed(seed)
    spec = get_spec("lenet")
    net = spec.build()
    X, y = spec.input.make_batch(n, generator=torch.Generator().manual_seed(seed + 1))
    return net, X, y, spec.loss


def _reference_step(net, X, y, loss_fn, lr):
    ref = copy_to(net, cpu(0))
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    loss_fn(ref(X), y).backward()
    opt.step()
    return ref


def _assert_params_close(a: nn.Module, b: nn.Module, atol=1e-6):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=atol, msg=name)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_one_step_on_k_devices_equals_one_device_full_batch(algorithm, k):
    net, X, y, loss_fn = _lenet_batch(31, seed=k)  # 31: uneven split for k = 2 and 3
    ref = _reference_step(net, X, y, loss_fn, lr=0.1)
    with Trainer(net, _devices(k), "sgd", {"lr": 0.1, "momentum": 0.9}, loss=loss_fn,
                 algorithm=algorithm, bucket_bytes=64 * 1024) as trainer:
        loss = trainer.train_step(X, y)
        torch.testing.assert_close(loss, loss_fn(copy_to(net, cpu(0))(X), y), rtol=1e-5, atol=1e-6)
        assert trainer.max_replica_difference() == 0.0  # identical, not just close
        for rep in trainer.replicas:
            _assert_params_close(rep, ref)


@pytest.mark.parametrize("kvstore,on_store", [("local", False), ("device", False), ("local", True),
                                              ("device", True)])
def test_kvstore_aggregation_equals_one_device(kvstore, on_store):
    net, X, y, loss_fn = _lenet_batch(20)
    ref = _reference_step(net, X, y, loss_fn, lr=0.05)
    with Trainer(net, _devices(2), "sgd", {"lr": 0.05, "momentum": 0.9}, loss=loss_fn, kvstore=kvstore,
                 update_on_kvstore=on_store) as trainer:
        trainer.train_step(X, y)
        assert trainer.max_replica_difference() == 0.0
        _assert_params_close(trainer.module, ref)


def test_several_steps_stay_identical_and_match_reference():
    net, X, y, loss_fn = _lenet_batch(24)
    ref = copy_to(net, cpu(0))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with Trainer(net, _devices(2), "sgd", {"lr": 0.1}, loss=loss_fn) as trainer:
        for step in range(3):
            part = slice(step * 8, step * 8 + 8)
            opt.zero_grad()
            loss_fn(ref(X[part]), y[part]).backward()
            opt.step()
            trainer.train_step(X[part], y[part])
        assert trainer.max_replica_difference() == 0.0
        _assert_params_close(trainer.module, ref, atol=1e-5)


def test_gluon_style_step_with_caller_backward():
    net, X, y, loss_fn = _lenet_batch(10)
    ref = _reference_step(net, X, y, loss_fn, lr=0.1)
    devs = _devices(2)
    with Trainer(net, devs, "sgd", {"lr": 0.1, "momentum": 0.9}) as trainer:
        trainer.zero_grad()
        for rep, xs, ys in zip(trainer.replicas, split_and_load(X, devs), split_and_load(y, devs)):
            nn.functional.cross_entropy(rep(xs), ys, reduction="sum").backward()
        trainer.step(batch_size=X.shape[0])
        _assert_params_close(trainer.module, ref)
        assert trainer.max_replica_difference() == 0.0


def test_presplit_parts_on_wrong_devices_are_rejected():
    net, X, y, loss_fn = _lenet_batch(8)
    with Trainer(net, _devices(2), "sgd", {"lr": 0.1}) as trainer:
        wrong = split_and_load(X, [cpu(1), cpu(0)])
        labels = split_and_load(y, _devices(2))
        with pytest.raises(DeviceMismatchError, match="part 0 is on cpu\\(1\\) but its replica is on cpu\\(0\\)"):
            trainer.train_step(wrong, labels)


def test_bad_trainer_arguments():
    net = nn.Linear(2, 2)
    with pytest.raises(UsageError, match="listed twice"):
        Trainer(net, [cpu(0), cpu(0)])
    with pytest.raises(UsageError, match="unknown allreduce algorithm"):
        Trainer(net, _devices(2), algorithm="butterfly")
    with pytest.raises(UsageError, match="unknown optimizer"):
        Trainer(net, _devices(2), "lamb")
    with pytest.raises(DeviceUnavailableError):
        Trainer(net, [cpu(0), gpu(torch.cuda.device_count())])
    with pytest.raises(UsageError, match="unknown kvstore type"):
        Trainer(net, _devices(2), kvstore="dist_async_nope")


def test_batch_smaller_than_devices_errors():
    net, X, y, loss_fn = _lenet_batch(2)
    with Trainer(net, _devices(3), "sgd", {"lr": 0.1}) as trainer:
        with pytest.raises(UsageError, match="cannot be split across 3 devices"):
            trainer.train_step(X, y)


def test_failure_in_one_replica_releases_the_others():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            if x.shape[0] == 2:  # only the second device's part (5 = 3 + 2)
                raise RuntimeError("boom")
            return self.lin(x)

    with Trainer(Boom(), _devices(2), "sgd", {"lr": 0.1}) as trainer:
        with pytest.raises(RuntimeError, match="boom"):
            trainer.train_step(torch.randn(5, 3), torch.zeros(5, dtype=torch.long))


def test_per_device_batchnorm_statistics_by_default():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    X = torch.cat([torch.randn(8, 4), torch.randn(8, 4) + 3])  # the two halves differ
    y = torch.randint(0, 2, (16,))
    with Trainer(net, _devices(2), "sgd", {"lr": 0.1}) as trainer:
        trainer.train_step(X, y)
        m0, m1 = (r[1].running_mean for r in trainer.replicas)
        assert not torch.allclose(m0, m1)
        assert trainer.max_replica_difference() == 0.0
    with Trainer(net, _devices(2), "sgd", {"lr": 0.1}, buffers="broadcast") as trainer:
        trainer.train_step(X, y)
        m0, m1 = (r[1].running_mean for r in trainer.replicas)
        assert torch.equal(m0, m1)


def test_multi_device_evaluation_matches_single_device():
    net, X, y, _ = _lenet_batch(50)
    batches = [(X[i:i + 16], y[i:i + 16]) for i in range(0, 50, 16)]  # last batch: 2 examples
    expected = sum(int((net(a).argmax(1) == b).sum()) for a, b in batches) / 50
    with Trainer(net, _devices(3), "sgd", {"lr": 0.1}) as trainer:
        assert trainer.evaluate_accuracy(batches) == pytest.approx(expected)


def test_state_dict_round_trip_continues_identically():
    net, X, y, loss_fn = _lenet_batch(16)
    kw = dict(loss=loss_fn)
    with Trainer(net, _devices(2), "sgd", {"lr": 0.1, "momentum": 0.9}, **kw) as a:
        a.train_step(X, y)
        state = a.state_dict()
        a.train_step(X, y)
        with Trainer(get_spec("lenet").build(), _devices(2), "sgd", {"lr": 0.1, "momentum": 0.9}, **kw) as b:
            b.load_state_dict(state)
            b.train_step(X, y)
            for p, q in zip(a.module.parameters(), b.module.parameters()):
                assert torch.equal(p, q)


def test_replicas_run_concurrently_and_reduction_overlaps_backward():
    """Forward passes on the two devices overlap in time, and a gradient bucket is reduced before the
    replicas have finished backward (the first layer's gradient is the last one produced).

    Other processes on a shared machine can delay a thread now and then, so the step is tried up to
    three times; with the replicas run one after another, or the reduction only after backward, no
    attempt could pass.
    """
    net, X, y, loss_fn = _lenet_batch(256)
    with Trainer(net, _devices(2), "sgd", {"lr": 0.1}, loss=loss_fn, bucket_bytes=64 * 1024,
                 threads=[1, 1]) as trainer:
        trainer.train_step(X, y)  # warm-up
        failures = []
        for _ in range(3):
            trainer.start_trace()
            trainer.train_step(X, y)
            events = trainer.stop_trace().events
            steps = [e for e in events if e.name.startswith("fwd+bwd")]
            reductions = [e for e in events if e.name.startswith("allreduce bucket")]
            assert {e.name.split(" phase")[0] for e in reductions} == {
                f"allreduce bucket {b}" for b in range(len(trainer._buckets.buckets))}
            a, b = steps
            concurrent = max(a.start_us, b.start_us) < min(a.end_us, b.end_us)
            overlapped = min(e.start_us for e in reductions) < max(e.end_us for e in steps)
            if concurrent and overlapped:
                return
            failures.append((concurrent, overlapped))
        pytest.fail(f"(forwards overlapped, reduction overlapped backward) per attempt: {failures}")


def test_close_joins_threads_and_rejects_use():
    net, X, y, _ = _lenet_batch(4)
    trainer = Trainer(net, _devices(2), "sgd", {"lr": 0.1})
    trainer.close()
    trainer.close()
    with pytest.raises(RuntimeError, match="closed"):
        trainer.train_step(X, y)


@pytest.mark.gpu
def test_trainer_on_gpu_matches_cpu_reference():
    net, X, y, loss_fn = _lenet_batch(32)
    ref = _reference_step(net, X, y, loss_fn, lr=0.1)
    with Trainer(net, [gpu(0)], "sgd", {"lr": 0.1, "momentum": 0.9}, loss=loss_fn) as trainer:
        trainer.train_step(X, y)
        for p, q in zip(trainer.module.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", ["contiguous", "channels_last"])
def test_memory_formats_give_the_same_step(fmt):
    net, X, y, loss_fn = _lenet_batch(12)
    ref = _reference_step(net, X, y, loss_fn, lr=0.1)
    with Trainer(net, _devices(2), "sgd", {"lr": 0.1, "momentum": 0.9}, loss=loss_fn, memory_format=fmt) as t:
        assert t.channels_last == (fmt == "channels_last")
        t.train_step(X, y)
        _assert_params_close(t.module, ref, atol=1e-5)
        if fmt == "channels_last":  # gradient views follow the weights' layout: no conversion per step
            w = t.module[0].weight
            assert w.grad.stride() == w.stride()


def test_auto_memory_format_only_for_convolutions_on_cpu():
    with Trainer(nn.Linear(3, 2), _devices(1)) as t:
        assert not t.channels_last
    with Trainer(get_spec("lenet").build(), _devices(1)) as t:
        assert t.channels_last
    with pytest.raises(UsageError, match="unknown memory format"):
        Trainer(nn.Linear(3, 2), _devices(1), memory_format="nhwc")


def test_a_step_failing_in_backward_raises_once_and_leaves_the_weights_untouched():
    """Replica 1 fails in backward after its last layers' bucket was already pushed for reduction on
    both devices; that reduction must neither leak into the next step nor update the weights."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    X, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    reference = copy.deepcopy(net)
    with Trainer(net, _devices(2), "sgd", {"lr": 0.1}, bucket_bytes=64) as trainer, \
            Trainer(reference, _devices(2), "sgd", {"lr": 0.1}, bucket_bytes=64) as oracle:
        assert len(trainer._buckets.buckets) >= 2

        def fail(_grad):
            raise RuntimeError("replica 1 failed in backward")

        handle = trainer.replicas[1][0].weight.register_hook(fail)
        with pytest.raises(RuntimeError, match="replica 1 failed in backward"):
            trainer.train_step(X, y)
        handle.remove()
        assert trainer.steps == 0
        trainer.train_step(X, y)
        oracle.train_step(X, y)
        for p, q in zip(trainer.module.parameters(), oracle.module.parameters()):
            assert torch.equal(p, q)
        assert trainer.max_replica_difference() == 0.0


@pytest.mark.timeout(60)
def test_a_replica_failing_after_the_updates_were_pushed_updates_no_replica(monkeypatch):
    """The updates are pushed from backward, once every bucket is reduced; a replica that fails after
    that (here: right after it reports its backward done) must keep every replica's weights as they were."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    X, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    before = [p.detach().clone() for p in net.parameters()]
    reference = copy.deepcopy(net)
    with Trainer(net, _devices(2), "sgd", {"lr": 0.1}) as trainer, \
            Trainer(reference, _devices(2), "sgd", {"lr": 0.1}) as oracle:
        real_done = trainer._buckets.replica_done
        calls = []

        def done_then_fail():
            last = real_done()
            calls.append(last)
            if len(calls) == 2:  # the second replica to end: every update has been pushed by now
                raise RuntimeError("failed after backward")
            return last

        monkeypatch.setattr(trainer._buckets, "replica_done", done_then_fail)
        with pytest.raises(RuntimeError, match="failed after backward"):
            trainer.train_step(X, y)
        monkeypatch.setattr(trainer._buckets, "replica_done", real_done)
        for r in trainer.replicas:
            for p, b in zip(r.parameters(), before):
                assert torch.equal(p.detach(), b)
        trainer.train_step(X, y)
        oracle.train_step(X, y)
        for p, q in zip(trainer.module.parameters(), oracle.module.parameters()):
            assert torch.equal(p, q)
        assert trainer.max_replica_difference() == 0.0


def test_named_sgd_updates_with_one_multi_tensor_call_and_the_same_result():
    torch.manual_seed(0)
    net = nn.Linear(5, 3)
    ref = copy.deepcopy(net)
    opt = make_optimizer("sgd", net.parameters(), {"lr": 0.1, "momentum": 0.9})
    plain = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=False)
    assert opt.defaults["foreach"] is True
    chosen = make_optimizer("sgd", nn.Linear(2, 2).parameters(), {"lr": 0.1, "foreach": False})
    assert chosen.defaults["foreach"] is False
    for _ in range(3):
        for model, o in ((net, opt), (ref, plain)):
            o.zero_grad()
            model(torch.ones(4, 5)).square().sum().backward()
            o.step()
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


# -- interrupts: closing never waits on a step that will not complete ----------------------------

@pytest.mark.timeout(30)
def test_an_interrupt_while_a_step_waits_closes_promptly_and_stops_the_engine(monkeypatch):
    """Ctrl-C arrives while train_step waits for the engine: leaving the block finishes the pushed
    operations (none waits on another one) and stops every engine thread; only the interrupt surfaces."""
    net, X, y, loss_fn = _lenet_batch(64)
    trainer = Trainer(net, _devices(2), "sgd", {"lr": 0.1}, loss=loss_fn, bucket_bytes=64 * 1024)

    def interrupted(ops):
        raise KeyboardInterrupt

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with trainer:
            monkeypatch.setattr(trainer.strategy, "wait_replicas", interrupted)
            trainer.train_step(X, y)
    assert time.monotonic() - start < 10.0
    assert trainer.engine.closed
    assert not [t for t in threading.enumerate() if t.name.startswith("dlperf-engine")]


def test_an_exception_inside_the_with_block_closes_with_abort(monkeypatch):
    closes = []
    real_close = Trainer.close

    def recording_close(self, abort=False):
        closes.append(abort)
        real_close(self, abort)

    monkeypatch.setattr(Trainer, "close", recording_close)
    with pytest.raises(KeyboardInterrupt):
        with Trainer(nn.Linear(4, 3), _devices(2), "sgd", {"lr": 0.1}):
            raise KeyboardInterrupt
    with Trainer(nn.Linear(4, 3), _devices(2), "sgd", {"lr": 0.1}):
        pass
    assert closes == [True, False]


# -- check_finite --------------------------------------------------------------------------------

def _nan_batch(seed=0):
    net, X, y, loss_fn = _lenet_batch(8, seed)
    bad = X.clone()
    bad[5] = float("nan")  # one example, on the second device's part
    return net, X, y, bad, loss_fn


TRAINER_KINDS = {
    "one-device": dict(k=1),
    "overlapped": dict(k=2),
    "kvstore": dict(k=2, kvstore="local"),
    "update-on-kvstore": dict(k=2, kvstore="local", update_on_kvstore=True),
}


@pytest.mark.parametrize("kind", TRAINER_KINDS)
def test_check_finite_stops_before_a_nan_loss_reaches_the_weights(kind):
    opts = dict(TRAINER_KINDS[kind])
    k = opts.pop("k")
    net, X, y, bad, loss_fn = _nan_batch()
    with Trainer(net, _devices(k), "sgd", {"lr": 0.1}, loss=loss_fn, check_finite=True, **opts) as trainer:
        trainer.train_step(X, y)
        after_one = [p.detach().clone() for p in trainer.module.parameters()]
        expected = r"^step 2: the loss is not finite \(cpu\(0\): .*nan.*\); the weights were not updated"
        with pytest.raises(Exception, match=expected) as info:
            trainer.train_step(bad, y)
        from dlperf.errors import DlperfError
        from dlperf.parallel.training.trainer import NonFiniteError

        assert isinstance(info.value, NonFiniteError) and isinstance(info.value, DlperfError)
        assert trainer.steps == 1
        for p, q in zip(trainer.module.parameters(), after_one):
            assert torch.equal(p.detach(), q)
        assert trainer.max_replica_difference() == 0.0
        trainer.train_step(X, y)  # the trainer is still usable
        assert trainer.steps == 2
        assert all(torch.isfinite(p).all() for p in trainer.module.parameters())


def test_without_check_finite_one_nan_example_poisons_every_replica():
    """What check_finite guards against (and that the NaN batch above really is poisonous)."""
    net, X, y, bad, loss_fn = _nan_batch()
    with Trainer(net, _devices(2), "sgd", {"lr": 0.1}, loss=loss_fn) as trainer:
        loss = trainer.train_step(bad, y)
        assert not torch.isfinite(loss)
        for r in trainer.replicas:
            assert all(torch.isnan(p).all() for p in r.parameters())


@pytest.mark.parametrize("k", [1, 2])
def test_check_finite_catches_a_nan_gradient_with_a_finite_loss(k):
    net, X, y, loss_fn = _lenet_batch(8)

    def loss_with_nan_gradient(out, target):
        # sqrt'(0) is inf and 0 * inf is NaN: the value stays finite, the gradient does not
        return loss_fn(out, target) + 0.0 * (out - out.detach()).abs().sqrt().sum()

    with Trainer(net, _devices(k), "sgd", {"lr": 0.1}, loss=loss_with_nan_gradient, check_finite=True) as trainer:
        before = [p.detach().clone() for p in trainer.module.parameters()]
        with pytest.raises(Exception, match="^step 1: the gradient is not finite; the weights were not updated"):
            trainer.train_step(X, y)
        for p, q in zip(trainer.module.parameters(), before):
            assert torch.equal(p.detach(), q)


def test_epoch_record_says_since_which_step_the_loss_was_not_finite():
    from dlperf.cli.train import epoch_line as _epoch_line
    from dlperf.data.loader import ArrayLoader
    from dlperf.parallel.training.run import train_epochs

    torch.manual_seed(0)
    images = torch.rand(40, 28, 28)
    labels = torch.randint(0, 10, (40,))
    test = ArrayLoader(images[:8], labels[:8], batch_size=8, shuffle=False, pin_memory=False)
    spec = get_spec("lenet")
    with Trainer(spec.build(), _devices(1), "sgd", {"lr": 0.1}, loss=spec.loss) as trainer:
        clean = ArrayLoader(images, labels, batch_size=8, shuffle=False, pin_memory=False)
        (rec,) = train_epochs(trainer, clean, test, 0, 1)
        assert "nonfinite_since_step" not in rec and "non-finite" not in _epoch_line(rec)
        poisoned = images.clone()
        poisoned[17] = float("nan")  # batch 3 of epoch 2, i.e. step 8 overall
        dirty = ArrayLoader(poisoned, labels, batch_size=8, shuffle=False, pin_memory=False)
        (rec,) = train_epochs(trainer, dirty, test, 1, 2)
    assert rec["nonfinite_since_step"] == 8
    assert rec["loss"] != rec["loss"]  # NaN
    assert _epoch_line(rec).startswith("epoch 2: loss nan (non-finite since step 8;")


class _Batches:
    """Loaders as train_epochs takes them, from plain lists (or one generator, iterated once)."""

    def __init__(self, batches) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return 0

    def epoch_batches(self, epoch: int):
        yield from self.batches


@pytest.mark.parametrize("train, test, needle", [
    ([], None, "the training data gave no batch in epoch 1"),
    ([(torch.rand(0, 1, 28, 28), torch.zeros(0, dtype=torch.long))], None, "holds 0 examples"),
    ([(torch.rand(1, 1, 28, 28), torch.zeros(1, dtype=torch.long))], None, "smaller than the 2 devices"),
    (iter([(torch.rand(4, 1, 28, 28), torch.zeros(4, dtype=torch.long))]), None,
     "gave no batch in epoch 2 (it did in epoch 1): it runs dry"),
    ([(torch.rand(4, 1, 28, 28), torch.zeros(4, dtype=torch.long))], [], "the test data gave no example after epoch 1"),
], ids=["no batch", "empty batches", "every batch skipped", "a generator", "no test example"])
def test_an_epoch_that_trains_nothing_is_an_error(train, test, needle):
    """A loss of 0 and an accuracy of 0 would read as results: one UsageError says why nothing trained."""
    from dlperf.parallel.training.run import train_epochs

    spec = get_spec("lenet")
    loader = _Batches(train)
    with Trainer(spec.build(), _devices(2), "sgd", {"lr": 0.1}, loss=spec.loss) as trainer:
        with pytest.raises(UsageError, match=re.escape(needle)):
            test = test if test is not None else [(torch.rand(4, 1, 28, 28), torch.zeros(4, dtype=torch.long))]
            train_epochs(trainer, loader, _Batches(test), 0, 2)


# --- batches as PyTorch users write them ----------------------------------------------------------------

class TokensAndOptions(nn.Module):
    """A dict batch: token ids, a float feature, a plain option (the same for every device)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 6)
        self.out = nn.Linear(7, 3)

    def forward(self, batch):
        assert batch["pool"] == "mean"
        return self.out(torch.cat([self.embed(batch["ids"]).mean(1), batch["age"]], dim=1))


def _dict_batch(n):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    X = {"ids": torch.randint(0, 30, (n, 4), generator=g), "age": torch.randn(n, 1, generator=g), "pool": "mean"}
    return X, (torch.randint(0, 3, (n,), generator=g), torch.rand(n, generator=g))


def _weighted_loss(out, y):
    labels, weights = y  # a tuple of targets reaches the loss as it is
    return (nn.functional.cross_entropy(out, labels, reduction="none") * weights).mean()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dict_inputs_and_tuple_targets_equal_eager(k):
    torch.manual_seed(0)
    net = TokensAndOptions()
    X, y = _dict_batch(7)
    ref = copy_to(net, cpu(0))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want_loss = _weighted_loss(ref(X), y)
    want_loss.backward()
    opt.step()
    with Trainer(net, _devices(k), "sgd", {"lr": 0.1, "momentum": 0.9}, loss=_weighted_loss) as trainer:
        loss = trainer.train_step(X, y)
        _assert_params_close(trainer.module, ref, atol=1e-5)
        assert trainer.max_replica_difference() == 0.0
    assert float(loss) == pytest.approx(float(want_loss.detach()), rel=1e-5)


def test_caller_driven_step_with_dict_parts():
    torch.manual_seed(0)
    net = TokensAndOptions()
    X, (labels, _) = _dict_batch(6)
    ref = _reference_step(net, X, labels, nn.functional.cross_entropy, 0.1)
    devs = _devices(2)
    with Trainer(net, devs, "sgd", {"lr": 0.1, "momentum": 0.9}) as trainer:
        trainer.zero_grad()
        for rep, xs, ys in zip(trainer.replicas, split_and_load(X, devs), split_and_load(labels, devs)):
            nn.functional.cross_entropy(rep(xs), ys, reduction="sum").backward()
        trainer.step(batch_size=6)
        _assert_params_close(trainer.module, ref, atol=1e-5)


def test_batch_structure_errors_name_the_structure():
    torch.manual_seed(0)
    with Trainer(TokensAndOptions(), _devices(2), "sgd", {"lr": 0.1}) as trainer:
        X, (labels, _) = _dict_batch(4)
        with pytest.raises(UsageError, match=r"features have 4 examples but labels have 3; .*inputs dict\{ids: "
                                             r"int64\[4,4\], age: float32\[4,1\], pool: str\}"):
            trainer.train_step(X, labels[:3])
        with pytest.raises(UsageError, match=r"the input dict\{pool: str\} has no tensor with a batch"):
            trainer.train_step({"pool": "mean"}, labels)
        with pytest.raises(UsageError, match="a batch of 1 example cannot be split across 2 devices"):
            trainer.train_step({"ids": X["ids"][:1], "age": X["age"][:1], "pool": "mean"}, labels[:1])
        trainer.train_step(X, labels)  # still usable

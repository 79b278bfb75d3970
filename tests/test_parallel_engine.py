"""The Trainer, DataParallel and the KVStore run on the dependency engine: inspected through its timeline."""

from __future__ import annotations

import json
import random
import threading

import pytest
import torch
from torch import nn

from dlperf.cli import main
from dlperf.devices import cpu
from dlperf.engine import load_trace
from dlperf.kvstore import create_kvstore
from dlperf.models import get_spec
from dlperf.parallel import DataParallel, Trainer
from dlperf.parallel.training.timeline import comm_overlap


def _lenet_batch(n: int, seed: int = 0):
    torch.manual_seed(seed)
    spec = get_spec("lenet")
    X, y = spec.input.make_batch(n, generator=torch.Generator().manual_seed(seed + 1))
    return spec.build(), X, y, spec.loss


@pytest.mark.timeout(120)
def test_trainer_steps_are_engine_operations_and_reductions_overlap_backward(tmp_path):
    """A 2-device LeNet run's timeline: forward+backward on both devices, every bucket reduced, one
    update of every replica per step, after the reductions, and reduction time overlapping backward
    (summed over three steps: another process can hold a core for a whole step)."""
    net, X, y, loss_fn = _lenet_batch(256)
    path = tmp_path / "run.json"
    with Trainer(net, [cpu(0), cpu(1)], "sgd", {"lr": 0.1}, loss=loss_fn, bucket_bytes=64 * 1024,
                 threads=[1, 1], trace=path) as trainer:
        n_buckets = len(trainer._buckets.buckets)
        for _ in range(3):
            trainer.train_step(X, y)
    events = load_trace(path).events
    steps = [e for e in events if e.name.startswith("fwd+bwd")]
    assert sorted({e.name for e in steps}) == ["fwd+bwd cpu(0)", "fwd+bwd cpu(1)"]
    assert {e.device for e in steps} == {"cpu(0)", "cpu(1)"}
    names = {e.name for e in events}
    assert {f"allreduce bucket {b} phase 1" for b in range(n_buckets)} <= names
    # logical CPU devices: one update operation per step steps both replicas' optimizers
    updates = [e for e in events if e.name.startswith("sgd")]
    assert [e.name for e in updates] == ["sgd cpu(0),cpu(1)"] * 3
    reductions = [e for e in events if e.name.startswith("allreduce")]
    for i, u in enumerate(updates):  # each step's update starts once its reductions have ended
        before = [e for e in reductions if e.start_us < u.start_us]
        assert len(before) >= (i + 1) * n_buckets and all(e.end_us <= u.start_us for e in before)
    # Reductions run on communication lanes, beside backward. Only the step's last bucket, pushed as
    # the last replica's backward ends (nothing left to overlap), is reduced by that replica's own
    # worker, which then runs the update too: no thread is woken for either.
    compute = {"cpu(0)/compute", "cpu(1)/compute"}
    start = 0.0
    for u in updates:
        mine = [e for e in reductions if start <= e.start_us < u.start_us]
        here = [e for e in mine if e.worker in compute]
        assert len({e.name.split(" phase")[0] for e in here}) == 1, here
        assert all(e.worker == u.worker for e in here) and u.worker in compute
        assert len([e for e in mine if e.worker not in compute]) >= n_buckets - 1
        start = u.end_us
    overlap = comm_overlap(load_trace(path))
    assert overlap["overlap_us"] > 0, overlap


@pytest.mark.timeout(60)
def test_bucket_reductions_are_pushed_with_earlier_layers_first(monkeypatch):
    net, X, y, loss_fn = _lenet_batch(64)
    pushed = []
    with Trainer(net, [cpu(0), cpu(1)], "sgd", {"lr": 0.1}, loss=loss_fn, bucket_bytes=64 * 1024) as trainer:
        real = trainer.engine._push  # every push, checked or not, ends here

        def recording(fn, args, reads, writes, device, priority, name, kind="compute"):
            pushed.append((name, priority))
            return real(fn, args, reads, writes, device, priority, name, kind)

        monkeypatch.setattr(trainer.engine, "_push", recording)
        trainer.train_step(X, y)
        buckets = trainer._buckets.buckets
    prio = {}
    for name, p in pushed:
        if name and name.startswith("allreduce bucket"):
            prio.setdefault(int(name.split()[2]), set()).add(p)
    assert sorted(prio) == list(range(len(buckets))) and len(buckets) >= 2
    assert all(len(ps) == 1 for ps in prio.values())  # every phase of a bucket has its bucket's priority
    by_first_layer = sorted(range(len(buckets)), key=lambda b: min(buckets[b]))
    values = [prio[b].pop() for b in by_first_layer]
    assert values == sorted(values, reverse=True) and values[0] > values[-1]


@pytest.mark.timeout(120)
def test_trace_cli_summarises_a_train_run(tmp_path, capsys):
    path = tmp_path / "run.json"
    # LeNet's 0.5 MB of gradients form one bucket by default, reduced as backward ends (nothing to
    # overlap); in 64 KiB buckets the earlier ones are reduced while backward still runs
    argv = ["train", "--devices", "cpu:0,cpu:1", "--epochs", "1", "--train-size", "400", "--test-size", "100",
            "--batch-size", "100", "--no-progress", "--trace", str(path), "--bucket-bytes", "65536"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["trace", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    workers = {w["worker"] for w in summary["workers"]}
    assert {"cpu(0)", "cpu(1)"} <= {w.split("/")[0] for w in workers}
    assert comm_overlap(load_trace(path))["comm_us"] > 0
    assert summary["communication"]["overlap_us"] > 0  # some reduction ran while backward was still running
    assert main(["trace", str(path)]) == 0
    assert "overlapped forward/backward" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_no_thread_but_the_engines_runs_during_training():
    net, X, y, loss_fn = _lenet_batch(64)
    seen: list[set[str]] = []

    def loss(out, target):
        seen.append({t.name for t in threading.enumerate()})
        return loss_fn(out, target)

    before = {t.name for t in threading.enumerate()}
    with Trainer(net, [cpu(0), cpu(1)], "sgd", {"lr": 0.1}, loss=loss, bucket_bytes=64 * 1024) as trainer:
        for _ in range(2):
            trainer.train_step(X, y)
        trainer.evaluate_accuracy([(X, y)])
    new = set().union(*seen) - before
    # dlperf-threads-reset: the engine's short-lived helper that puts the process-wide thread count back
    # after a waiting thread ran an operation under a device's budget (dlperf._threads)
    assert seen and new and all(name.startswith("dlperf-engine-") or name == "dlperf-threads-reset"
                                for name in new), new


@pytest.mark.timeout(60)
def test_kvstore_async_calls_match_a_dict_oracle():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    shapes = {k: (rng.randint(1, 5), rng.randint(1, 4)) for k in range(6)}
    oracle: dict[int, torch.Tensor] = {}
    with create_kvstore("local") as kv:
        for k, shape in shapes.items():
            v = torch.randn(shape, generator=gen)
            kv.init(k, v)
            oracle[k] = v.clone()
        pending = []
        for _ in range(200):
            k = rng.choice(list(shapes))
            if rng.random() < 0.5:
                grads = [torch.randn(shapes[k], generator=gen) for _ in range(rng.randint(1, 3))]
                oracle[k] = sum(g.clone() for g in grads)
                pending.append((kv.push_async(k, grads, priority=rng.randint(-2, 2)), None, None))
            else:
                out = [torch.empty(shapes[k]) for _ in range(2)]
                pending.append((kv.pull_async(k, out), out, oracle[k].clone()))
            if rng.random() < 0.2:  # sometimes wait for everything so far, in random order
                rng.shuffle(pending)
                for op, out, want in pending:
                    op.wait()
                    if out is not None:
                        assert all(torch.equal(o, want) for o in out)
                pending = []
        for op, out, want in pending:
            op.wait()
            if out is not None:
                assert all(torch.equal(o, want) for o in out)
        for k in shapes:
            got = torch.empty(shapes[k])
            kv.pull(k, out=got)
            assert torch.equal(got, oracle[k])


@pytest.mark.timeout(30)
def test_kvstore_async_error_surfaces_once_and_the_key_stays_usable(monkeypatch):
    with create_kvstore("local") as kv:
        kv.init("w", torch.zeros(3))
        calls = []
        real = kv._push_now

        def failing_once(key, values):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("link down")
            return real(key, values)

        monkeypatch.setattr(kv, "_push_now", failing_once)
        op = kv.push_async("w", [torch.ones(3)])
        with pytest.raises(RuntimeError, match="link down"):
            op.wait()
        kv.push_async("w", [torch.full((3,), 2.0)]).wait()
        out = torch.empty(3)
        kv.pull_async("w", out).wait()
        assert out.tolist() == [2.0, 2.0, 2.0]


def test_trainer_with_a_kvstore_overlaps_as_engine_operations(tmp_path):
    net, X, y, loss_fn = _lenet_batch(64)
    ref = Trainer(_lenet_batch(64)[0], [cpu(0), cpu(1)], "sgd", {"lr": 0.1}, loss=loss_fn, bucket_bytes=64 * 1024)
    with ref, Trainer(net, [cpu(0), cpu(1)], "sgd", {"lr": 0.1}, loss=loss_fn, kvstore="local",
                      bucket_bytes=64 * 1024, trace=tmp_path / "kv.json") as trainer:
        for _ in range(2):
            a, b = trainer.train_step(X, y), ref.train_step(X, y)
            assert torch.allclose(a, b, atol=1e-6)
        for p, q in zip(trainer.module.parameters(), ref.module.parameters()):
            assert torch.allclose(p, q, atol=1e-6)
    names = {e.name for e in load_trace(tmp_path / "kv.json").events}
    assert any(n.startswith("kvstore pushpull") for n in names)


def test_data_parallel_forwards_are_engine_operations():
    net = nn.Linear(4, 2)
    with DataParallel(net, [cpu(0), cpu(1)], threads=[1, 1]) as dp:
        dp.engine.start_trace()
        dp(torch.randn(6, 4))
        names = sorted(e.name for e in dp.engine.stop_trace().events)
    assert names == ["forward cpu(0)", "forward cpu(1)"]

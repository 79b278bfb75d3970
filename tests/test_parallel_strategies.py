"""Gradient synchronization strategies: the factory's choices and refusals, and each strategy against one device."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from dlperf.devices import cpu, gpu
from dlperf.errors import UsageError
from dlperf.parallel import Trainer
from dlperf.parallel.strategies import STRATEGIES, Strategy, choose_strategy, create_strategy
from dlperf.parallel.training.trainer import TrainerConfig


@pytest.mark.parametrize("options,name", [
    (dict(), "one-device"),
    (dict(devices=1), "one-device"),
    (dict(devices=2), "allreduce"),
    (dict(devices=[cpu(0), cpu(1), cpu(2)]), "allreduce"),
    (dict(kvstore="local", devices=2), "kvstore"),
    (dict(kvstore="device", devices=1), "kvstore"),
    (dict(kvstore="local", devices=2, update_on_kvstore=True), "update-on-kvstore"),
    (dict(processes=2), "processes"),
    (dict(processes=4, devices=2), "processes"),
    (dict(kvstore="dist_sync", processes=2), "parameter-servers"),
    (dict(kvstore="dist_device_sync", processes=3, num_servers=1), "parameter-servers"),
])
def test_the_factory_picks_one_registered_strategy(options, name):
    kvstore = options.pop("kvstore", None)
    assert choose_strategy(kvstore, **options) == name
    assert name in STRATEGIES and issubclass(STRATEGIES.get(name), Strategy)
    assert STRATEGIES.get(name).name == name


def test_every_way_to_synchronize_is_registered_once():
    assert sorted(STRATEGIES.names()) == ["allreduce", "kvstore", "one-device", "parameter-servers", "processes",
                                          "update-on-kvstore"]


def test_a_lookup_miss_lists_every_strategy():
    with pytest.raises(UsageError) as info:
        STRATEGIES.get("ring-of-servers")
    message = str(info.value)
    assert message.startswith("unknown gradient synchronization strategy 'ring-of-servers'; valid choices: ")
    assert all(name in message for name in STRATEGIES.names())


@pytest.mark.parametrize("kvstore,options,needles", [
    ("local", dict(processes=2), ["kvstore='local' with 2 processes", "use kvstore='dist_sync', or kvstore=None"]),
    ("dist_sync", dict(), ["kvstore='dist_sync' in one process", "dlperf launch", "nproc_per_node=2"]),
    (None, dict(processes=3, num_servers=1), ["num_servers=1 with kvstore=None", "give kvstore='dist_sync'"]),
    ("local", dict(processes=3, num_servers=1), ["num_servers=1 with kvstore='local'"]),
    (None, dict(update_on_kvstore=True), ["update_on_kvstore=True needs a kvstore"]),
    (None, dict(processes=2, devices=[gpu(0)]), ["with 2 processes", "use CPU devices"]),
    ("redis", dict(), ["unknown kvstore type 'redis'; valid choices: ", "local", "dist_sync"]),
])
def test_conflicting_options_are_one_line_naming_them(kvstore, options, needles):
    with pytest.raises(UsageError) as info:
        choose_strategy(kvstore, **options)
    message = str(info.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_the_trainer_and_its_config_refuse_what_the_factory_refuses():
    net = nn.Linear(3, 2)
    with pytest.raises(UsageError, match="update_on_kvstore=True needs a kvstore"):
        Trainer(net, [cpu(0)], update_on_kvstore=True)
    with pytest.raises(UsageError, match="kvstore='dist_sync' in one process"):
        Trainer(net, [cpu(0)], kvstore="dist_sync", processes=None)
    with pytest.raises(UsageError, match="unknown kvstore type 'nope'"):
        Trainer(net, [cpu(0)], kvstore="nope")
    with pytest.raises(UsageError, match="unknown optimizer 'lion'; valid choices: sgd, adam, adamw"):
        TrainerConfig(optimizer="lion")
    with pytest.raises(UsageError, match="bucket_bytes=0"):
        TrainerConfig(bucket_bytes=0)


def test_create_strategy_gives_a_detached_instance():
    strategy = create_strategy(devices=2)
    assert strategy.name == "allreduce"
    with pytest.raises(RuntimeError, match="not attached"):
        strategy.ctx  # noqa: B018


def test_a_config_object_and_keywords_make_the_same_trainer():
    config = TrainerConfig("sgd", {"lr": 0.1}, kvstore="local")
    with Trainer(nn.Linear(3, 2), [cpu(0), cpu(1)], config=config) as a, \
            Trainer(nn.Linear(3, 2), [cpu(0), cpu(1)], "sgd", {"lr": 0.1}, kvstore="local") as b:
        assert a.strategy.name == b.strategy.name == "kvstore"
    with Trainer(nn.Linear(3, 2), [cpu(0), cpu(1)], config=config, update_on_kvstore=True) as c:
        assert c.strategy.name == "update-on-kvstore" and config.update_on_kvstore is None  # the config is not changed


# -- every strategy against one device, on fresh random inputs -----------------------------------

def _problem(seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(7, 32), nn.Tanh(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 5))
    X = torch.randn(4, 23, 7, generator=gen)  # 23: an uneven split on 2 and 3 devices
    y = torch.randint(0, 5, (4, 23), generator=gen)
    return net, X, y


def _one_device_reference(net: nn.Module, X: torch.Tensor, y: torch.Tensor, momentum: float) -> nn.Module:
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=momentum)
    for Xb, yb in zip(X, y):
        opt.zero_grad()
        nn.functional.cross_entropy(ref(Xb), yb).backward()
        opt.step()
    return ref


IN_PROCESS = {
    "one-device": dict(k=1),
    "allreduce": dict(k=3, bucket_bytes=512),  # several buckets
    "kvstore": dict(k=2, kvstore="local", bucket_bytes=512),
    "update-on-kvstore": dict(k=2, kvstore="device", update_on_kvstore=True),
}


@pytest.mark.parametrize("check_finite", [False, True])
@pytest.mark.parametrize("name", IN_PROCESS)
def test_each_strategy_in_one_process_matches_one_device(name, check_finite):
    seed = random.randrange(2**31)
    options = dict(IN_PROCESS[name])
    k = options.pop("k")
    net, X, y = _problem(seed)
    ref = _one_device_reference(net, X, y, momentum=0.9)
    with Trainer(net, [cpu(i) for i in range(k)], "sgd", {"lr": 0.1, "momentum": 0.9}, check_finite=check_finite,
                 **options) as trainer:
        assert trainer.strategy.name == name
        for Xb, yb in zip(X, y):
            trainer.train_step(Xb, yb)
        assert trainer.max_replica_difference() == 0.0
        for p, q in zip(trainer.module.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=f"seed {seed}")


@pytest.mark.parametrize("name", IN_PROCESS)
def test_each_strategy_in_one_process_matches_one_device_with_caller_driven_steps(name):
    """zero_grad, the caller's own backward of summed losses, step(batch_size): the same update."""
    seed = random.randrange(2**31)
    options = dict(IN_PROCESS[name])
    k = options.pop("k")
    net, X, y = _problem(seed)
    ref = _one_device_reference(net, X, y, momentum=0.0)
    with Trainer(net, [cpu(i) for i in range(k)], "sgd", {"lr": 0.1}, **options) as trainer:
        for Xb, yb in zip(X, y):
            trainer.zero_grad()
            for rep, part_X, part_y in zip(trainer.replicas, Xb.tensor_split(k), yb.tensor_split(k)):
                nn.functional.cross_entropy(rep(part_X), part_y, reduction="sum").backward()
            trainer.step(Xb.shape[0])
        assert trainer.steps == X.shape[0] and trainer.max_replica_difference() == 0.0
        for p, q in zip(trainer.module.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=f"seed {seed}")


def _rank_run(seed: int, kvstore: str | None, k: int) -> tuple[str, list[torch.Tensor]]:
    torch.set_num_threads(1)
    net, X, y = _problem(seed)
    with Trainer(net, [cpu(i) for i in range(k)], "sgd", {"lr": 0.1}, kvstore=kvstore, threads=[1] * k) as trainer:
        for Xb, yb in zip(X, y):
            trainer.train_step(Xb, yb)
        return trainer.strategy.name, [p.detach().clone() for p in trainer.module.parameters()]


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kvstore,k,name", [(None, 1, "processes"), (None, 2, "processes"),
                                            ("dist_sync", 1, "parameter-servers")])
def test_each_strategy_across_processes_matches_one_device(kvstore, k, name, monkeypatch):
    from dlperf.parallel.launchers import ProcessLauncher

    monkeypatch.setenv("DLPERF_NUM_SERVERS", "0")  # co-located servers: every rank trains
    seed = random.randrange(2**31)
    results = ProcessLauncher(2, backend="gloo", join_timeout_s=200).launch(_rank_run, seed, kvstore, k)
    net, X, y = _problem(seed)
    ref = _one_device_reference(net, X, y, momentum=0.0)
    for got_name, params in results:
        assert got_name == name
        for p, q in zip(params, ref.parameters(), strict=True):
            torch.testing.assert_close(p, q.detach(), rtol=1e-5, atol=1e-6, msg=f"seed {seed}")

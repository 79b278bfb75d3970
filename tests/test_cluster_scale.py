"""``dlperf scale`` and the projection behind it (dlperf.probe.projection): d2l 12.7's worked example, the
formulas against the cost model's, the knee, where each figure came from, and bad values."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dlperf.cli import main
from dlperf.errors import UsageError
from dlperf.probe.cost import Hardware, Link, allreduce_time, parameter_server_time
from dlperf.probe.links import save_links
from dlperf.probe.projection import (
    STRATEGIES,
    Cluster,
    HostCPU,
    Layout,
    alpha_beta_fit,
    communication_time,
    cpu_time,
    layout_time,
    link_from_allreduce,
    link_from_strategy,
    project,
)


def _scale(capsys, *argv: str) -> tuple[dict, str]:
    assert main(["scale", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out.strip().splitlines()[-1]), out


def test_d2l_12_7_1_worked_example_160mb_on_4_gpus_over_16gbs(capsys):
    # 160 MB of gradients, 4 GPUs each on a 16 GB/s PCIe link: to one GPU and back 60 ms, to the CPU 80 ms,
    # split into 4 parts aggregated at once 15 ms (the text leaves latency out: 0us)
    doc, out = _scale(capsys, "--gradients", "160MB", "--hosts", "1", "--devices-per-host", "4",
                      "--intra-link", "16GB/s,0us", "--strategies", "naive,ps-1,sharded")
    (row,) = doc["rows"]
    got = {s: round(v["communication_s"] * 1e3, 6) for s, v in row["strategies"].items()}
    assert got == {"naive": 60.0, "ps-1": 80.0, "sharded": 15.0}
    assert row["best"] == "sharded"
    assert "given (--intra-link)" in out and "assumed 0: no --model or --step-ms" in out


def test_d2l_12_7_2_ring_of_8_v100s_is_about_6_ms():
    nvlink = Link(0.0, 3 * 18e9)  # the text's 3 x 18 GB/s
    ring = communication_time("ring", 160e6, Cluster(1, 8, nvlink, nvlink))
    assert 5e-3 < ring < 6e-3  # 2 (k-1)/k n / B = 5.2 ms; the text rounds 2 n / B = 5.9 ms to "about 6"


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_one_host_matches_the_cost_models_allreduce_formulas(k):
    hw = Hardware.from_seed("pcie-4gpu")
    device = hw.link("device")
    one = Cluster(1, k, device, device)
    for strategy, algorithm in (("ring", "ring"), ("sharded", "sharded"), ("naive", "naive")):
        assert communication_time(strategy, 1e8, one) == pytest.approx(allreduce_time(algorithm, 1e8, k, hw))


@pytest.mark.parametrize("hosts", [2, 3, 5])
def test_one_server_across_hosts_matches_the_cost_models_push_pull(hosts):
    # one device per host, the server in host 0's memory: the other hosts' pushes all arrive through its NIC,
    # which is the cost model's one server with hosts - 1 workers (host 0's own push stays in memory)
    net, fast = Link(50e-6, 1.25e9), Link(0.0, 1e15)
    got = communication_time("ps-1", 44.7e6, Cluster(hosts, 1, net, fast))
    hw = Hardware("net", {"float32": 1e12}, 1e11, 1e-6, {"network": net})
    assert got == pytest.approx(parameter_server_time(44.7e6, hosts - 1, 1, hw))


def test_more_servers_spread_the_load_and_hierarchical_crosses_the_network_once_per_host():
    net, pcie = Link(100e-6, 1.25e9), Link(5e-6, 16e9)
    cluster = Cluster(4, 2, net, pcie)
    assert communication_time("ps-2", 1e8, cluster) < communication_time("ps-1", 1e8, cluster)
    # every host's NIC carries about 2 n in a ring of 8 devices, once n in the ring of 4 leaders
    ring, hier = communication_time("ring", 1e8, cluster), communication_time("hierarchical", 1e8, cluster)
    assert hier < ring
    assert hier == pytest.approx(layout_time("sharded", 1e8, Layout((0, 0)), net, pcie) + 6 * 100e-6
                                 + 1.5e8 / 1.25e9 + pcie.time(1e8))


def test_two_servers_behind_one_nic_share_it():
    # servers on host 1, workers on host 0: the NIC carries every push whether the keys are split or not
    net, fast = Link(0.0, 1e9), Link(0.0, 1e15)
    one = layout_time("ps-1", 1e8, Layout((0, 0), (1,)), net, fast)
    two = layout_time("ps-2", 1e8, Layout((0, 0), (1, 1)), net, fast)
    assert one == pytest.approx(two) == pytest.approx(2 * 2 * 1e8 / 1e9)


def test_a_measured_ring_allreduce_fit_gives_back_its_link():
    link = Link(30e-6, 0.6e9)
    for world in (2, 3, 4):
        layout = Layout(tuple(range(world)))
        sizes = [4096.0, 4e6]
        fit = Link.fit(sizes, [layout_time("ring", n, layout, link, link) for n in sizes])
        back = link_from_allreduce(fit, world)
        assert back.alpha_s == pytest.approx(link.alpha_s) and back.bandwidth == pytest.approx(link.bandwidth)


def test_the_knee_is_where_an_added_host_brings_less_than_half_a_host():
    net, pcie = Link(0.0, 1e9), Link(0.0, 1e15)
    p = project(1e8, 0.05, Cluster(6, 1, net, pcie), ["ps-1"])
    # by hand: step(N) = 50 ms + 2 (N-1) 100 ms; throughput N / step
    steps = [0.05 + 2 * (n - 1) * 0.1 for n in range(1, 7)]
    assert [r.step_s("ps-1") for r in p.rows] == pytest.approx(steps, rel=1e-5)  # host 0: memory, not free
    gains = [(n + 1) / steps[n] - n / steps[n - 1] for n in range(1, 6)]
    expected = next(n + 1 for n, g in zip(range(1, 6), gains) if g < 0.5 / steps[0])
    assert p.knee == expected == 2
    assert p.efficiency(p.rows[0], "ps-1") == 1.0
    assert project(1e3, 1.0, Cluster(6, 1, net, pcie)).knee is None  # tiny gradients: linear scaling


def test_a_model_is_measured_and_its_figures_say_where_they_came_from(capsys):
    doc, out = _scale(capsys, "--model", "mlp", "--batch-size", "8", "--hosts", "3", "--link", "10gbit",
                      "--intra-link", "16GB/s")
    from dlperf.models import get_spec

    params = sum(p.numel() * p.element_size() for p in get_spec("mlp").build().parameters())
    assert doc["gradient_bytes"] == params
    assert [r["hosts"] for r in doc["rows"]] == [1, 2, 3]
    assert set(doc["rows"][0]["strategies"]) == set(STRATEGIES)
    assert doc["figures"]["compute"]["source"].startswith("measured now: median of")
    assert doc["figures"]["network"]["source"].startswith("rate given (--link); latency assumed")
    assert doc["figures"]["network"]["value"] == [250e-6, 1.25e9]
    for row in doc["rows"]:
        for s in row["strategies"].values():
            assert s["step_s"] == pytest.approx(row["compute_s"] + s["communication_s"])
            assert 0 <= s["communication_share"] < 1
    assert "eff" in out and "knee" in out


def test_a_factory_model_with_an_assumed_step(capsys):
    doc, out = _scale(capsys, "--model", "dlperf.models.lenet:lenet", "--input", "4x1x28x28", "--step-ms", "20",
                      "--hosts", "2", "--devices-per-host", "2", "--link", "1gbit,100us", "--intra-link", "8GB/s,2us")
    assert doc["rows"][0]["compute_s"] == pytest.approx(0.02)
    assert doc["figures"]["compute"]["source"] == "assumed (--step-ms)"
    assert doc["figures"]["network"] == {"value": [100e-6, 1.25e8], "source": "given (--link)"}
    from dlperf.models.lenet import lenet

    assert doc["gradient_bytes"] == sum(p.numel() * 4 for p in lenet().parameters())


def test_without_link_the_saved_measurement_between_hosts_is_used(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fit = Link(2 * 40e-6, 0.5e9)  # what a 2-rank gloo allreduce over a 0.5 GB/s, 40 us link measures
    (tmp_path / "dlperf" / "probe").mkdir(parents=True, mode=0o700)
    save_links(["a (10.0.0.1)", "b (10.0.0.2)"], {"gloo": fit},
               path=str(tmp_path / "dlperf" / "probe" / "links-0123456789abcdef.json"))
    doc, out = _scale(capsys, "--gradients", "10MB", "--hosts", "2", "--step-ms", "10")
    assert doc["figures"]["network"]["source"].startswith("measured: gloo between hosts, 2 ranks")
    alpha, rate = doc["figures"]["network"]["value"]
    assert alpha == pytest.approx(40e-6) and rate == pytest.approx(0.5e9)


@pytest.mark.parametrize("argv, named", [
    (["--gradients", "1MB", "--hosts", "0"], "--hosts: '0' is out of range"),
    (["--gradients", "1MB", "--hosts", "2", "--link", "fast"], "'fast' is not a link rate"),
    (["--gradients", "1MB", "--hosts", "2", "--link", "10gbit,soon"], "'soon' is not a latency"),
    (["--gradients", "1MB", "--hosts", "2", "--link", "0gbit"], "outside"),
    (["--gradients", "1MB", "--hosts", "2"], "needs --link RATE"),
    (["--gradients", "lots", "--hosts", "1"], "'lots' is not a size"),
    (["--model", "nope", "--hosts", "1"], "unknown network 'nope'"),
    (["--model", "mlp", "--gradients", "1MB", "--hosts", "1"], "not allowed with argument"),
    (["--model", "pkg:make", "--hosts", "1", "--intra-link", "1GB/s"], "needs --input"),
    (["--gradients", "1MB", "--hosts", "1", "--strategies", "ring,tree"], "unknown gradient strategy 'tree'"),
    (["--gradients", "1MB", "--hosts", "1", "--step-ms", "nan"], "not a finite number"),
    (["--gradients", "1MB", "--hosts", "1", "--cores-per-host", "0"], "--cores-per-host"),
])
def test_bad_values_are_one_line_and_exit_2(capsys, argv, named, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no saved link between hosts
    assert main(["scale", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and named in err, err


def test_every_strategy_is_zero_on_one_device_but_servers():
    link = Link(1e-5, 1e9)
    for s in STRATEGIES:
        t = communication_time(s, 1e6, Cluster(1, 1, link, link))
        assert t == 0 or s.startswith("ps-"), (s, t)
    assert not math.isnan(communication_time("ps-2", 1e6, Cluster(1, 1, link, link)))


def _fake_probe():
    from types import SimpleNamespace

    figures = {"mm_float32_2t": 100.0, "stream_triad_2t": 20.0, "stream_copy_2t": 10.0, "torch_dispatch": 1000.0,
               "spin_handoff": 500.0}
    return SimpleNamespace(figures=lambda: figures, machine={"cpu": "test cpu"})


def test_compute_from_the_saved_probe_is_the_floor_and_the_intra_link_its_copy(capsys, monkeypatch, tmp_path):
    import dlperf.probe.cache as cache
    from dlperf.probe.cost import count_step, step_floor

    monkeypatch.setattr(cache, "load_probe", lambda *a, **k: _fake_probe())
    out_file = tmp_path / "scale.json"
    assert main(["scale", "--model", "mlp", "--batch-size", "4", "--hosts", "2", "--devices-per-host", "2",
                 "--link", "10gbit", "--compute", "probe", "--json", str(out_file)]) == 0
    doc = json.loads(out_file.read_text())
    hw = Hardware.from_probe_result(_fake_probe())
    from dlperf.models import get_spec

    spec = get_spec("mlp")
    x, _ = spec.input.make_batch(4, generator=torch.Generator().manual_seed(0))
    floor = step_floor(count_step(spec.build(), x), hw, devices=1, allreduce=None).no_overlap_s
    assert doc["rows"][0]["compute_s"] == pytest.approx(floor)
    assert doc["figures"]["compute"]["source"].startswith("floor from the saved dlperf probe figures")
    assert doc["figures"]["intra"]["source"].startswith("measured: the saved dlperf probe's copy")
    assert doc["figures"]["intra"]["value"] == [hw.link("device").alpha_s, hw.link("device").bandwidth]


def test_compute_from_the_probe_without_saved_figures_is_one_line(capsys, monkeypatch):
    import dlperf.probe.cache as cache

    monkeypatch.setattr(cache, "load_probe", lambda *a, **k: None)
    assert main(["scale", "--model", "mlp", "--hosts", "1", "--compute", "probe"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "dlperf probe --quick" in err


@pytest.mark.parametrize("hosts", [3, 4, 6])
def test_the_straggler_is_the_host_whose_every_pair_is_slow(hosts):
    from dlperf.probe.projection import straggler

    fast, slow = Link(50e-6, 1.25e8), Link(50e-6, 1.25e7)
    for slow_host in range(hosts):
        # a pair goes as fast as its slower host's link
        pairs = {(a, b): (slow if slow_host in (a, b) else fast).time(1 << 20) for a in range(hosts)
                 for b in range(a + 1, hosts)}
        assert straggler(pairs) == slow_host
    even = {(a, b): fast.time(1 << 20) * (1 + 0.1 * a) for a in range(hosts) for b in range(a + 1, hosts)}
    assert straggler(even) is None
    assert straggler({(0, 1): 1.0}) is None  # two hosts share one link: no side to blame


# --- what the measurement is made of: latency from small messages, links per transport, cores -------------

def test_the_latency_comes_from_the_small_messages_and_the_bandwidth_from_the_large():
    sizes = [4e3, 32e3, 256e3, 2e6, 16e6]
    true = Link(300e-6, 0.5e9)
    # the largest size ran 20% slow (a neighbour on the cores): a line through every point tilts and its
    # intercept lands far from the real latency; the small messages still say about what one costs
    seconds = [true.time(n) * (1.2 if n == 16e6 else 1.0) for n in sizes]
    fit = alpha_beta_fit(sizes, seconds)
    assert fit.alpha_s == pytest.approx(300e-6, rel=0.25)
    assert fit.bandwidth == pytest.approx(0.5e9 / 1.2, rel=0.1)
    assert abs(Link.fit(sizes, seconds).alpha_s - 300e-6) > 3 * abs(fit.alpha_s - 300e-6)
    exact = alpha_beta_fit(sizes, [true.time(n) for n in sizes])
    assert exact.alpha_s == pytest.approx(300e-6) and exact.bandwidth == pytest.approx(0.5e9)
    # a small message that waited on something else (a delayed acknowledgement) costs no more than a larger one
    stalled = alpha_beta_fit(sizes, [40e-3 if n == 4e3 else true.time(n) for n in sizes])
    assert stalled.alpha_s == pytest.approx(300e-6, rel=0.01) and stalled.bandwidth == pytest.approx(0.5e9)


def test_a_link_around_a_size_reads_the_measured_curve_between_its_neighbours():
    # a copy through the CPU: 3 GB/s while a message stays in the caches (up to 1 MB), 0.5 GB/s beyond
    sizes = [4e3, 32e3, 256e3, 768e3, 2e6, 16e6, 64e6]

    def took(n: float) -> float:
        return 200e-6 + min(n, 1e6) / 3e9 + max(n - 1e6, 0.0) / 0.5e9

    seconds = [took(n) for n in sizes]
    whole = alpha_beta_fit(sizes, seconds)
    for n in (64e3, 516e3, 1.5e6, 42e6, 100e6):  # inside, between, and past the largest (the last two sizes' line)
        near = alpha_beta_fit(sizes, seconds, around=n)
        assert near.alpha_s == pytest.approx(200e-6, rel=1e-6)
        # 1.5 MB's neighbours straddle the cache's edge: a line between them is within 15%
        assert near.time(n) == pytest.approx(took(n), rel=0.15 if n == 1.5e6 else 1e-6), n
    # one line through every size prices the LeNet-sized message about twice what it takes
    assert whole.time(516e3) > 1.8 * took(516e3)
    # below the smallest size: the two smallest sizes' line
    assert alpha_beta_fit(sizes, seconds, around=1e3).time(1e3) == pytest.approx(took(1e3), rel=1e-6)
    # a flat start (the two smallest took as long) puts the latency at the smallest's time
    flat = alpha_beta_fit([4e3, 32e3, 2e6], [1e-3, 1e-3, 3e-3], around=1e6)
    assert flat.alpha_s == pytest.approx(1e-3) and flat.time(1e6) == pytest.approx(1e-3 + 2e-3 * 968e3 / 1968e3)


@pytest.mark.parametrize("strategy,layout", [
    ("ring", Layout((0, 0, 1, 1))), ("sharded", Layout((0, 0, 1, 1))), ("hierarchical", Layout((0, 0, 1, 1))),
    ("ps-1", Layout((0, 0, 1), (1,))), ("ps-2", Layout((0, 1), (0, 1))), ("naive", Layout((0, 1, 2))),
])
def test_a_strategy_timed_on_a_layout_gives_back_the_link_it_ran_on(strategy, layout):
    link = Link(40e-6, 2e9)
    n = [1e4, 1e6]
    measured = Link.fit(n, [layout_time(strategy, x, layout, link, link) for x in n])
    got = link_from_strategy(strategy, measured, layout)
    assert got.alpha_s == pytest.approx(link.alpha_s) and got.bandwidth == pytest.approx(link.bandwidth)


def test_the_ring_of_link_from_strategy_is_link_from_allreduce():
    fit = Link(600e-6, 0.8e9)
    for hosts in [(0, 1), (0, 0, 1, 1), (0, 1, 2, 3, 4)]:
        assert link_from_strategy("ring", fit, Layout(hosts)) == link_from_allreduce(fit, len(hosts))
    with pytest.raises(UsageError, match="sends no message"):
        link_from_strategy("ring", fit, Layout((0,)))


def test_ranks_that_outnumber_the_cores_take_turns_for_their_reductions():
    n, per_byte = 40e6, 1e-10
    two_per_host = Layout((0, 0, 1, 1))
    # a core each: side by side, nothing to add
    assert all(cpu_time(s, n, two_per_host, HostCPU(2, per_byte)) == 0.0 for s in ("ring", "sharded", "hierarchical"))
    # one core for two ranks: each reduces 3/4 n in a ring of 4, one after the other on the host
    assert cpu_time("ring", n, two_per_host, HostCPU(1, per_byte)) == pytest.approx(0.75 * n * per_byte)
    # half a core each (emulated hosts sharing one machine's cores): three times one rank's share on top
    assert cpu_time("ring", n, two_per_host, HostCPU(0.5, per_byte)) == pytest.approx(3 * 0.75 * n * per_byte)
    # the servers sum every worker's push; the workers reduce nothing: one server alone takes no turns,
    # two servers on a one-core host each sum half of every push, one after the other
    assert cpu_time("ps-1", n, Layout((0, 0, 0), (0,)), HostCPU(1, per_byte)) == 0.0
    assert cpu_time("ps-2", n, Layout((0, 0), (0, 0)), HostCPU(1, per_byte)) == pytest.approx(n * per_byte)
    assert cpu_time("ps-2", n, Layout((0, 0), (0, 0)), HostCPU(4, per_byte)) == 0.0
    link = Link(10e-6, 1e9)
    plain = layout_time("ring", n, two_per_host, link, link)
    assert layout_time("ring", n, two_per_host, link, link, HostCPU(1, per_byte)) == \
        pytest.approx(plain + 0.75 * n * per_byte)
    with pytest.raises(UsageError, match="cores=0"):
        HostCPU(0, per_byte)


def test_the_cpu_term_vanishes_where_every_device_has_a_core_and_the_worked_example_stays_exact(capsys, tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no saved probe: the reduction's rate is assumed
    argv = ["--gradients", "160MB", "--hosts", "1", "--devices-per-host", "4", "--intra-link", "16GB/s,0us",
            "--strategies", "naive,ps-1,sharded"]
    doc, out = _scale(capsys, *argv, "--cores-per-host", "4")
    got = {s: round(v["communication_s"] * 1e3, 6) for s, v in doc["rows"][0]["strategies"].items()}
    assert got == {"naive": 60.0, "ps-1": 80.0, "sharded": 15.0}
    assert doc["figures"]["cpu"]["value"] == [4.0, pytest.approx(3 / 40e9)]
    assert "reduction assumed" in doc["figures"]["cpu"]["source"] and "4 cores" in out
    # two cores for four devices: where every device reduces a share, they take turns; where one device (or
    # the server) reduces everything, no one waits for a core
    doc, _ = _scale(capsys, *argv, "--cores-per-host", "2")
    shared = {s: v["communication_s"] * 1e3 for s, v in doc["rows"][0]["strategies"].items()}
    assert shared["naive"] == pytest.approx(60.0) and shared["ps-1"] == pytest.approx(80.0)
    assert shared["sharded"] == pytest.approx(15.0 + (4 * 0.75 * 160e6 / 2 - 0.75 * 160e6) * 3 / 40e9 * 1e3)


def test_a_link_around_a_size_is_read_off_the_curve_when_the_large_sizes_took_no_longer():
    # the large sizes took as long as each other (a slope of zero): the whole-range fit is a flat line, but the
    # curve still rises from the small sizes to the middle, and the link around the middle reads it
    sizes, seconds = [4e3, 32e3, 256e3, 2e6, 16e6], [1e-4, 1e-4, 1e-3, 1e-3, 1e-3]
    near = alpha_beta_fit(sizes, seconds, around=144e3)
    assert near.time(144e3) == pytest.approx(1e-4 + 0.5 * 0.9e-3, rel=1e-6)


# --- the formulas over groups of alike hosts against the same formulas rank by rank ----------------------------
def _per_rank_reference(strategy: str, n: float, hosts: list[int], servers: list[int], network: Link, intra: Link,
                        cpu: HostCPU | None) -> float:
    """The plain reference: each formula of d2l 12.7 written over the list of every rank's host."""
    from collections import Counter

    p = len(hosts)
    counts = Counter(hosts)
    if p < 2 and strategy not in ("ps-1", "ps-2"):
        return 0.0

    def sharded(world_hosts):
        k = len(world_hosts)
        if k < 2:
            return 0.0
        device = 2 * intra.alpha_s + 2 * (k - 1) / k * n * intra.beta
        per = Counter(world_hosts)
        if len(per) == 1:
            return device
        return max(device, 2 * network.alpha_s + 2 * max(g * (k - g) / k for g in per.values()) * n * network.beta)

    ring = (lambda k, link: 0.0 if k < 2 else 2 * (k - 1) * link.alpha_s + 2 * (k - 1) / k * n * link.beta)
    if strategy == "ring":
        t = ring(p, network if len(counts) > 1 else intra)
    elif strategy == "sharded":
        t = sharded(hosts)
    elif strategy == "naive":
        remote = sum(1 for h in hosts if h != hosts[0])
        t = 2 * max((p - 1) * intra.time(n), remote * network.time(n) if remote else 0.0)
    elif strategy == "hierarchical":
        g = max(counts.values())
        t = sharded([0] * g) if g > 1 else 0.0
        if len(counts) > 1:
            t += ring(len(counts), network) + (intra.time(n) if g > 1 else 0.0)
    else:
        s, part, phase = len(servers), n / len(servers), 0.0
        for host in set(hosts) | set(servers):
            mine, theirs = sum(1 for h in hosts if h == host), sum(1 for h in servers if h == host)
            local, remote = mine * theirs, max(mine * (s - theirs), theirs * (p - mine))
            phase = max(phase, local * intra.time(part) if local else 0.0,
                        remote * network.time(part) if remote else 0.0)
        t = 2 * phase
    return t if cpu is None else t + _per_rank_cpu(strategy, n, hosts, servers, cpu)


def _per_rank_cpu(strategy: str, n: float, hosts: list[int], servers: list[int], cpu: HostCPU) -> float:
    from collections import Counter

    p, counts = len(hosts), Counter(hosts)
    if strategy in ("ring", "sharded"):
        work = [(p - 1) / p * n] * p
    elif strategy == "naive":
        work = [(p - 1) * n] + [0.0] * (p - 1)
    elif strategy == "hierarchical":
        leaders = {hosts.index(h) for h in counts}
        work = [(counts[h] - 1) / counts[h] * n + ((len(counts) - 1) / len(counts) * n if r in leaders else 0.0)
                for r, h in enumerate(hosts)]
    else:
        work = [0.0] * p + [p * n / len(servers)] * len(servers)
    by_host: dict[int, list[float]] = {}
    for host, nbytes in zip(hosts + servers, work, strict=True):
        by_host.setdefault(host, []).append(nbytes * cpu.reduce_s_per_byte)
    return max([0.0] + [sum(w) / cpu.cores - max(w) for w in by_host.values() if len(w) > cpu.cores])


def test_the_grouped_formulas_match_the_per_rank_ones_on_fresh_layouts():
    import random

    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for _ in range(300):
        hosts = sorted(rng.choices(range(rng.randint(1, 6)), k=rng.randint(1, 24)))
        rng.shuffle(hosts) if rng.random() < 0.3 else None  # ranks need not be in host order
        network, intra = Link(rng.uniform(0, 1e-4), rng.uniform(1e8, 1e10)), Link(rng.uniform(0, 1e-5), 1e10)
        cpu = rng.choice([None, HostCPU(rng.choice([0.5, 1, 2, 3]), rng.uniform(1e-11, 1e-9))])
        n = rng.choice([0.0, 1.0, 4e3, 160e6])
        for strategy, (_, count) in STRATEGIES.items():
            servers = [rng.randrange(8) for _ in range(max(count, rng.randint(1, 3) if count else 0))]
            got = layout_time(strategy, n, Layout(tuple(hosts), tuple(servers)), network, intra, cpu)
            want = _per_rank_reference(strategy, n, hosts, servers, network, intra, cpu)
            assert got == pytest.approx(want, rel=1e-12, abs=1e-15), (seed, strategy, hosts, servers, cpu)
        cluster = Cluster(rng.randint(1, 9), rng.randint(1, 9), network, intra, cpu)
        for strategy, (_, count) in STRATEGIES.items():
            hosts = list(cluster.layout().hosts)
            want = _per_rank_reference(strategy, n, hosts, [s % cluster.hosts for s in range(count)], network,
                                       intra, cpu)
            assert communication_time(strategy, n, cluster) == pytest.approx(want, rel=1e-12, abs=1e-15), \
                (seed, strategy, cluster)


@pytest.mark.timeout(120)
def test_a_projection_costs_the_same_for_each_host_count_whatever_the_devices():
    """1,024 hosts x 64 devices in about a second: a row costs the kinds of host, not the hosts or ranks (the
    per-rank formulas took 110 s and more; 256 hosts 10 s)."""
    import time

    network, intra = Link(250e-6, 10e9 / 8), Link(5e-6, 16e9)
    cpu = HostCPU(8, 1e-10)

    def seconds(hosts: int, devices: int) -> float:
        start = time.perf_counter()
        rows = project(160e6, 0.1, Cluster(hosts, devices, network, intra, cpu)).rows
        assert len(rows) == hosts
        return time.perf_counter() - start

    assert seconds(1024, 64) < 3.0  # about a second on a loaded two-core machine; quadratic would take minutes
    small, large = [], []
    for _ in range(3):  # alternating, so that load hits both alike
        small.append(seconds(128, 64))
        large.append(seconds(1024, 64))
    assert min(large) / min(small) < 8 * 2  # linear: 8x the hosts, 8x the time (with room for noise)
    assert min(large) < 4 * min(seconds(1024, 1) for _ in range(3))  # 64x the devices cost no more

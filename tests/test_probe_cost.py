"""The cost model against hand-computed cases and d2l 12.7's worked examples."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dlperf.errors import DlperfError, UsageError
from dlperf.probe.cost import (
    ALLREDUCE_FORMULAS,
    PROJECT_ALGORITHMS,
    Hardware,
    Link,
    StepCounts,
    allreduce_time,
    classify_op,
    count_step,
    parameter_server_time,
    rank_allreduce,
    step_floor,
)

MB = 1e6


def _toy(alpha: float = 1e-3, bandwidth: float = 1e3) -> Hardware:
    link = Link(alpha, bandwidth)
    return Hardware("toy", {"float32": 100.0}, 50.0, 0.5, {k: link for k in ("copy", "host", "device", "network")})


# --- allreduce formulas: hand-computed with alpha = 1 ms, 1000 bytes/s (beta = 1 ms per byte) ---------------

@pytest.mark.parametrize(("algorithm", "k", "expected_s"), [
    ("naive", 4, 2 * 3 * (1e-3 + 8e-3)),             # 2(k-1)(a + n b)
    ("cpu", 4, 2 * 4 * (1e-3 + 8e-3)),               # 2k(a + n b)
    ("sharded", 4, 2e-3 + 2 * 3 / 4 * 8e-3),         # 2a + 2(k-1)/k n b
    ("ring", 4, 2 * 3 * 1e-3 + 2 * 3 / 4 * 8e-3),    # 2(k-1)a + 2(k-1)/k n b
    ("recursive-doubling", 8, 3 * (1e-3 + 8e-3)),   # lg k (a + n b)
    ("rabenseifner", 8, 2 * 3 * 1e-3 + 2 * 7 / 8 * 8e-3),
    ("tree", 8, 2 * 3 * (1e-3 + 8e-3)),
    ("tree", 5, 2 * 3 * (1e-3 + 8e-3)),             # not a power of two: lg rounds up
])
def test_allreduce_formulas_match_hand_computed(algorithm, k, expected_s):
    assert allreduce_time(algorithm, 8, k, _toy()) == pytest.approx(expected_s, rel=1e-12)


def test_one_device_needs_no_communication():
    assert all(allreduce_time(a, 1e9, 1, _toy()) == 0.0 for a in ALLREDUCE_FORMULAS)


def test_d2l_12_7_1_worked_example():
    """160 MB of gradients, 4 GPUs on a 16 GB/s PCIe switch: 60 ms via one GPU, 80 ms via the CPU, 15 ms split."""
    hw = Hardware.from_seed("pcie-4gpu")
    ms = {a: allreduce_time(a, 160 * MB, 4, hw) * 1e3 for a in PROJECT_ALGORITHMS}
    assert ms["naive"] == pytest.approx(60, abs=0.1)    # 3 x 10 ms to GPU0, 3 x 10 ms back
    assert ms["cpu"] == pytest.approx(80, abs=0.1)      # each of the 4 GPUs to the CPU and back
    assert ms["sharded"] == pytest.approx(15, abs=0.1)  # 4 parts of 40 MB aggregated at once: 7.5 + 7.5 ms
    # the pure transfer terms are exactly the text's figures; latency is what is left
    no_latency = Hardware("no latency", hw.flops, hw.memory_bandwidth, hw.dispatch_s,
                          {k: Link(0.0, v.bandwidth) for k, v in hw.links.items()})
    assert allreduce_time("naive", 160 * MB, 4, no_latency) == pytest.approx(0.060, rel=1e-12)
    assert allreduce_time("cpu", 160 * MB, 4, no_latency) == pytest.approx(0.080, rel=1e-12)
    assert allreduce_time("sharded", 160 * MB, 4, no_latency) == pytest.approx(0.015, rel=1e-12)


def test_d2l_12_7_2_ring_on_8_v100():
    """The text's 2 x 160 MB / (3 x 18 GB/s) ~ 6 ms drops ring's (k-1)/k = 7/8; the exact ring is 5.2 ms."""
    hw = Hardware.from_seed("v100-8gpu")
    ring = allreduce_time("ring", 160 * MB, 8, hw)
    assert ring == pytest.approx(2 * 7 / 8 * 160 * MB / (3 * 18e9) + 14 * 5e-6, rel=1e-9)
    assert 5e-3 < ring < 6.5e-3
    assert 2 * 160 * MB / (3 * 18e9) == pytest.approx(5.9e-3, abs=0.1e-3)  # the text's approximation


def test_ranking_orders_by_time_and_gives_reasons():
    hw = Hardware.from_seed("pcie-4gpu")
    big = rank_allreduce(160 * MB, 4, hw)
    assert [c.seconds for c in big] == sorted(c.seconds for c in big)
    assert big[0].algorithm == "sharded" and big[-1].algorithm == "cpu"
    assert all("bandwidth-bound" in c.reason for c in big)
    # a tiny message is latency-bound: the ring's 2(k-1) steps lose to two-step and log-step schemes
    small = rank_allreduce(64, 16, hw)
    names = [c.algorithm for c in small]
    assert names.index("sharded") < names.index("rabenseifner") < names.index("ring")
    assert "latency-bound" in small[-1].reason


def test_parameter_server_scales_with_servers():
    hw = _toy(alpha=0.0)
    one = parameter_server_time(10, 8, 1, hw)
    assert one == pytest.approx(2 * 8 * 10 / 1e3)  # one server takes all 8 workers' 10 bytes, twice
    assert parameter_server_time(10, 8, 8, hw) == pytest.approx(2 * 10 / 1e3)  # S = m: constant
    assert parameter_server_time(10, 16, 16, hw) == pytest.approx(parameter_server_time(10, 8, 8, hw))
    assert parameter_server_time(10, 2, 1, _toy(alpha=1.0)) == pytest.approx(2 * (2 * 1.0 + 2 * 10 / 1e3))


# --- counting ---------------------------------------------------------------------------------------------

def test_linear_flops_exact():
    """A Linear whose input needs no gradient: forward 2*B*in*out, backward the weight gradient only."""
    b, i, o = 8, 5, 3
    counts = count_step(nn.Linear(i, o), torch.randn(b, i))
    assert counts.flops == {"matmul": 2 * (2 * b * i * o)}
    assert counts.param_bytes == (i * o + o) * 4
    assert counts.input_bytes == b * i * 4


def test_bytes_read_and_written_by_hand():
    counts = count_step(nn.Linear(5, 3), torch.randn(4, 5))
    forward = 4 * (3 + 4 * 5 + 5 * 3) + 4 * (4 * 3)  # addmm reads bias, x, W^T; writes the 4x3 output
    weight_grad = 4 * (3 * 4 + 4 * 5) + 4 * (3 * 5)  # mm reads grad^T and x; writes the 3x5 gradient
    assert counts.bytes["matmul"] == forward + weight_grad
    assert counts.bytes["optimizer"] == 3 * counts.param_bytes  # p.add_(g): read p and g, write p


def test_hidden_linear_costs_three_forwards():
    """A Linear fed by another layer also computes its input's gradient: 3x its forward FLOPs."""
    b = 4
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    counts = count_step(model, torch.randn(b, 6))
    first, second = 2 * b * 6 * 5, 2 * b * 5 * 3
    assert counts.total_flops == 2 * first + 3 * second


def test_conv_flops_exact_on_meta_and_real():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    x = torch.randn(2, 3, 6, 6)
    forward = 2 * 2 * 4 * 4 * 4 * (3 * 3 * 3)  # 2 * B * out_ch * H_out * W_out * (in_ch * kh * kw)
    meta = count_step(model, x)
    real = count_step(model, x, on_meta=False)
    assert meta.flops["conv"] == real.flops["conv"] == 2 * forward
    # the same operators, but the labels drawn on the host must be moved to the meta device: one copy more
    assert {g: n for g, n in meta.ops.items() if g != "loss"} == {g: n for g, n in real.ops.items() if g != "loss"}
    assert meta.ops["loss"] == real.ops["loss"] + 1
    assert all(p.device.type == "cpu" for p in model.parameters())  # the caller's model is left alone


def test_counts_group_the_step():
    counts = count_step(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                      nn.Linear(2 * 3 * 3, 4)), torch.randn(2, 1, 8, 8))
    assert {"conv", "matmul", "pooling", "elementwise", "loss", "optimizer"} <= set(counts.ops)
    assert counts.bytes["conv"] > 0 and counts.total_bytes > 0


def test_classify_op():
    assert classify_op("aten::mkldnn_convolution") == "conv"
    assert classify_op("aten.addmm.default") == "matmul"
    assert classify_op("aten::t") == "layout"
    assert classify_op("aten::threshold_backward") == "elementwise"
    assert classify_op("aten::nll_loss_backward") == "loss"
    assert classify_op("aten::add_", "optimizer") == "optimizer"
    assert classify_op("aten::max_pool2d_with_indices") == "pooling"
    assert classify_op("aten::native_batch_norm") == "norm"


def test_step_floor_components_and_table():
    counts = StepCounts(flops={"matmul": 1000.0}, bytes={"matmul": 100.0}, ops={"matmul": 4}, param_bytes=8.0)
    hw = _toy()
    floor = step_floor(counts, hw, devices=2, allreduce="ring", measured_s=100.0)
    expected = {"compute": 1000 / 2 / 100, "memory": 100 / 2 / 50, "dispatch": 4 * 0.5,
                "allreduce:ring": 2 * 1 * 1e-3 + 2 * 1 / 2 * 8 / 1e3}
    assert floor.components == pytest.approx(expected)
    assert floor.no_overlap_s == pytest.approx(sum(expected.values()))
    assert floor.overlap_s == pytest.approx(5.0) and floor.bottleneck == "compute"
    text = str(floor)
    assert "allreduce:ring" in text and "no overlap" in text and "measured" in text
    counts.input_bytes = 40.0
    copied = step_floor(counts, hw, devices=2, allreduce=None, input_from_host=True)
    assert copied.components["input copy"] == pytest.approx(2 * 1e-3 + 40 / 1e3)
    assert "allreduce:ring" not in copied.components
    ps = step_floor(counts, hw, devices=4, servers=2)
    assert ps.components["push/pull"] == pytest.approx(parameter_server_time(8.0, 4, 2, hw))


# --- hardware figures -------------------------------------------------------------------------------------

def test_from_probe_round_trip_and_defaults():
    hw = Hardware.from_seed("v100-8gpu")
    again = Hardware.from_probe(hw.to_dict())
    assert again.flops == hw.flops and again.links == hw.links and again.dispatch_s == hw.dispatch_s
    minimal = Hardware.from_probe({"flops": {"torch.float32": 1e11}, "memory_bandwidth": 2e10, "dispatch_s": 5e-6,
                                   "cpu_model": "anything else is ignored"})
    assert minimal.peak_flops(torch.float32) == 1e11
    assert minimal.link("device") == minimal.link("copy") == Link(1e-7, 1e10)


@pytest.mark.parametrize(("figures", "named"), [
    ([1, 2], "mapping"),
    ({"flops": {}, "memory_bandwidth": 1, "dispatch_s": 1}, "flops"),
    ({"flops": {"float32": "fast"}, "memory_bandwidth": 1, "dispatch_s": 1}, "flops['float32']"),
    ({"flops": {"float32": 1}, "memory_bandwidth": math.nan, "dispatch_s": 1}, "memory_bandwidth"),
    ({"flops": {"float32": 1}, "memory_bandwidth": 1, "dispatch_s": -1}, "dispatch_s"),
    ({"flops": {"float32": 1}, "memory_bandwidth": 1, "dispatch_s": True}, "dispatch_s"),
    ({"flops": {"float32": 1}, "memory_bandwidth": 1, "dispatch_s": 1, "links": {"wifi": {}}}, "wifi"),
    ({"flops": {"float32": 1}, "memory_bandwidth": 1, "dispatch_s": 1,
      "links": {"network": {"alpha_s": 0, "bandwidth": 0}}}, "bandwidth"),
])
def test_from_probe_refuses_bad_figures_by_name(figures, named):
    with pytest.raises(UsageError) as info:
        Hardware.from_probe(figures)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_unknown_names_are_usage_errors():
    with pytest.raises(DlperfError, match="pcie-4gpu"):
        Hardware.from_seed("tpu")
    with pytest.raises(UsageError, match="ring"):
        allreduce_time("butterfly", 1, 2, _toy())
    with pytest.raises(UsageError, match="float16"):
        Hardware.from_seed("cpu-4core").peak_flops(torch.float16)


def test_a_model_the_meta_device_cannot_run_is_counted_for_real():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return y[:, : int((y > -1e9).sum().item()) // x.shape[0]]  # needs the values: not on meta

    counts = count_step(DataDependent(), torch.randn(3, 4))
    assert counts.flops["matmul"] == 2 * (2 * 3 * 4 * 4)


def test_hardware_from_a_probe_run_takes_its_figures():
    from types import SimpleNamespace

    figures = {"mm_float32_1t": 100.0, "mm_float32_2t": 180.0, "mm_bfloat16_2t": 400.0,
               "stream_triad_1t": 30.0, "stream_triad_2t": 45.0, "stream_copy_2t": 40.0,
               "torch_dispatch": 900.0, "spin_handoff": 300.0, "tcp_rtt": 40_000.0, "tcp_send_4k": 4096.0,
               "l1": None}
    result = SimpleNamespace(figures=lambda: figures, machine={"cpu": "test cpu"})
    hw = Hardware.from_probe_result(result)
    assert hw.peak_flops("float32") == pytest.approx(180e9) and hw.peak_flops("bfloat16") == pytest.approx(400e9)
    assert hw.memory_bandwidth == pytest.approx(45e9) and hw.dispatch_s == pytest.approx(900e-9)
    assert hw.link("copy").alpha_s == pytest.approx(300e-9) and hw.link("copy").bandwidth == pytest.approx(40e9)
    assert hw.link("network").alpha_s == pytest.approx(20e-6) and hw.link("network").bandwidth == pytest.approx(1e9)
    assert Hardware.from_probe_result(result, threads=1).peak_flops("float32") == pytest.approx(100e9)
    with pytest.raises(UsageError):  # no matrix-product row at that thread count: no FLOP/s to build on
        Hardware.from_probe_result(result, threads=4)


# --- the one link model and its fit, against a plain least-squares reference ---------------------------------
def _least_squares(sizes, seconds):
    import numpy as np

    slope, intercept = np.polyfit(np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float), 1)
    return intercept, slope


@pytest.mark.parametrize("seed", range(5))
def test_link_fit_is_the_least_squares_line(seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = [4096 * 4 ** k for k in range(6)]
    seconds = [20e-6 + n / 5e9 + float(torch.rand(1, generator=gen)) * 1e-6 for n in sizes]
    intercept, slope = _least_squares(sizes, seconds)
    link = Link.fit(sizes, seconds)
    assert link.alpha_s == pytest.approx(max(intercept, 0.0), rel=1e-6, abs=1e-12)
    assert link.beta == pytest.approx(slope, rel=1e-6)
    assert link.time(1 << 20) == pytest.approx(link.alpha_s + (1 << 20) * slope, rel=1e-6)


def test_link_fit_through_two_points_and_its_limits():
    link = Link.fit([4096, 4 << 20], [20e-6 + 4096 / 9e9, 20e-6 + (4 << 20) / 9e9])
    assert (link.alpha_s, link.bandwidth) == (pytest.approx(20e-6), pytest.approx(9e9))
    assert link.describe() == "20 us + 9.00 GB/s"
    # the large size was no slower: noise on a fast link, all latency
    assert Link.fit([4096, 4 << 20], [3e-3, 2e-3]) == Link(3e-3, math.inf)
    # a negative intercept (noise) is no latency at all, or the floor asked for
    steep = ([1000, 2000], [1e-7, 1e-6])
    assert Link.fit(*steep).alpha_s == 0.0
    assert Link.fit(*steep, min_alpha_s=1e-8).alpha_s == 1e-8
    with pytest.raises(ValueError, match="two sizes"):
        Link.fit([4096, 4096], [1e-3, 2e-3])


def test_named_tables_list_their_names_on_a_miss():
    with pytest.raises(UsageError, match=r"^unknown seed hardware 'dgx'; valid choices: pcie-4gpu, v100-8gpu, cpu-4"):
        Hardware.from_seed("dgx")
    with pytest.raises(UsageError, match=r"^unknown allreduce algorithm 'bruck'; valid choices: naive, cpu, sharded"):
        allreduce_time("bruck", 1e6, 4, Hardware.from_seed())
    assert list(ALLREDUCE_FORMULAS)[:4] == list(PROJECT_ALGORITHMS)


# --- links named by people, and saved fits between hosts (dlperf.probe.links) ---------------------------------

@pytest.mark.parametrize("text, rate", [("10gbit", 1.25e9), ("25Gbit/s", 3.125e9), ("25gbps", 3.125e9), ("2GBps", 2e9),
                                        ("1.25GB/s", 1.25e9), ("16GB", 16e9), ("100mbit", 12.5e6),
                                        ("800 Mbit/s", 1e8)])
def test_link_rates_in_bits_or_bytes(text, rate):
    from dlperf.probe.links import parse_rate

    assert parse_rate(text) == pytest.approx(rate)


@pytest.mark.parametrize("text, named", [("10", "not a link rate"), ("fast", "not a link rate"),
                                         ("0gbit", "outside"), ("1e30gbit", "outside"), ("-1gbit", "not a link"),
                                         ("nan gbit", "not a link rate"), ("1" * 50 + "gbit", "not a link rate")])
def test_bad_link_rates_name_the_value(text, named):
    from dlperf.probe.links import parse_rate

    with pytest.raises(UsageError, match=named):
        parse_rate(text)


def test_link_latencies_and_the_pair():
    from dlperf.probe.links import parse_latency, parse_link

    assert parse_latency("250ns") == pytest.approx(250e-9) and parse_latency("0.2ms") == pytest.approx(2e-4)
    assert parse_latency("0us") == 0.0
    assert parse_link("25gbit,20us") == (Link(20e-6, 3.125e9), True)
    assert parse_link("25gbit") == (Link(0.0, 3.125e9), False)
    for bad, named in (("10gbit,11s", "longer than"), ("10gbit,fast", "not a latency"),
                       ("10gbit,1us,2us", "3 parts")):
        with pytest.raises(UsageError, match=named):
            parse_link(bad)


def test_saved_fits_between_hosts_skip_one_host_layouts_and_bad_files(tmp_path):
    from dlperf.probe.links import save_links, saved_between_hosts

    assert saved_between_hosts(str(tmp_path)) is None
    save_links(["a", "a"], {"gloo": Link(1e-4, 1e9)}, path=str(tmp_path / "links-0000000000000001.json"))
    assert saved_between_hosts(str(tmp_path)) is None  # one host: shared memory's layout, not a network
    (tmp_path / "links-0000000000000002.json").write_text("{not json")
    save_links(["a (10.0.0.1)", "b (10.0.0.2)", "b (10.0.0.2)"], {"gloo": Link(2e-4, 5e8)},
               path=str(tmp_path / "links-0000000000000003.json"))
    fit, world, path = saved_between_hosts(str(tmp_path))
    assert (fit, world) == (Link(2e-4, 5e8), 3) and path.endswith("3.json")


@pytest.mark.parametrize("rate", [5e-324, 1e-3, 1e300])
def test_a_saved_link_rate_no_network_shows_is_not_read(tmp_path, rate, capsys):
    import json

    from dlperf.probe.links import load_links, save_links

    path = str(tmp_path / "links-0000000000000009.json")
    save_links(["a", "b"], {"gloo": Link(1e-4, 1e9)}, path=path)
    with open(path) as f:
        doc = json.load(f)
    doc["links"]["gloo"]["bytes_per_s"] = rate
    with open(path, "w") as f:
        json.dump(doc, f)
    assert load_links(["a", "b"], ["gloo"], path) == (None, path)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a plausible link" in err and "outside what any machine shows" in err

"""The measured choice of transport across processes: fits, thresholds, the link cache as hostile input, real ranks."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from dlperf.errors import UsageError
from dlperf.parallel.communication.process_group import PROCESS_ALLREDUCE_ENV, describe_process_allreduce
from dlperf.parallel.communication.process_links import LINK_PROBE_ENV, ProcessChoice, probe_again_requested
from dlperf.parallel.launchers import ProcessLauncher, rank_info
from dlperf.probe.cache import ProbeCacheError
from dlperf.probe.cost import Link
from dlperf.probe.links import load_links, parse_links, save_links

HOSTS = ["node-a", "node-a"]


# --- the fit and the choice per size, against brute force ------------------------------------------------------


def test_two_points_give_latency_and_bandwidth():
    fit = Link.fit([4096, 4 << 20], [20e-6 + 4096 / 9e9, 20e-6 + (4 << 20) / 9e9])
    assert fit.alpha_s == pytest.approx(20e-6)
    assert fit.bandwidth == pytest.approx(9e9)
    flat = Link.fit([4096, 4 << 20], [3e-3, 2e-3])  # noise: the large size was faster
    assert flat == Link(3e-3, math.inf)
    assert flat.time(1 << 30) == 3e-3


@pytest.mark.parametrize("fits", [
    {"shm": Link(21e-6, 9e9), "gloo": Link(980e-6, 1.6e9)},
    {"shm": Link(300e-6, 9e9), "gloo": Link(50e-6, 1.6e9)},
    {"shm": Link(30e-6, 1e9), "gloo": Link(500e-6, 5e9)},
    {"hierarchical": Link(200e-6, 3e9), "gloo": Link(200e-6, 3e9)},
    {"gloo": Link(0.0, math.inf)},
])
def test_the_pick_for_every_size_is_the_fastest_transport(fits):
    choice = ProcessChoice(fits, "given")
    names = list(fits)
    for nbytes in [0, 1, 1000, 4096, 65536, 100_000, 1 << 20, 3 << 20, 1 << 24, 1 << 28, 1 << 32]:
        best = min(names, key=lambda n: (fits[n].time(nbytes), names.index(n)))
        assert fits[choice.pick(nbytes)].time(nbytes) == pytest.approx(fits[best].time(nbytes), rel=1e-9)


def test_the_description_names_the_figures_and_the_threshold():
    always = ProcessChoice({"shm": Link(21e-6, 9e9), "gloo": Link(980e-6, 1.6e9)}, "given").describe()
    assert always[0] == "process allreduce: shm: 21 us + 9.00 GB/s; gloo: 980 us + 1.60 GB/s -> shm for every size"
    # shm starts 250 us later but moves bytes faster: the lines cross at 250 us / (1/1 - 1/5 ns per byte)
    split = ProcessChoice({"shm": Link(300e-6, 5e9), "gloo": Link(50e-6, 1e9)}, "given")
    crossing = 250e-6 / (1 / 1e9 - 1 / 5e9)
    assert crossing == pytest.approx(312_500)
    assert split.pick(int(crossing) - 1) == "gloo" and split.pick(int(crossing) + 1) == "shm"
    assert split.describe()[0].endswith("-> gloo below 305 KB, shm from 305 KB")


# --- the link cache: hostile files give one clear error, and the loader measures again -------------------------


def _doc(**changes) -> bytes:
    doc = {"format": "dlperf-links-1", "created": 1.7e9, "hosts": HOSTS, "world": 2,
           "links": {"shm": {"latency_s": 2e-5, "bytes_per_s": 9e9}, "gloo": {"latency_s": 1e-3, "bytes_per_s": None}}}
    doc.update(changes)
    return json.dumps(doc).encode()


def test_a_valid_document_parses():
    assert parse_links(_doc(), "f", HOSTS) == {"shm": Link(2e-5, 9e9), "gloo": Link(1e-3, math.inf)}


@pytest.mark.parametrize("data, problem", [
    (b"", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[" * 100_000, "not valid JSON"),
    (b"[]", "not a dlperf-links-1 document"),
    (_doc(format="dlperf-links-0"), "not a dlperf-links-1 document"),
    (_doc(hosts="node-a"), "'hosts' is not a list"),
    (_doc(hosts=["node-a", "node-b"]), "another layout"),
    (_doc(world=True), "another layout"),
    (_doc(created="yesterday"), "'created'"),
    (_doc(created=1e300), "'created'"),
    (_doc(links=[]), "'links' is not an object"),
    (_doc(links={"nccl": {"latency_s": 1, "bytes_per_s": 1}}), "'nccl', not one of"),
    (_doc(links={"shm": {"latency_s": 1}}), "'links.shm' is not an object"),
    (_doc(links={"shm": {"latency_s": -1.0, "bytes_per_s": 1e9}}), "latency_s' is -1.0"),
    (_doc(links={"shm": {"latency_s": 1e-5, "bytes_per_s": "fast"}}), "bytes_per_s' is 'fast'"),
    (_doc(links={"shm": {"latency_s": 1e-5, "bytes_per_s": 0}}), "not a plausible link"),
    (_doc(links={"shm": {"latency_s": 1e9, "bytes_per_s": 1e9}}), "not a plausible link"),
])
def test_a_hostile_document_gives_one_clear_error(data, problem):
    with pytest.raises(ProbeCacheError, match="link cache f: ") as info:
        parse_links(data, "f", HOSTS)
    message = str(info.value)
    assert problem in message and "fix: delete it" in message and "\n" not in message


def test_a_corrupt_or_incomplete_file_is_reported_and_measured_again(tmp_path, capsys):
    path = str(tmp_path / "links.json")
    assert load_links(HOSTS, ["shm", "gloo"], path) == (None, path)  # none saved yet: silent
    assert capsys.readouterr().err == ""
    (tmp_path / "links.json").write_bytes(b'{"format": "dlperf-links-1", "hosts": [')
    assert load_links(HOSTS, ["shm", "gloo"], path) == (None, path)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not valid JSON" in err and "measuring again" in err
    save_links(HOSTS, {"shm": Link(2e-5, 9e9)}, path)
    assert load_links(HOSTS, ["shm", "gloo"], path) == (None, path)
    assert "no figures for gloo" in capsys.readouterr().err
    os.unlink(path)
    os.mkfifo(path)  # never read as if it were data: no hang
    assert load_links(HOSTS, ["shm"], path) == (None, path)
    err = capsys.readouterr().err
    assert "not a regular file" in err and "link cache" in err and "run `dlperf probe`" not in err


def test_saved_figures_read_back(tmp_path):
    fits = {"shm": Link(2.5e-5, 8.5e9), "gloo": Link(9e-4, math.inf)}
    path = save_links(HOSTS, fits, str(tmp_path / "l.json"))
    assert load_links(HOSTS, ["shm", "gloo"], path) == (fits, path)
    assert load_links(HOSTS, ["gloo"], path) == ({"gloo": fits["gloo"]}, path)


def test_bad_settings_give_one_clear_error(monkeypatch):
    monkeypatch.setenv(LINK_PROBE_ENV, "sometimes")
    with pytest.raises(UsageError, match=f"{LINK_PROBE_ENV}='sometimes': expected again"):
        probe_again_requested()
    monkeypatch.setenv(PROCESS_ALLREDUCE_ENV, "nccl")
    with pytest.raises(UsageError, match="'nccl': expected one of auto, gloo, shm"):
        describe_process_allreduce()
    for forced in ("gloo", "shm"):
        monkeypatch.setenv(PROCESS_ALLREDUCE_ENV, forced)
        assert describe_process_allreduce() == [describe_process_allreduce()[0]]
        assert f"set by {PROCESS_ALLREDUCE_ENV}={forced}" in describe_process_allreduce()[0]


# --- real processes: every rank agrees, the chosen path sums as gloo does, the figures are reused -------------


def _choice_worker() -> dict:
    import torch.distributed as dist

    from dlperf.parallel.communication.process_group import allreduce_across_processes
    from dlperf.parallel.communication.process_links import choose_process_allreduce

    rank = rank_info().rank
    torch.set_num_threads(1)
    choice = choose_process_allreduce()
    equal = []
    for n in (1, 1003, 300_000, 1_100_000):
        x = torch.randn(n, generator=torch.Generator().manual_seed(10 * n + rank))
        ours, expected = x.clone(), x.clone()
        allreduce_across_processes(ours)
        dist.all_reduce(expected)
        equal.append(torch.equal(ours, expected))  # two addends: every order of summation gives the same bits
    return {"fits": choice.fits, "picks": [choice.pick(1 << k) for k in range(0, 31)], "equal": equal,
            "source": choice.source, "describe": describe_process_allreduce()}


def _launch() -> list[dict]:
    results = ProcessLauncher(2, backend="gloo", join_timeout_s=100).launch(_choice_worker)
    assert all(r["equal"] == [True] * 4 for r in results)
    assert results[0]["fits"] == results[1]["fits"] and results[0]["picks"] == results[1]["picks"]
    assert results[0]["describe"] == results[1]["describe"] and set(results[0]["fits"]) == {"shm", "gloo"}
    return results


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ranks_agree_sum_like_gloo_and_reuse_or_remeasure_the_saved_links(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = _launch()
    assert first[0]["source"].startswith("measured now")
    saved = list((tmp_path / "dlperf" / "probe").glob("links-*.json"))
    assert len(saved) == 1
    assert parse_links(saved[0].read_bytes(), str(saved[0]), [os.uname().nodename] * 2) == first[0]["fits"]

    again = _launch()  # the saved figures, not a new probe
    assert again[0]["source"].startswith("figures saved in") and again[0]["fits"] == first[0]["fits"]

    saved[0].write_bytes(b'{"format": "dlperf-links-1", "links": {"shm": ')
    remeasured = _launch()  # corrupt: reported and measured again, and the file replaced
    assert remeasured[0]["source"].startswith("measured now")
    assert parse_links(saved[0].read_bytes(), str(saved[0]), [os.uname().nodename] * 2) == remeasured[0]["fits"]

    monkeypatch.setenv(LINK_PROBE_ENV, "again")
    assert _launch()[0]["source"].startswith("measured now")


# --- dlperf train --nproc-per-node N --algorithm auto prints the choice from rank 0 -----------------------------


def _train(tmp_path, env_extra: dict, *args: str):
    import subprocess
    import sys

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path), **env_extra}
    return subprocess.run([sys.executable, "-m", "dlperf.cli", "train", "--nproc-per-node", "2", "--epochs", "1",
                           "--train-size", "64", "--test-size", "32", "--no-progress", *args],
                          capture_output=True, text=True, env=env, timeout=200)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, value", [(PROCESS_ALLREDUCE_ENV, "nccl"), (LINK_PROBE_ENV, "never")])
def test_train_refuses_a_bad_setting_before_starting_processes(tmp_path, name, value, monkeypatch, capsys):
    from dlperf.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(name, value)
    rc = main(["train", "--nproc-per-node", "2", "--epochs", "1", "--train-size", "64", "--test-size", "32",
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.strip().count("\n") == 0 and f"{name}='{value}'" in err


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_train_with_auto_prints_the_process_choice_once(tmp_path):
    done = _train(tmp_path, {}, "--algorithm", "auto")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("process allreduce: ")]
    assert len(lines) == 2, done.stdout
    assert lines[0].startswith("process allreduce: shm: ") and "; gloo: " in lines[0] and " -> " in lines[0]
    assert lines[1].startswith("process allreduce: measured now")

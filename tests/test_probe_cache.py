"""Hostile probe caches: every figure checked against what a machine can show, every string escaped,
and `dlperf probe` never names a cache file it did not write."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlperf.cli import main
from dlperf.probe import cache as probe_cache
from dlperf.probe import hardware
from dlperf.probe.reference import GBPS, GFLOPS, NS, PLAUSIBLE, SEED, implausible

ROOT = Path(__file__).resolve().parents[1]


def _result(value=3.0) -> hardware.ProbeResult:
    rows = [hardware.ProbeRow("l1", "L1", value, NS, 1.5, SEED["l1"].source, "note"),
            hardware.ProbeRow("stream_triad_1t", "STREAM triad", 12.0, GBPS, 40.0, "src", ""),
            hardware.ProbeRow("mm_float32_1t", "torch.mm float32", 50.0, GFLOPS, 16.0, "src", ""),
            hardware.ProbeRow("x", "unavailable row", None, GBPS, 40.0, "src", "why")]
    return hardware.ProbeResult(machine=hardware.machine(), quick=True, created=time.time(), rows=rows)


def _craft(tmp_path, monkeypatch, row: int, field: str, literal: str) -> str:
    """This machine's cache with rows[row][field] replaced by the JSON text ``literal``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = probe_cache.save_probe(_result())
    doc = json.loads(Path(path).read_text())
    doc["rows"][row][field] = "@@"
    Path(path).write_text(json.dumps(doc).replace('"@@"', literal))
    return path


@pytest.mark.parametrize("row, field, literal", [
    (0, "value", "0"), (0, "value", "-0.9"), (0, "value", "1e308"), (0, "value", "5e-324"), (0, "value", "NaN"),
    (0, "value", "Infinity"), (0, "seed", "0"), (0, "seed", "-1.5"), (1, "value", "1e308"), (1, "value", "0"),
    (2, "value", "5e-324"), (2, "seed", "1e300"), (3, "seed", "0"), (0, "value", "true"),
])
def test_a_figure_no_machine_shows_is_reported_and_measured_again(tmp_path, monkeypatch, capsys, row, field,
                                                                   literal):
    path = _craft(tmp_path, monkeypatch, row, field, literal)
    # NaN and Infinity are not JSON numbers: the decoder names them; every other value is named by its field
    named = f"{literal} is not a number" if literal in ("NaN", "Infinity") else f"rows[{row}].{field} is "
    with pytest.raises(probe_cache.ProbeCacheError) as info:
        probe_cache.read_probe(path)
    assert str(info.value).startswith(f"probe cache {path}: ") and named in str(info.value)
    assert probe_cache.load_probe() is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "measuring again" in err and named in err


def test_bounds_hold_every_real_seed_figure():
    for key, figure in SEED.items():
        assert implausible(figure.value, figure.unit) is None, key
    for unit, (lo, hi) in PLAUSIBLE.items():
        assert implausible(lo, unit) is None and implausible(hi, unit) is None
        assert implausible(lo / 10, unit) and implausible(hi * 10, unit) and implausible(0, unit)


def test_bench_explain_falls_back_instead_of_dividing_by_a_zero_figure(tmp_path, monkeypatch, capsys):
    from dlperf.bench import explain

    _craft(tmp_path, monkeypatch, 2, "value", "0")  # the torch.mm row bench --explain prices FLOP/s with
    monkeypatch.setattr(probe_cache, "_refusals_told", set())
    assert explain._probe_hardware(1) is None  # no cache: the caller estimates instead
    assert explain._probe_hardware(2) is None
    told = capsys.readouterr().err.strip().splitlines()
    assert len(told) == 1 and "measuring again" in told[0], told  # said once, not per thread count


def test_escape_sequences_from_a_cache_never_reach_the_terminal(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    result = _result()
    result.rows[0].what = "\x1b]0;owned\x07L1\nforged row 1.0 ns"
    result.rows[0].note = "\x1b[31mred"
    probe_cache.save_probe(result)
    assert main(["probe", "--cached"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b]0;owned\\x07L1\\nforged row 1.0 ns" in out and "\\x1b[31mred" in out


def _fake_run_probe(**_kwargs):
    return _result()


def test_a_full_cache_disk_warns_and_names_no_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(hardware, "run_probe", _fake_run_probe)

    def full(*_args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    assert main(["probe", "--quick"]) == 0
    captured = capsys.readouterr()
    path = probe_cache.cache_path()
    assert not os.path.exists(path)
    assert captured.err.count("\n") == 1
    assert f"warning: cannot write {path}: no space left on the device for" in captured.err
    assert "the figures were not saved" in captured.err
    assert path not in captured.out and "figures from" not in captured.out


def test_a_saved_probe_names_its_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(hardware, "run_probe", _fake_run_probe)
    assert main(["probe", "--quick"]) == 0
    path = probe_cache.cache_path()
    assert os.path.isfile(path) and path in capsys.readouterr().out.replace("\n", "")


def test_a_cache_file_others_can_write_is_not_used(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = probe_cache.save_probe(_result())
    os.chmod(path, 0o666)
    assert probe_cache.load_probe() is None
    assert "only it can write" in capsys.readouterr().err


# --- --json to the process's own streams, devices and FIFOs ---------------------------------------------
def _env(tmp_path) -> dict[str, str]:
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path),
            "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.subprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", ["/dev/stdout", "-", "LOG"])
def test_probe_json_to_stdout_appended_to_a_log_keeps_the_log(tmp_path, monkeypatch, target):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    probe_cache.save_probe(_result(value=7.5))
    log = tmp_path / "log"
    log.write_text("OLD\n")
    with open(log, "a") as out:
        done = subprocess.run([sys.executable, "-m", "dlperf.cli", "probe", "--cached", "--json",
                               str(log) if target == "LOG" else target], stdout=out, stderr=subprocess.PIPE,
                              env=_env(tmp_path), timeout=100, check=False)
    assert done.returncode == 0, done.stderr
    text = log.read_text()
    assert text.startswith("OLD\n") and "7.5 ns" in text
    assert json.loads(text.strip().splitlines()[-1])["rows"][0]["value"] == 7.5


def test_probe_json_to_dev_full_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    saved = probe_cache.read_probe(probe_cache.save_probe(_result()))
    assert main(["probe", "--cached", "--json", "/dev/full"]) == 2
    err = capsys.readouterr().err
    size = len(json.dumps(saved.to_dict(), allow_nan=False)) + 1
    assert err == (f"dlperf probe: error: cannot write /dev/full: no space left on the device for {size} bytes; "
                   "free some space or write elsewhere\n")


def test_probe_json_to_a_fifo_without_reader_is_refused_in_bounded_time(tmp_path, monkeypatch, capsys):
    import dlperf._io

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(dlperf._io, "FIFO_READER_WAIT_S", 0.2)
    probe_cache.save_probe(_result())
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert main(["probe", "--cached", "--json", str(fifo)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write {fifo}: no process opened this FIFO for reading" in err


def test_a_cache_saved_under_a_group_umask_reads_back(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    old = os.umask(0o002)
    try:
        path = probe_cache.save_probe(_result())
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert probe_cache.load_probe() is not None


def test_format_true_is_not_format_1(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = probe_cache.save_probe(_result())
    doc = json.loads(Path(path).read_text())
    doc["format"] = True  # equal to 1 in Python, but not what dlperf probe writes
    Path(path).write_text(json.dumps(doc))
    with pytest.raises(probe_cache.ProbeCacheError, match="not a format-1 probe document"):
        probe_cache.read_probe(path)


@pytest.mark.parametrize("what", ["char-device", "fifo", "link"])
def test_saving_never_replaces_what_dlperf_did_not_write(tmp_path, what):
    import stat

    path = tmp_path / "probe.json"
    if what == "fifo":
        os.mkfifo(path)
    elif what == "link":
        (tmp_path / "victim").write_text("the user's")
        path.symlink_to(tmp_path / "victim")
    elif os.geteuid() != 0:
        pytest.skip("a device node needs root to make")
    else:
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except OSError:
            pytest.skip("cannot create a device node here")
    before = os.lstat(path)
    with pytest.raises(OSError, match="not a cache file dlperf wrote, and is left as it is"):
        probe_cache.save_probe(_result(), str(path))
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert what != "link" or (tmp_path / "victim").read_text() == "the user's"

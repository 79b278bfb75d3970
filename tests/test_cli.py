from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dlperf.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_devices_json_lists_the_cpu(capsys):
    assert main(["devices", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    cpu = doc["devices"][0]
    assert cpu["kind"] == "cpu" and cpu["cores"] >= 1 and cpu["memory_total_bytes"] > 0


def test_devices_table(capsys):
    assert main(["devices"]) == 0
    assert "cpu" in capsys.readouterr().out


@pytest.mark.subprocess
def test_console_entry_point_runs_without_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "dlperf.cli", "bench", "--networks", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


@pytest.mark.subprocess
def test_importing_dlperf_does_not_load_torch_until_a_device_name_is_used():
    code = ("import sys, dlperf; assert 'torch' not in sys.modules; "
            "assert dlperf.cpu(1).index == 1 and 'torch' in sys.modules; print(sorted(dlperf.__all__) == "
            "sorted(n for n in dlperf.__all__ if hasattr(dlperf, n)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


@pytest.mark.subprocess
def test_ctrl_c_while_torch_loads_is_one_line_and_exit_130():
    import os
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "dlperf.cli", "devices"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # wait until torch's shared library is mapped: the import of torch is under way, in the verbs'
        # import (or, on a fast machine, the verb itself runs); either way Ctrl-C must be one line
        maps = f"/proc/{proc.pid}/maps"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with open(maps) as f:
                    if "libtorch" in f.read():
                        break
            except OSError:
                break
            time.sleep(0.005)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode == 0:  # it finished before the signal could land: nothing to check
        return
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().count("\n") == 0, err


def test_ci_runs_the_test_command_written_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", readme, flags=re.S)
    commands = [line.strip() for b in blocks for line in b.splitlines() if "pytest" in line]
    assert commands, "README.md must give the test command"
    assert commands[0] in (ROOT / ".ci" / "run").read_text()


TIER_MARKS = ("slow", "distributed", "subprocess")


def _tiers() -> dict[str, str]:
    """The marker expression of each tier: the default run's from pyproject.toml, the process tier's from .ci/run."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    fast = re.search(r"^addopts = .*-m '([^']+)'", pyproject, flags=re.M)
    process = re.search(r'pytest -m "([^"]+)"', (ROOT / ".ci" / "run").read_text())
    assert fast and process, "pyproject.toml's addopts and .ci/run each select their tier with -m"
    return {"fast": fast[1], "process": process[1], "slow": "slow"}


def test_the_tiers_take_every_test_exactly_once_and_ci_leaves_out_only_the_slow_one():
    tiers = _tiers()
    for names in (set(re.findall(r"\w+", e)) - {"and", "or", "not"} for e in tiers.values()):
        assert names <= set(TIER_MARKS)
    for marks in itertools.product([False, True], repeat=len(TIER_MARKS)):
        where = dict(zip(TIER_MARKS, marks))
        chosen = [tier for tier, expression in tiers.items() if eval(expression, {}, where)]
        assert len(chosen) == 1, (where, chosen)
        assert (chosen == ["slow"]) == where["slow"]


FAKE_TOOL = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$CI_CALLS"
[[ "$*" == "$CI_FAIL" ]] && exit 1
exit 0
"""
FAKE_PYTHON3 = """#!/usr/bin/env bash
# python3 -m venv .venv: a virtual environment of fake tools
mkdir -p .venv/bin
for tool in pip python ruff mypy; do cp "$CI_FAKE_TOOL" .venv/bin/$tool; chmod +x .venv/bin/$tool; done
"""


CI_STEPS = {"fast tier": "-m pytest", "process tier": "-m pytest -m {process}", "ruff": "check src tests benchmarks",
            "mypy": "src/dlperf"}


@pytest.mark.parametrize("failing", [None, *CI_STEPS])
def test_ci_runs_every_step_and_fails_when_any_step_fails(tmp_path, failing):
    """.ci/run with fake tools, one step failing: every step still runs (the process tier's failures are worth
    seeing when the fast tier failed too), and the script fails."""
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "bin").mkdir()
    (tmp_path / "tool").write_text(FAKE_TOOL)
    (tmp_path / "bin" / "python3").write_text(FAKE_PYTHON3)
    (tmp_path / "bin" / "python3").chmod(0o755)
    calls = tmp_path / "calls"
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "CI_CALLS": str(calls),
           "CI_FAKE_TOOL": str(tmp_path / "tool"),
           "CI_FAIL": CI_STEPS[failing].format(process=_tiers()["process"]) if failing else "-"}
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode != 0) == (failing is not None), done.stderr
    ran = calls.read_text().splitlines()
    assert ran[0].startswith("pip install") and ran[1] == "python -m pytest", ran
    assert ran[2] == f"python -m pytest -m {_tiers()['process']}", ran
    assert [r.split()[0] for r in ran[3:]] == ["ruff", "mypy"], ran


def test_validated_numbers_take_their_range_and_nothing_else():
    import argparse

    import pytest

    from dlperf.cli import options as va

    seeds = va.int_in(0, 2**32 - 1, "--seed")
    assert [seeds(t) for t in ("0", " 7 ", "+3", str(2**32 - 1))] == [0, 7, 3, 2**32 - 1]
    for bad in ("-1", str(2**32), "1.0", "1e3", "0x10", "", "1_000", "٣", "9" * 5000, "+-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="give --seed a whole number from 0 to 4294967295"):
            seeds(bad)
    lr = va.positive_float("--lr", max_value=100)
    assert lr("1e-3") == 1e-3 and lr("100") == 100
    for bad in ("0", "-1", "nan", "inf", "-inf", "1e300", "1e-400", "100.5", "x", "9" * 100):
        with pytest.raises(argparse.ArgumentTypeError, match=r"^'.*' is (not a (finite )?number|out of range)"):
            lr(bad)
    names = va.csv_list("--networks", ["a", "b"])
    assert names("a, B") == ["a", "B"]
    for bad in (",", "a,", ",a", "a,,b", "", " ", "a,a", "c"):
        with pytest.raises(argparse.ArgumentTypeError):
            names(bad)
    assert va.one_line("a\nb\r\x00c") == "a\\nb\\r\\x00c"


def test_batch_bytes_counts_every_layer_output_for_training_and_the_largest_for_inference():
    import torch
    from torch import nn

    from dlperf import _cliargs as va
    from dlperf.models.spec import InputSpec, ModelSpec

    spec = ModelSpec("toy", lambda: nn.Sequential(nn.Linear(4, 30), nn.ReLU(), nn.Linear(30, 2)),
                     InputSpec((4,), 2), 1, 1, "toy")
    # input 4 floats; outputs 30 (linear), 30 (relu), 2 (linear)
    assert va.batch_bytes(spec, 10, training=True) == 10 * 4 * (4 + 30 + 30 + 2)
    assert va.batch_bytes(spec, 10, training=False) == 10 * 4 * (4 + 30)
    inplace = ModelSpec("toy2", lambda: nn.Sequential(nn.Linear(4, 30), nn.ReLU(inplace=True)),
                        InputSpec((4,), 2), 1, 1, "toy")
    assert va.batch_bytes(inplace, 1, training=True) == 4 * (4 + 30)
    assert torch.empty(0).device.type == "cpu"  # the meta device did not become the default

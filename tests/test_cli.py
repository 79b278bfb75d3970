from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

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


def test_console_entry_point_runs_without_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "dlperf.cli", "bench", "--networks", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


def test_ci_runs_the_test_command_written_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", readme, flags=re.S)
    commands = [line.strip() for b in blocks for line in b.splitlines() if "pytest" in line]
    assert commands, "README.md must give the test command"
    assert commands[0] in (ROOT / ".ci" / "run").read_text()

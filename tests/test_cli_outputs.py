"""Every verb's output path through the one writer: `--json /dev/stdout >> log` keeps the log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

VERBS = {
    "bench": ["bench", "--networks", "mlp", "--devices", "cpu", "--threads", "1", "--steps", "1", "--warmup", "1"],
    "profile": ["profile", "dlperf.models.lenet:lenet", "--input", "2x1x28x28", "--steps", "1", "--no-suggest",
                "--hardware", "seed:cpu-4core"],
}


def _run_appending(tmp_path: Path, argv: list[str], log: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "a") as out:  # `>> log`
        return subprocess.run([sys.executable, "-m", "dlperf.cli", *argv], stdout=out, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=300, check=False)


@pytest.mark.subprocess
@pytest.mark.timeout(320)
@pytest.mark.parametrize("verb", sorted(VERBS))
@pytest.mark.parametrize("target", ["/dev/stdout", "LOG"])
def test_json_to_the_file_stdout_appends_to_keeps_what_it_held(tmp_path, verb, target):
    log = tmp_path / "log"
    log.write_text("OLD\n")
    done = _run_appending(tmp_path, [*VERBS[verb], "--json", str(log) if target == "LOG" else target], log)
    assert done.returncode == 0, done.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == "OLD" and len(lines) > 2  # the report, then the document
    json.loads(lines[-1] if verb == "bench" else "\n".join(lines[lines.index("{"):]))

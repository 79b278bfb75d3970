"""Host memory kept in the process between steps (dlperf._hostmem): page faults counted, not timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dlperf._hostmem import HOST_MALLOC_ENV, is_glibc, keep_freed_host_memory
from dlperf.errors import UsageError

# Three 16 MB blocks live at once, then all freed, as a training step's activations are. Both
# processes start glibc at its initial threshold (128 KiB, pinned so that the control does not
# depend on what importing torch happened to free): there every block is a fresh mmap, faulted in
# at every step; the tuned process must reuse them instead.
_SIZES_MB = (16, 16, 16)
_PROBE = r"""
import json, resource, sys
from dlperf._hostmem import keep_freed_host_memory
applied = keep_freed_host_memory()
import torch
def step():
    blocks = [torch.empty(mb << 18).fill_(1.0) for mb in SIZES_MB]
    del blocks
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20
print(json.dumps({"applied": applied, "faults_per_step": faults}))
"""

glibc = pytest.mark.skipif(not is_glibc(), reason="the tuning applies to glibc's malloc only")


def _probe(setting: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != HOST_MALLOC_ENV and not k.startswith("MALLOC_")}
    env["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)
    if setting is not None:
        env[HOST_MALLOC_ENV] = setting
    code = _PROBE.replace("SIZES_MB", repr(_SIZES_MB))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
@glibc
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    kept = _probe(None)
    system = _probe("system")
    assert kept["applied"] and not system["applied"]
    pages = sum(_SIZES_MB) * (1 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert system["faults_per_step"] > pages / 2, system  # the C library's defaults: faulted in every step
    # (the odd trim of the heap top is allowed, and the pages the kernel reclaims from an idle heap under
    # memory pressure come back as faults: against the default's, not against none)
    assert kept["faults_per_step"] < min(pages / 5, system["faults_per_step"] / 5), (kept, system)


def test_a_bad_setting_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(HOST_MALLOC_ENV, "jemalloc")
    with pytest.raises(UsageError, match=f"{HOST_MALLOC_ENV}='jemalloc' is not valid; expected 'keep'"):
        keep_freed_host_memory()


def test_the_cli_reports_a_bad_setting_in_one_line(monkeypatch, capsys):
    from dlperf.cli import main

    monkeypatch.setenv(HOST_MALLOC_ENV, "nope")
    assert main(["devices"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and HOST_MALLOC_ENV in err

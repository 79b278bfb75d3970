"""The plan cache's two sections of decisions, ``plans`` and ``with_processes``, answer through one lookup: each
from its own section only, and a bad entry in one leaves the other usable."""

from __future__ import annotations

import json
import os

from dlperf.parallel.planning.plan import Plan
from dlperf.parallel.planning.plan_cache import (
    cached_plan,
    default_cache_path,
    processes_offer,
    save_plan,
    save_processes_offer,
)


def test_each_lookup_answers_from_its_own_section():
    in_process = Plan(replicas=1, threads=2).with_figures(5.0, [("2 x 1", 6.0)])
    with_processes = Plan(replicas=2, threads=1, launcher="processes").with_figures(3.0, [("1 x 2", 4.0)])
    save_plan("same-key", in_process)
    assert processes_offer("same-key") is None
    save_processes_offer("same-key", with_processes)
    assert cached_plan("same-key") == in_process and cached_plan("same-key").measured_ms == 5.0
    assert processes_offer("same-key") == with_processes and processes_offer("same-key").measured_ms == 3.0
    assert cached_plan("other") is None and processes_offer("other") is None


def test_a_bad_entry_in_one_section_leaves_the_other_usable(capsys):
    save_plan("k", Plan(replicas=1, threads=2).with_figures(5.0, []))
    path = default_cache_path()
    with open(path) as f:
        doc = json.load(f)
    doc["with_processes"] = {"k": {"plan": "os.system", "measured_ms": 1.0, "alternatives": [], "saved": 1.0}}
    with open(path, "w") as f:
        json.dump(doc, f)
    os.chmod(path, 0o600)
    assert processes_offer("k") is None
    err = capsys.readouterr().err
    assert "ignoring plan cache" in err and err.count("\n") == 1
    assert cached_plan("k") == Plan(replicas=1, threads=2)
    assert capsys.readouterr().err == ""

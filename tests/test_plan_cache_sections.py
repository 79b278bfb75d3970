"""The plan cache's two sections of decisions, ``plans`` and ``with_processes``, answer through one lookup: each
from its own section only, and a bad entry in one leaves the other usable."""

from __future__ import annotations

import json
import os
import stat

import pytest

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


# --- a path that is not the cache's file: read as nothing, never written -----------------------------------------
IS_ROOT = os.geteuid() == 0


def _char_device(path):
    """A private copy of /dev/null: a writer that replaced it could only break the copy."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        with open(path, "wb"):
            pass
    except OSError:
        return False
    return True


def _foreign(kind: str, tmp_path):
    """(the cache path, a check that it is as it was) for a path holding something that is not dlperf's."""
    path = tmp_path / f"cache-{kind}"
    if kind == "fifo":
        os.mkfifo(path)
        return path, lambda: stat.S_ISFIFO(os.lstat(path).st_mode)
    if kind == "link":
        victim = tmp_path / "victim"
        victim.write_text("the user's")
        path.symlink_to(victim)
        return path, lambda: os.readlink(path) == str(victim) and victim.read_text() == "the user's"
    if kind == "notes":
        path.write_text("my notes\n")
        os.chmod(path, 0o600)
        return path, lambda: path.read_text() == "my notes\n"
    if not IS_ROOT:
        pytest.skip("a device node or a file of another user needs root to make")
    if kind == "char-device":
        if not _char_device(path):
            pytest.skip("cannot create a device node here (nodev mount)")
        return path, lambda: stat.S_ISCHR(os.lstat(path).st_mode)
    save_plan("theirs", Plan(replicas=1, threads=1).with_figures(5.0, []), str(path))  # another user's own cache
    os.chown(path, 54321, 54321)
    before = path.read_bytes()
    return path, lambda: path.read_bytes() == before and path.stat().st_uid == 54321


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["char-device", "fifo", "link", "notes", "other-user"])
def test_a_cache_path_holding_what_dlperf_did_not_write_is_left_alone_with_one_line(kind, tmp_path, capsys,
                                                                                   monkeypatch):
    path, unharmed = _foreign(kind, tmp_path)
    monkeypatch.setenv("DLPERF_PLAN_CACHE", str(path))
    assert cached_plan("k") is None
    save_plan("k", Plan(replicas=1, threads=2).with_figures(5.0, []))
    save_processes_offer("k", Plan(replicas=2, threads=1, launcher="processes").with_figures(3.0, []))
    assert cached_plan("k") is None  # nothing was written: the run goes on without a cache
    assert unharmed()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "it is left as it is" in err[0] and str(path) in err[0], err
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def _saved_entry(**changes):
    save_plan("k", Plan(replicas=1, threads=2).with_figures(5.0, [("2 x 1", 6.0)]))
    path = default_cache_path()
    with open(path) as f:
        doc = json.load(f)
    for where, value in changes.items():
        if where == "format":
            doc["format"] = value
        else:
            doc["plans"]["k"][where] = value
    with open(path, "w") as f:
        json.dump(doc, f)
    os.chmod(path, 0o600)


@pytest.mark.parametrize("changes, named", [
    ({"format": True}, "not a format-1 plan cache"),
    ({"measured_ms": 5e-324}, "measured_ms is 4.94066e-324 ms, outside what any machine shows"),
    ({"measured_ms": 0}, "measured_ms is 0 ms, outside"),
    ({"alternatives": [["2 x 1", 5e-324]]}, "alternatives are not"),
    ({"alternatives": [["2 x 1", 1e300]]}, "alternatives are not"),
])
def test_figures_no_machine_shows_are_not_read_as_measured(changes, named, capsys):
    _saved_entry(**changes)
    assert cached_plan("k") is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err


def test_names_from_the_cache_are_printed_with_control_characters_escaped():
    _saved_entry(alternatives=[["\x1b[2J\nplan: forged", 6.0]])
    line = cached_plan("k").line()
    assert "\x1b" not in line and "\n" not in line and "\\x1b[2J\\nplan: forged: 6.0" in line

"""Decisions of the planner, kept per (model, batch, devices, machine, torch version) so a run starts at once.

The cache is one small JSON file beside the probe's, ``$XDG_CACHE_HOME/dlperf/plans.json``, read the way
the probe cache is (:func:`~dlperf.probe.cache.read_cache_file`: a regular file of this user that nobody
else can write, bounded in size) and parsed field by field. A file that fails any check is ignored with
one line on stderr and the plan is measured again; writes replace it atomically.

Beside the decisions (``plans``) the file keeps two sections a decision does not answer by itself:
``setups``, the slowest one-off setup an execution was measured to cost for a model here within
:data:`SETUP_RECORD_MAX_AGE_S` (a cold first compile, which the next search weighs instead of a guess; a compile
served warm from inductor's disk cache does not lower it: :func:`save_setup`), and ``with_processes``, the last
decision made for a model when plans whose replicas are processes could be measured (a Trainer that plans in
one process names it when it is faster: :func:`processes_offer`). Both are keyed by the model's signature, the
batch's, the machine and torch (and what the caller adds to :func:`model_key`). A reader without them (an
older dlperf) ignores them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..._buildcache import CacheUnsafe, cache_base, private_dir
from ..._cliargs import one_line
from ..._io import foreign_file, write_cache_file
from ...batch import tensors_of
from ...devices import Device
from ...errors import UsageError
from ...probe.cache import ProbeCacheError, decode_json, machine_key, read_cache_file
from ...probe.reference import MS, implausible
from .plan import Plan

__all__ = ["plan_key", "model_key", "cached_plan", "cached_time", "cached_decisions", "clear_cache", "save_plan",
           "recorded_setup_s", "setup_record", "save_setup", "processes_offer", "save_processes_offer",
           "default_cache_path", "MAX_ENTRIES", "MAX_BYTES", "SETUP_RECORD_MAX_AGE_S"]

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
MAX_ENTRIES = 256
MAX_BYTES = 512 * 1024
_KEY_HEX = 32
_MAX_ALTERNATIVES = 16
_MAX_SETUP_S = 1e5
SETUP_RECORD_MAX_AGE_S = 7 * 24 * 3600.0
"""A recorded setup older than this is replaced by the next one measured, however small, and is not trusted to
keep an execution out of a search (the guess decides instead): one loaded or stale compile must not switch
compile off for a model for good."""
_SECTIONS = ("plans", "setups", "with_processes")
_told: set[str] = set()


def default_cache_path() -> str:
    """``$DLPERF_PLAN_CACHE`` when set (a file in an existing directory: a separate cache for a job or a test
    run, without moving the build caches that ``XDG_CACHE_HOME`` also moves), else beside the probe's."""
    return os.environ.get("DLPERF_PLAN_CACHE") or os.path.join(cache_base(), "dlperf", "plans.json")


def _tensor_sig(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def plan_key(model: nn.Module, batch: Any, devices: Sequence[Device], extra: str = "") -> str:
    """A digest of what a decision depends on: the model's layers and parameter shapes, the batch's
    dtypes and shapes, the devices, the machine (its probe key: host, CPU, cores, memory) and torch."""
    layers = [type(m).__qualname__ for m in model.modules()]
    params = [f"{n}:{_tensor_sig(p)}" for n, p in model.named_parameters()]
    ident = {"layers": layers, "params": params, "batch": [_tensor_sig(t) for t in tensors_of(batch)],
             "devices": [str(d) for d in devices], "machine": machine_key(), "torch": torch.__version__,
             "extra": extra}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:_KEY_HEX]


def model_key(model: nn.Module, batch: Any, what: str) -> str:
    """A digest of the model's and batch's signatures, the machine and torch, for ``what`` is recorded of them
    (a setup, a decision with processes allowed), which names any devices or options that record depends on."""
    return plan_key(model, batch, (), f"model:{what}")


def _fail(path: str, problem: str) -> ProbeCacheError:
    return ProbeCacheError(f"plan cache {path}: {problem}")


def _ignore(exc: Exception, leave: bool = False) -> None:
    """One line, once a process: the cache (or an entry) is not used. ``leave``: the file is not dlperf's to
    replace, so it is kept as it is and nothing is written there."""
    fix = ("it is left as it is; point DLPERF_PLAN_CACHE at a file of your own" if leave
           else "delete the file to stop this note")
    message = one_line(f"dlperf plan: ignoring {exc}; planning again ({fix})")
    if message not in _told:  # once a process: every Trainer of a script would repeat it
        _told.add(message)
        log.warning(message)


def _read_sections(path: str) -> tuple[dict[str, dict[str, Any]], bool]:
    """The file's sections (``plans`` and the optional others, each {key: entry}), or empty ones when it is
    missing or unusable (said in one line); and whether the file may be written: it is missing, a plan cache,
    or a damaged file of this user in dlperf's own cache directory. A path holding anything else (a device, a
    FIFO, a link, another user's file, a file of other content) is left as it is."""
    empty: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    try:
        problem = foreign_file(os.lstat(path))
    except FileNotFoundError:
        return empty, True
    except OSError as exc:
        _ignore(_fail(path, f"cannot be read ({exc.strerror or exc})"), leave=True)
        return empty, False
    if problem is not None:
        _ignore(_fail(path, problem), leave=True)
        return empty, False
    ours = os.path.dirname(os.path.abspath(path)) == os.path.join(cache_base(), "dlperf")
    try:
        doc = decode_json(read_cache_file(path, _fail, max_bytes=MAX_BYTES), path, _fail)
        if not isinstance(doc, dict) or not _is_format(doc.get("format")) or not isinstance(doc.get("plans"), dict):
            raise _fail(path, f"not a format-{CACHE_FORMAT} plan cache")
        ours = True  # a plan cache, even where one of its entries is unusable
        sections = {name: doc.get(name, {}) for name in _SECTIONS}
        for name, entries in sections.items():
            if not isinstance(entries, dict):
                raise _fail(path, f"{name!r} is not an object")
            if len(entries) > MAX_ENTRIES:
                raise _fail(path, f"more than {MAX_ENTRIES} entries in {name!r}")
        return sections, True
    except FileNotFoundError:
        return empty, True
    except (ProbeCacheError, OSError) as exc:
        _ignore(exc, leave=not ours)
        return empty, ours


def _is_format(value: object) -> bool:
    # true == 1 in Python: a file saying "format": true is not a format-1 file
    return type(value) is int and value == CACHE_FORMAT


_REQUIRED = {"plan", "measured_ms", "alternatives", "saved"}
_OPTIONAL = {"contended", "label", "planning_s"}


def _entry_plan(entry: object, path: str) -> Plan:
    if not isinstance(entry, dict) or not _REQUIRED <= set(entry) <= _REQUIRED | _OPTIONAL:
        raise _fail(path, "an entry is not {plan, measured_ms, alternatives, saved} (with contended, label, "
                          "planning_s)")
    if not isinstance(entry.get("contended", False), bool) or not isinstance(entry.get("label", ""), str):
        raise _fail(path, "an entry's contended is not true or false, or its label not text")
    ms, alts = entry["measured_ms"], entry["alternatives"]
    # step times are checked as the probe's figures are: what no machine shows (0, 5e-324) is no measurement
    problem = None if ms is None else implausible(ms, MS)
    if problem is not None:
        raise _fail(path, f"measured_ms is {problem}")
    if not isinstance(alts, list) or len(alts) > _MAX_ALTERNATIVES or not all(
            isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) and len(a[0]) <= 200
            and implausible(a[1], MS) is None for a in alts):
        raise _fail(path, f"alternatives are not [[name, ms], ...] of at most {_MAX_ALTERNATIVES} names of at most "
                          "200 characters and step times in ms")
    try:
        plan = Plan.from_dict(entry["plan"], "its plan")
    except (UsageError, TypeError) as exc:
        raise _fail(path, str(exc)) from None
    # the names are printed on the plan's line: control characters are shown escaped, never sent to the terminal
    return plan.with_figures(float(ms) if ms is not None else None, [(one_line(a[0]), float(a[1])) for a in alts],
                             ("measured earlier on this machine; cached",))


def _section_plan(section: str, key: str, path: str | None) -> Plan | None:
    """The plan kept under ``key`` in ``section`` (``plans`` or ``with_processes``), or None (also when the file
    or the entry cannot be trusted: said once)."""
    path = path or default_cache_path()
    entry = _read_sections(path)[0][section].get(key)
    if entry is None:
        return None
    try:
        return _entry_plan(entry, path)
    except ProbeCacheError as exc:
        _ignore(exc)
        return None


def cached_plan(key: str, path: str | None = None) -> Plan | None:
    """The plan decided for ``key`` before, or None: also when the file cannot be trusted (said once), when the
    decision was made on contended rounds (measured again instead of reused), and when it is older than this
    machine's saved probe (the machine's figures changed since: stale)."""
    path = path or default_cache_path()
    entry = _read_sections(path)[0]["plans"].get(key)
    if not isinstance(entry, dict) or entry.get("contended") is True or _saved(entry) < _probe_time():
        return None
    return _section_plan("plans", key, path)


def cached_time(key: str, path: str | None = None) -> float | None:
    """When the decision cached for ``key`` was measured (``time.time()``), or None."""
    entry = _read_sections(path or default_cache_path())[0]["plans"].get(key)
    return _saved(entry) or None if entry is not None else None


def _probe_time() -> float:
    """When this machine's probe figures were saved (0 without any): decisions older than them are stale."""
    from ...probe.cache import cache_path

    try:
        return os.stat(cache_path()).st_mtime
    except (OSError, ValueError):
        return 0.0


def cached_decisions(path: str | None = None) -> list[dict[str, Any]]:
    """Every decision in the cache, newest first, as ``dlperf plans`` lists them: key, label, plan, ms per step,
    when, contended, and whether a run would use it (not contended, not stale)."""
    path = path or default_cache_path()
    out = []
    probe = _probe_time()
    for key, entry in _read_sections(path)[0]["plans"].items():
        try:
            plan = _entry_plan(entry, path)
        except ProbeCacheError:
            continue
        contended = entry.get("contended") is True
        out.append({"key": key, "label": one_line(str(entry.get("label", ""))), "plan": plan.name,
                    "measured_ms": plan.measured_ms, "saved": _saved(entry), "contended": contended,
                    "planning_s": entry.get("planning_s"), "used": not contended and _saved(entry) >= probe})
    return sorted(out, key=lambda e: -e["saved"])


def clear_cache(path: str | None = None) -> int:
    """Remove every decision (and recorded setup) from the cache; how many decisions there were. A path that is
    not a plan cache is left as it is (said once)."""
    path = path or default_cache_path()
    sections, writable = _read_sections(path)
    count = len(sections["plans"])
    if writable and os.path.exists(path):
        os.unlink(path)
    return count


def _saved(entry: object) -> float:
    value = entry.get("saved") if isinstance(entry, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _record(section: str, key: str, entry: dict[str, Any], path: str | None) -> None:
    """Put ``entry`` under ``key`` in ``section`` (the oldest go beyond :data:`MAX_ENTRIES`, a quarter of that for
    ``with_processes``, so that full sections stay well inside :data:`MAX_BYTES`) and write the file again. A
    cache that cannot be written costs the next run its planning time, not this run: said in one line."""
    path = path or default_cache_path()
    sections, writable = _read_sections(path)
    if not writable:  # not dlperf's file: said once when it was read
        return
    entries = sections[section]
    entries[key] = {**entry, "saved": time.time()}
    limit = MAX_ENTRIES // 4 if section == "with_processes" else MAX_ENTRIES
    if len(entries) > limit:
        oldest = sorted(entries, key=lambda k: _saved(entries[k]))
        for k in oldest[: len(entries) - limit]:
            del entries[k]
    doc = {"format": CACHE_FORMAT, **{name: sections[name] for name in _SECTIONS if sections[name] or name == "plans"}}
    data = (json.dumps(doc, allow_nan=False) + "\n").encode()
    try:
        if path == os.path.join(cache_base(), "dlperf", "plans.json"):
            private_dir(cache_base(), ["dlperf"])
        write_cache_file(path, data)
    except (OSError, ValueError, CacheUnsafe) as exc:
        log.warning("dlperf plan: the plan cache %s cannot be written (%s); the next run plans again", path, exc)


def save_plan(key: str, plan: Plan, path: str | None = None, *, contended: bool = False, label: str = "",
              planning_s: float | None = None) -> None:
    """Record ``plan`` for ``key`` (see :func:`_record`); a ``contended`` decision is kept for ``dlperf plans`` to
    list but never reused (:func:`cached_plan`)."""
    extra: dict[str, Any] = {"contended": bool(contended), "label": label[:200]}
    if planning_s is not None and 0 <= planning_s < 1e6:
        extra["planning_s"] = round(float(planning_s), 3)
    _record("plans", key, {**_plan_entry(plan), **extra}, path)


def _plan_entry(plan: Plan) -> dict[str, Any]:
    return {"plan": plan.to_dict(), "measured_ms": plan.measured_ms,
            "alternatives": [list(a) for a in plan.alternatives[:_MAX_ALTERNATIVES]]}


def setup_record(key: str, path: str | None = None) -> tuple[float, float] | None:
    """(seconds, saved): the one-off setup recorded for ``key`` (:func:`model_key` of a model and an execution)
    and when it was measured (``time.time()``), or None (also when the entry cannot be trusted: said once)."""
    path = path or default_cache_path()
    entry = _read_sections(path)[0]["setups"].get(key)
    if entry is None:
        return None
    seconds = entry.get("seconds") if isinstance(entry, dict) and set(entry) == {"seconds", "saved"} else None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < _MAX_SETUP_S:
        _ignore(_fail(path, f"setup {key[:16]}: {str(entry)[:60]!r} is not {{seconds, saved}} with seconds in "
                            f"[0, {_MAX_SETUP_S:g})"))
        return None
    return float(seconds), _saved(entry)


def recorded_setup_s(key: str, path: str | None = None) -> float | None:
    """The seconds of one-off setup recorded for ``key`` (see :func:`setup_record`), or None."""
    record = setup_record(key, path)
    return record[0] if record is not None else None


def save_setup(key: str, seconds: float, path: str | None = None) -> None:
    """Record that an execution's one-off setup took ``seconds`` for ``key``, unless a larger setup measured
    within :data:`SETUP_RECORD_MAX_AGE_S` is recorded: the cold compile is what a search must fit in its budget,
    and a compile served warm from inductor's disk cache (seconds instead of minutes) is no prediction of the
    next one once that cache is gone."""
    seconds = min(max(0.0, float(seconds)), _MAX_SETUP_S - 1)
    kept = setup_record(key, path)
    if kept is not None and kept[0] >= seconds and time.time() - kept[1] < SETUP_RECORD_MAX_AGE_S:
        return
    _record("setups", key, {"seconds": seconds}, path)


def processes_offer(key: str, path: str | None = None) -> Plan | None:
    """The plan decided for ``key`` (:func:`model_key`) when process plans could be measured, or None."""
    return _section_plan("with_processes", key, path)


def save_processes_offer(key: str, plan: Plan, path: str | None = None) -> None:
    """Record ``plan``, decided with process plans measured, for ``key`` (see :func:`processes_offer`)."""
    _record("with_processes", key, _plan_entry(plan), path)

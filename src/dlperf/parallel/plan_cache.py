"""Decisions of the planner, kept per (model, batch, devices, machine, torch version) so a run starts at once.

The cache is one small JSON file beside the probe's, ``$XDG_CACHE_HOME/dlperf/plans.json``, read the way
the probe cache is (:func:`~dlperf.probe.cache.read_cache_file`: a regular file of this user that nobody
else can write, bounded in size) and parsed field by field. A file that fails any check is ignored with
one line on stderr and the plan is measured again; writes replace it atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .._buildcache import CacheUnsafe, cache_base, private_dir, write_private
from ..batch import tensors_of
from ..devices import Device
from ..errors import UsageError
from ..probe.cache import ProbeCacheError, decode_json, machine_key, read_cache_file
from .plan import Plan

__all__ = ["plan_key", "cached_plan", "save_plan", "default_cache_path", "MAX_ENTRIES", "MAX_BYTES"]

CACHE_FORMAT = 1
MAX_ENTRIES = 256
MAX_BYTES = 512 * 1024
_KEY_HEX = 32
_MAX_ALTERNATIVES = 16
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


def _fail(path: str, problem: str) -> ProbeCacheError:
    return ProbeCacheError(f"plan cache {path}: {problem}")


def _ignore(exc: Exception) -> None:
    message = f"dlperf plan: ignoring {exc}; planning again (delete the file to stop this note)"
    if message not in _told:  # once a process: every Trainer of a script would repeat it
        _told.add(message)
        print(message, file=sys.stderr, flush=True)


def _read_entries(path: str) -> dict[str, Any]:
    """The file's entries, or {} when it is missing or unusable (said in one line)."""
    try:
        doc = decode_json(read_cache_file(path, _fail, max_bytes=MAX_BYTES), path, _fail)
        if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT or not isinstance(doc.get("plans"), dict):
            raise _fail(path, f"not a format-{CACHE_FORMAT} plan cache")
        entries = doc["plans"]
        if len(entries) > MAX_ENTRIES:
            raise _fail(path, f"more than {MAX_ENTRIES} entries")
        return entries
    except FileNotFoundError:
        return {}
    except (ProbeCacheError, OSError) as exc:
        _ignore(exc)
        return {}


def _entry_plan(entry: object, path: str) -> Plan:
    if not isinstance(entry, dict) or set(entry) != {"plan", "measured_ms", "alternatives", "saved"}:
        raise _fail(path, "an entry is not {plan, measured_ms, alternatives, saved}")
    ms, alts = entry["measured_ms"], entry["alternatives"]
    if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 < ms < 1e9):
        raise _fail(path, f"measured_ms {str(ms)[:30]!r} is not a step time in ms")
    if not isinstance(alts, list) or len(alts) > _MAX_ALTERNATIVES or not all(
            isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) and len(a[0]) <= 200
            and isinstance(a[1], (int, float)) and not isinstance(a[1], bool) and 0 < a[1] < 1e9 for a in alts):
        raise _fail(path, "alternatives are not [[name, ms], ...]")
    try:
        plan = Plan.from_dict(entry["plan"], "its plan")
    except (UsageError, TypeError) as exc:
        raise _fail(path, str(exc)) from None
    return plan.with_figures(float(ms) if ms is not None else None, [(a[0], float(a[1])) for a in alts],
                             ("measured earlier on this machine; cached",))


def cached_plan(key: str, path: str | None = None) -> Plan | None:
    """The plan decided for ``key`` before, or None (also when the file cannot be trusted: said once)."""
    path = path or default_cache_path()
    entry = _read_entries(path).get(key)
    if entry is None:
        return None
    try:
        return _entry_plan(entry, path)
    except ProbeCacheError as exc:
        _ignore(exc)
        return None


def _saved(entry: object) -> float:
    value = entry.get("saved") if isinstance(entry, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def save_plan(key: str, plan: Plan, path: str | None = None) -> None:
    """Record ``plan`` for ``key``; the oldest entries go beyond :data:`MAX_ENTRIES`. A cache that cannot
    be written costs the next run its planning time, not this run: said in one line."""
    path = path or default_cache_path()
    entries = _read_entries(path)
    entries[key] = {"plan": plan.to_dict(), "measured_ms": plan.measured_ms,
                    "alternatives": [list(a) for a in plan.alternatives[:_MAX_ALTERNATIVES]], "saved": time.time()}
    if len(entries) > MAX_ENTRIES:
        oldest = sorted(entries, key=lambda k: _saved(entries[k]))
        for k in oldest[: len(entries) - MAX_ENTRIES]:
            del entries[k]
    data = (json.dumps({"format": CACHE_FORMAT, "plans": entries}, allow_nan=False) + "\n").encode()
    try:
        if path == os.path.join(cache_base(), "dlperf", "plans.json"):
            private_dir(cache_base(), ["dlperf"])
        write_private(path, data)
    except (OSError, ValueError, CacheUnsafe) as exc:
        print(f"dlperf plan: the plan cache {path} cannot be written ({exc}); the next run plans again",
              file=sys.stderr, flush=True)

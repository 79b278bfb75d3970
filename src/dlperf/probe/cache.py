"""The probe's figures, saved per machine under the user's cache directory and read back with checks.

A cache file is only ever data: it is parsed as JSON of a known shape, every field checked, and
anything else (truncated, hostile, from another machine) is reported in one line and measured again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import stat
from collections.abc import Callable
from typing import Any

from .. import _io
from .._buildcache import cache_base, private_dir
from .._cliargs import one_line
from ..errors import DlperfError
from .reference import GBPS, GFLOPS, NS, implausible
from .result import FORMAT, ProbeResult, ProbeRow, machine

log = logging.getLogger(__name__)

_MAX_BYTES = 1024 * 1024
_MAX_ROWS = 2000
_LATEST_TIME = 1e11  # seconds since 1970: year 5138, far beyond any real timestamp
_KEY_FIELDS = ("hostname", "cpu", "cores", "memory_bytes", "torch")
_TEXT_LIMITS = {"key": 100, "what": 200, "unit": 16, "seed_source": 400, "note": 600}


class ProbeCacheError(DlperfError, ValueError):
    """A probe cache file that cannot be used; the message names it, says why and how to fix it."""


def machine_key(info: dict | None = None) -> str:
    """16 hex digits naming this machine: hostname, CPU model, core count, memory and torch version."""
    info = machine() if info is None else info
    ident = {name: info.get(name) for name in _KEY_FIELDS}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def cache_dir() -> str:
    return os.path.join(cache_base(), "dlperf", "probe")


def cache_path(info: dict | None = None) -> str:
    """$XDG_CACHE_HOME/dlperf/probe/<machine key>.json (~/.cache when XDG_CACHE_HOME is unset)."""
    return os.path.join(cache_dir(), f"{machine_key(info)}.json")


def save_probe(result: ProbeResult, path: str | None = None) -> str:
    """Write ``result`` atomically to its machine's cache file (or ``path``); return where."""
    if path is None:
        path = os.path.join(private_dir(cache_base(), ["dlperf", "probe"]), f"{machine_key(result.machine)}.json")
    _io.write_cache_file(path, (json.dumps(result.to_dict(), indent=1, allow_nan=False) + "\n").encode())
    return path


def _fail(path: str, problem: str) -> ProbeCacheError:
    return ProbeCacheError(one_line(f"probe cache {path}: {problem}; expected a file written by `dlperf probe` "
                                    f"(fix: delete it, or run `dlperf probe` to measure again)"))


def read_cache_file(path: str, fail: Callable[[str, str], Exception] = _fail, *, cache: bool = True,
                    max_bytes: int = _MAX_BYTES) -> bytes:
    """The bytes of a small regular file (:func:`dlperf._io.read_bounded`); of the cache unless ``cache=False``.

    A cache file must also be no link, owned by the user and not writable by group or others (anyone
    who could write it could choose the figures); a file the user names (``cache=False``) may be a link.
    ``fail(path, problem)`` makes the error, so each kind of file names itself and its own fix.
    """
    def owned(st: os.stat_result) -> None:
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise fail(path, f"owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}, not a file of "
                             f"uid {os.geteuid()} that only it can write")

    return _io.read_bounded(path, max_bytes, fail, follow_links=not cache, check=owned if cache else None)


def decode_json(data: bytes, path: str, fail: Callable[[str, str], Exception] = _fail) -> Any:
    """The JSON document in ``data`` (no NaN, no key twice), or ``fail(path, ...)`` saying why there is none."""
    return _io.decode_json(data, path, fail, allow_nan=False, unique_keys=True)


def _number(value, path: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(path, f"{where} is {one_line(repr(value))[:60]}, not a finite number")
    return float(value)


def _figure(value, path: str, where: str, unit: str) -> float:
    """A measured figure: finite, positive and within what a machine can show in ``unit``."""
    problem = implausible(value, unit)
    if problem is not None:
        raise _fail(path, f"{where} is {one_line(problem)[:120]}")
    return float(value)  # type: ignore[arg-type]  # implausible() checked it is a number


def _text(value, path: str, where: str, limit: int) -> str:
    """A string from the file, with control characters escaped: it is printed, and must not drive the terminal."""
    if not isinstance(value, str) or len(value) > limit:
        raise _fail(path, f"{where} is not a string of at most {limit} characters")
    return one_line(value)


def _row_from(doc, path: str, index: int) -> ProbeRow:
    where = f"rows[{index}]"
    if not isinstance(doc, dict):
        raise _fail(path, f"{where} is not an object")
    texts = {name: _text(doc.get(name), path, f"{where}.{name}", limit) for name, limit in _TEXT_LIMITS.items()}
    if texts["unit"] not in (NS, GBPS, GFLOPS):
        raise _fail(path, f"{where}.unit {texts['unit']!r} is not one of {NS}, {GBPS}, {GFLOPS}")
    value = None if doc.get("value") is None else _figure(doc["value"], path, f"{where}.value", texts["unit"])
    seed = _figure(doc.get("seed"), path, f"{where}.seed", texts["unit"])
    return ProbeRow(texts["key"], texts["what"], value, texts["unit"], seed, texts["seed_source"], texts["note"])


def _check_machine(info: dict, path: str) -> None:
    if len(info) > 32:
        raise _fail(path, "'machine' has more than 32 fields")
    for name, value in info.items():
        if not isinstance(name, str) or len(name) > 64:
            raise _fail(path, "'machine' has a field name that is not a short string")
        if name == "loadavg":
            if not isinstance(value, list) or len(value) != 2:
                raise _fail(path, "'machine.loadavg' is not a pair of numbers")
            for x in value:
                _number(x, path, "'machine.loadavg'")
        elif value is not None and not isinstance(value, (str, int, float)) or isinstance(value, str) \
                and len(value) > 400:
            raise _fail(path, f"'machine.{name}' is not a short string or a number")
        elif isinstance(value, str):
            info[name] = one_line(value)  # shown in the table's title


def parse_probe(data: bytes, path: str = "<probe cache>") -> ProbeResult:
    """A ProbeResult from a cache file's bytes; raise ProbeCacheError naming what is wrong."""
    doc = decode_json(data, path)
    if not isinstance(doc, dict) or type(doc.get("format")) is not int or doc["format"] != FORMAT:  # not true
        raise _fail(path, f"not a format-{FORMAT} probe document")
    info, rows = doc.get("machine"), doc.get("rows")
    if not isinstance(info, dict) or not isinstance(rows, list) or len(rows) > _MAX_ROWS:
        raise _fail(path, f"needs a 'machine' object and a 'rows' list of at most {_MAX_ROWS} rows")
    if not isinstance(doc.get("quick"), bool):
        raise _fail(path, "'quick' is not true or false")
    created = _number(doc.get("created"), path, "'created'")
    if not 0 <= created < _LATEST_TIME:
        raise _fail(path, f"'created' {created:g} is not a time in seconds since 1970")
    _check_machine(info, path)
    return ProbeResult(machine=info, quick=doc["quick"], created=created,
                       rows=[_row_from(r, path, i) for i, r in enumerate(rows)])


def read_probe(path: str) -> ProbeResult:
    """Read and check one probe file; raise ProbeCacheError (or FileNotFoundError when there is none)."""
    try:
        data = read_cache_file(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _fail(path, f"cannot be read ({exc.strerror or exc})") from None
    return parse_probe(data, path)


def load_probe(path: str | None = None, *, quiet: bool = False) -> ProbeResult | None:
    """This machine's saved figures, or None when there are none or they cannot be used.

    A corrupt file, or one recorded on another machine, is reported in one line on stderr (unless
    ``quiet``; each refusal once a process) and treated as missing, so the caller measures again.
    """
    current = machine()
    path = path or cache_path(current)
    try:
        result = read_probe(path)
        if machine_key(result.machine) != machine_key(current):
            raise _fail(path, "it was recorded on another machine or torch version")
    except FileNotFoundError:
        return None
    except ProbeCacheError as exc:
        # each refusal said once a process: callers that price several thread counts load it once each
        if not quiet and str(exc) not in _refusals_told:
            _refusals_told.add(str(exc))
            log.warning("dlperf probe: warning: %s; measuring again", exc)
        return None
    return result


_refusals_told: set[str] = set()

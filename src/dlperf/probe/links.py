"""Measured links between processes: a :class:`~dlperf.probe.cost.Link` per transport, saved per process layout.

The figures of one layout (the host of every rank, hence the world size) are saved in the probe's cache
directory, one file per layout, and read back as hostile input: JSON of one known shape, every field
checked. A file that fails a check is reported in one line and measured again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time

from .._cliargs import one_line
from .._io import write_cache_file
from .cache import ProbeCacheError, cache_dir, decode_json, read_cache_file
from .cost import Link
from .reference import GBPS, implausible

log = logging.getLogger(__name__)

LINKS_FORMAT = "dlperf-links-1"
TRANSPORTS = ("shm", "hierarchical", "gloo")
_MAX_HOSTS = 4096
_MAX_HOST_CHARS = 255
_LATEST_TIME = 1e11


def layout_key(hosts: list[str]) -> str:
    """16 hex digits naming a process layout: the host of every rank, in rank order."""
    return hashlib.sha256(json.dumps({"hosts": hosts}).encode()).hexdigest()[:16]


def links_path(hosts: list[str]) -> str:
    """$XDG_CACHE_HOME/dlperf/probe/links-<layout key>.json (~/.cache when XDG_CACHE_HOME is unset)."""
    return os.path.join(cache_dir(), f"links-{layout_key(hosts)}.json")


def save_links(hosts: list[str], fits: dict[str, Link], path: str | None = None) -> str:
    """Write the figures of this layout atomically; return where."""
    if path is None:
        from .._buildcache import cache_base, private_dir

        path = os.path.join(private_dir(cache_base(), ["dlperf", "probe"]), f"links-{layout_key(hosts)}.json")
    doc = {"format": LINKS_FORMAT, "created": time.time(), "hosts": hosts, "world": len(hosts),
           "links": {name: {"latency_s": f.alpha_s, "bytes_per_s": None if math.isinf(f.bandwidth) else f.bandwidth}
                     for name, f in fits.items()}}
    write_cache_file(path, (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode())
    return path


def _fail(path: str, problem: str) -> ProbeCacheError:
    return ProbeCacheError(one_line(f"link cache {path}: {problem}; expected a file written by dlperf's probe of "
                                    "the links between processes (fix: delete it, or set DLPERF_LINK_PROBE=again "
                                    "to measure again)"))


def _positive(value, path: str, where: str, *, allow_none: bool = False) -> float:
    if value is None and allow_none:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _fail(path, f"{where} is {one_line(repr(value))[:60]}, not a finite number >= 0")
    return float(value)


def parse_links(data: bytes, path: str, hosts: list[str]) -> dict[str, Link]:
    """The figures in a link cache file's bytes, for the layout ``hosts``; raise ProbeCacheError if unusable."""
    doc = decode_json(data, path, _fail)
    if not isinstance(doc, dict) or doc.get("format") != LINKS_FORMAT:
        raise _fail(path, f"not a {LINKS_FORMAT} document")
    saved = doc.get("hosts")
    if not isinstance(saved, list) or len(saved) > _MAX_HOSTS or \
            not all(isinstance(h, str) and len(h) <= _MAX_HOST_CHARS for h in saved):
        raise _fail(path, f"'hosts' is not a list of at most {_MAX_HOSTS} host names")
    if saved != hosts or doc.get("world") != len(hosts) or isinstance(doc.get("world"), bool):
        raise _fail(path, f"it was recorded for another layout of processes (not {len(hosts)} ranks on these hosts)")
    created = _positive(doc.get("created"), path, "'created'")
    if created >= _LATEST_TIME:
        raise _fail(path, f"'created' {created:g} is not a time in seconds since 1970")
    links = doc.get("links")
    if not isinstance(links, dict) or not links or len(links) > len(TRANSPORTS):
        raise _fail(path, f"'links' is not an object keyed by transport ({', '.join(TRANSPORTS)})")
    fits = {}
    for name, fig in links.items():
        if name not in TRANSPORTS:
            raise _fail(path, f"'links' names {one_line(repr(name))[:40]}, not one of {', '.join(TRANSPORTS)}")
        if not isinstance(fig, dict) or set(fig) != {"latency_s", "bytes_per_s"}:
            raise _fail(path, f"'links.{name}' is not an object with latency_s and bytes_per_s")
        latency = _positive(fig["latency_s"], path, f"'links.{name}.latency_s'")
        rate = _positive(fig["bytes_per_s"], path, f"'links.{name}.bytes_per_s'", allow_none=True)
        problem = None if math.isinf(rate) else implausible(rate / 1e9, GBPS)
        if latency > 60 or problem is not None:
            raise _fail(path, f"'links.{name}' is {latency:g} s + size / {rate:g} B/s, not a plausible link"
                              + (f" (its rate: {problem})" if problem else ""))
        fits[name] = Link(latency, rate)
    return fits


def load_links(hosts: list[str], transports: list[str], path: str | None = None) -> tuple[dict[str, Link] | None,
                                                                                         str]:
    """This layout's saved figures for ``transports`` (None when there are none or they cannot be used), and where.

    A file that fails a check is reported in one line on stderr and treated as missing, so the caller
    measures again (and its new figures replace the file).
    """
    path = path or links_path(hosts)
    try:
        fits = parse_links(read_cache_file(path, _fail), path, hosts)
        missing = [t for t in transports if t not in fits]
        if missing:
            raise _fail(path, f"it has no figures for {', '.join(missing)}")
    except FileNotFoundError:
        return None, path
    except OSError as exc:
        log.warning("dlperf: warning: %s; measuring again", _fail(path, f"cannot be read ({exc.strerror or exc})"))
        return None, path
    except ProbeCacheError as exc:
        log.warning("dlperf: warning: %s; measuring again", exc)
        return None, path
    return {t: fits[t] for t in transports}, path


# --- links named by people: ``--link 10gbit,50us`` ---------------------------------------------------------

_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
               "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
_TIME_UNITS = {"ns": 1e9, "us": 1e6, "ms": 1e3, "s": 1.0}  # per second
_RATE_RANGE = (1e3, 1e15)  # bytes/s: from a modem to far beyond any NIC; the probe's plausible bandwidths
_LATENCY_MAX_S = 10.0
_RATE_EXAMPLE = "give a rate such as 10gbit, 25Gbit/s, 1.25GB/s or 16GB/s"


def _split_number(text: str) -> tuple[float, str] | None:
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*", text)
    if m is None or len(text) > 40:
        return None
    return float(m[1]), m[2]


def parse_rate(text: str) -> float:
    """Bytes per second from ``10gbit``, ``10Gbit/s``, ``25Gbps``, ``1.25GB/s``, ``1.25GBps`` or ``16GB`` (bits when it
    says bit or a lower-case bps).

    >>> parse_rate("10gbit"), parse_rate("16GB/s")
    (1250000000.0, 16000000000.0)
    """
    from ..errors import UsageError

    parsed = _split_number(text)
    unit = parsed[1] if parsed else ""
    # Gbps is bits, GBps bytes: the case of the b says which, as in the usual spelling
    unit = unit[:-3] + "bit" if unit.endswith("bps") else unit[:-3] + "B" if unit.endswith("Bps") else unit
    unit = unit.lower().removesuffix("/s")
    if parsed is None or unit not in _RATE_UNITS:
        raise UsageError(f"{one_line(repr(text))[:60]} is not a link rate; {_RATE_EXAMPLE}")
    rate = parsed[0] * _RATE_UNITS[unit]
    if not _RATE_RANGE[0] <= rate <= _RATE_RANGE[1]:
        raise UsageError(f"{one_line(repr(text))[:60]} is {rate:g} bytes/s, outside {_RATE_RANGE[0]:g} to "
                         f"{_RATE_RANGE[1]:g}; {_RATE_EXAMPLE}")
    return rate


def parse_latency(text: str) -> float:
    """Seconds from ``50us``, ``0.2ms``, ``250ns`` or ``0.001s`` (0 allowed: no latency).

    >>> parse_latency("50us")
    5e-05
    """
    from ..errors import UsageError

    parsed = _split_number(text)
    if parsed is None or parsed[1].lower() not in _TIME_UNITS:
        raise UsageError(f"{one_line(repr(text))[:60]} is not a latency; give one such as 50us, 0.2ms or 1s")
    seconds = parsed[0] / _TIME_UNITS[parsed[1].lower()]
    if seconds > _LATENCY_MAX_S:
        raise UsageError(f"{one_line(repr(text))[:60]} is longer than {_LATENCY_MAX_S:g} s; give a one-way latency "
                         "such as 50us")
    return seconds


def parse_link(text: str) -> tuple[Link, bool]:
    """``RATE[,LATENCY]`` as a Link, and whether the latency was given (the caller assumes one otherwise).

    >>> parse_link("10gbit,50us")
    (Link(alpha_s=5e-05, bandwidth=1250000000.0), True)
    """
    from ..errors import UsageError

    parts = text.split(",")
    if len(parts) > 2:
        raise UsageError(f"{one_line(repr(text))[:60]} has {len(parts)} parts; give RATE or RATE,LATENCY, "
                         "e.g. 10gbit,50us")
    latency = parse_latency(parts[1]) if len(parts) == 2 else 0.0
    return Link(latency, parse_rate(parts[0])), len(parts) == 2


def saved_between_hosts(directory: str | None = None) -> tuple[Link, int, str] | None:
    """The newest saved gloo fit of a layout spanning several hosts: (fit of one allreduce, world, path), or None.

    The fit is of a whole allreduce among ``world`` ranks (what :mod:`dlperf.parallel.communication.process_links`
    measures), not of one message; :func:`dlperf.probe.projection.link_from_allreduce` converts it.
    """
    import glob

    best: tuple[float, Link, int, str] | None = None
    for path in glob.glob(os.path.join(directory or cache_dir(), "links-*.json")):
        try:
            doc = decode_json(read_cache_file(path, _fail), path, _fail)
            hosts = doc.get("hosts") if isinstance(doc, dict) else None
            if not isinstance(hosts, list) or len(set(map(str, hosts))) < 2:
                continue
            fits = parse_links(read_cache_file(path, _fail), path, hosts)
        except (OSError, ProbeCacheError):
            continue
        if "gloo" in fits and math.isfinite(fits["gloo"].bandwidth):
            created = float(doc["created"])
            if best is None or created > best[0]:
                best = (created, fits["gloo"], len(hosts), path)
    return None if best is None else best[1:]

"""Measured links between processes: a :class:`~dlperf.probe.cost.Link` per transport, saved per process layout.

The figures of one layout (the host of every rank, hence the world size) are saved in the probe's cache
directory, one file per layout, and read back as hostile input: JSON of one known shape, every field
checked. A file that fails a check is reported in one line and measured again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time

from .._buildcache import write_private
from .._cliargs import one_line
from .cache import ProbeCacheError, cache_dir, decode_json, read_cache_file
from .cost import Link

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
    write_private(path, (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode())
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
        if latency > 60 or rate <= 0:
            raise _fail(path, f"'links.{name}' is {latency:g} s + size / {rate:g} B/s, not a plausible link")
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
        print(f"dlperf: warning: {_fail(path, f'cannot be read ({exc.strerror or exc})')}; measuring again",
              file=sys.stderr, flush=True)
        return None, path
    except ProbeCacheError as exc:
        print(f"dlperf: warning: {exc}; measuring again", file=sys.stderr, flush=True)
        return None, path
    return {t: fits[t] for t in transports}, path

"""The host's facts that measurements are keyed by and reported with: its CPU model and its memory.

Below every capability: the benchmark (``machine_info``), the hardware probe (its cache key) and
:func:`dlperf.inventory.inventory` all describe the host through these.
"""

from __future__ import annotations

import os
import platform

__all__ = ["cpu_model", "host_memory", "read_meminfo", "rank_host", "HOST_ENV", "usable_cores"]

HOST_ENV = "DLPERF_HOST"
"""Set by :class:`~dlperf.parallel.launchers.ProcessLauncher` in every worker: see :func:`rank_host`."""


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's marketing name from /proc/cpuinfo, else what :mod:`platform` knows (``x86_64`` at worst)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """The figures of /proc/meminfo in bytes (``MemTotal``, ``MemAvailable``...); empty where there is none."""
    fields = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                words = value.split()
                if words and words[0].isdigit():
                    fields[key] = int(words[0]) * (1024 if words[1:] == ["kB"] else 1)
    except OSError:
        return {}
    return fields


def host_memory(meminfo: str = "/proc/meminfo") -> tuple[int | None, int | None]:
    """Host memory (total, used) in bytes from /proc/meminfo; (None, None) elsewhere."""
    fields = read_meminfo(meminfo)
    if "MemTotal" not in fields or "MemAvailable" not in fields:
        return None, None
    return fields["MemTotal"], fields["MemTotal"] - fields["MemAvailable"]


def rank_host() -> str:
    """The host of the calling worker as the launch knows it, the same string on every rank of that host.

    Under a :class:`~dlperf.parallel.launchers.ProcessLauncher` over several nodes it is the host name
    and the address the node reaches the others from (``"name (10.0.0.2)"``): hosts that share a name,
    as network namespaces or cloned machines do, are still told apart, and only ranks of one host are
    taken to share memory. Elsewhere it is the host name.
    """
    import socket

    return os.environ.get(HOST_ENV) or socket.gethostname()


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity, which a container or ``taskset`` narrows)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)

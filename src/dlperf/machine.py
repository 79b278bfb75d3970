"""The host's facts that measurements are keyed by and reported with: its CPU model and its memory.

Below every capability: the benchmark (``machine_info``), the hardware probe (its cache key) and
:func:`dlperf.inventory.inventory` all describe the host through these.
"""

from __future__ import annotations

import platform

__all__ = ["cpu_model", "host_memory"]


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


def host_memory(meminfo: str = "/proc/meminfo") -> tuple[int | None, int | None]:
    """Host memory (total, used) in bytes from /proc/meminfo; (None, None) elsewhere."""
    try:
        fields = {}
        with open(meminfo) as f:
            for line in f:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024
        return fields["MemTotal"], fields["MemTotal"] - fields["MemAvailable"]
    except (OSError, KeyError, ValueError):
        return None, None

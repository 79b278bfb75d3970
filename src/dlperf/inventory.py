"""What this process can compute on: the host CPU and every visible CUDA GPU, with memory and cores."""

from __future__ import annotations

import os

import torch

from .devices import cpu_count, num_gpus

__all__ = ["inventory"]


def _meminfo() -> tuple[int | None, int | None]:
    """Host memory (total, used) in bytes from /proc/meminfo; (None, None) elsewhere."""
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024
        return fields["MemTotal"], fields["MemTotal"] - fields["MemAvailable"]
    except (OSError, KeyError, ValueError):
        return None, None


def inventory() -> list[dict]:
    """One dict per physical device: the host CPU first, then each CUDA GPU."""
    from .bench.runner import _cpu_model

    total, used = _meminfo()
    devices = [{
        "device": "cpu",
        "kind": "cpu",
        "name": _cpu_model(),
        "cores": cpu_count(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_total_bytes": total,
        "memory_used_bytes": used,
        "note": "logical devices cpu(0), cpu(1), ... share this host memory",
    }]
    for i in range(num_gpus()):
        props = torch.cuda.get_device_properties(i)
        free, total_b = torch.cuda.mem_get_info(i)
        devices.append({
            "device": f"gpu({i})",
            "kind": "gpu",
            "name": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory_total_bytes": total_b,
            "memory_used_bytes": total_b - free,
        })
    return devices

"""What this process can compute on: the host CPU and every visible CUDA GPU, with memory and cores."""

from __future__ import annotations

import os

import torch

from .devices import cpu_count, num_gpus
from .machine import cpu_model, host_memory

__all__ = ["inventory"]


def inventory() -> list[dict]:
    """One dict per physical device: the host CPU first, then each CUDA GPU."""
    total, used = host_memory()
    devices = [{
        "device": "cpu",
        "kind": "cpu",
        "name": cpu_model(),
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

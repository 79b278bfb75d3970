"""``dlperf probe``: this machine's rows of d2l Tables 12.4.1 and 12.4.2, beside the book's figures.

Submodules are imported on first use so that importing the package costs nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "load_probe": "dlperf.probe.cache",
    "save_probe": "dlperf.probe.cache",
    "run_probe": "dlperf.probe.hardware",
    "ProbeResult": "dlperf.probe.hardware",
    "ProbeRow": "dlperf.probe.hardware",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dlperf.probe' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

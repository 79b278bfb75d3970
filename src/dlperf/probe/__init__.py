"""Where the time goes and what it should be (d2l 12.4): the hardware probe, the cost model, profiles.

``run_probe``/``load_probe`` measure this machine's rows of d2l Tables 12.4.1 and 12.4.2 and cache
them; ``Hardware``/``step_floor``/``rank_allreduce`` turn figures into the floor of a training step;
``profile`` times any model's step by operator group beside its floor.

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
    "Hardware": "dlperf.probe.cost",
    "StepFloor": "dlperf.probe.cost",
    "step_floor": "dlperf.probe.cost",
    "rank_allreduce": "dlperf.probe.cost",
    "profile": "dlperf.probe.profile",
    "ProfileReport": "dlperf.probe.profile",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dlperf.probe' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

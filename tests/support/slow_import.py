"""A module whose import, in a launched worker, takes seconds: the window in which a Ctrl-C reaches the workers
while they still import (they are in the terminal's process group until dlperf's worker entry moves them).

The launching process imports it first, then sets ``SLOW_IMPORT_MARKERS`` for its workers: each of them writes
``<pid>.importing`` there and sleeps while it imports this module.
"""

from __future__ import annotations

import os
import time

_MARKERS = os.environ.get("SLOW_IMPORT_MARKERS")
if _MARKERS:
    with open(os.path.join(_MARKERS, f"{os.getpid()}.importing"), "w") as f:
        f.write("importing\n")
    time.sleep(float(os.environ.get("SLOW_IMPORT_S", "20")))


def work() -> int:
    return 0

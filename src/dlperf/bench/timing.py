"""The benchmark timer lives in :mod:`dlperf.timing`, shared with hybridize and the hardware probe."""

from ..timing import (  # noqa: F401 - re-exported for existing imports
    NOISY_REL_SPREAD,
    Contention,
    ContentionMonitor,
    ContentionSignals,
    Timing,
    doubling_up_to,
    judge_contention,
    time_steps,
)

__all__ = ["NOISY_REL_SPREAD", "Contention", "ContentionMonitor", "ContentionSignals", "Timing",
           "doubling_up_to", "judge_contention", "time_steps"]

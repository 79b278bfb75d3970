"""What a hardware probe produced: one :class:`ProbeRow` per figure, and the run with the machine it describes.

Apart from the measuring code so that the cache, the GPU rows and the cost model read these without
importing the probe itself.
"""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass, field

from ..machine import cpu_model, host_memory

__all__ = ["FORMAT", "ProbeResult", "ProbeRow", "machine"]

FORMAT = 1


def cores() -> int:
    """The cores this process may use (devices, and with it torch, loads only when asked)."""
    from ..devices import cpu_count

    return cpu_count()


def machine() -> dict:
    """What the figures depend on: the probe's cache is keyed by exactly this."""
    import torch

    return {"hostname": socket.gethostname(), "cpu": cpu_model(), "cores": cores(),
            "memory_bytes": host_memory()[0], "torch": torch.__version__}


@dataclass
class ProbeRow:
    key: str
    what: str
    value: float | None  # in ``unit``; None when this machine cannot measure it (``note`` says why)
    unit: str
    seed: float  # the book's figure, in ``unit``
    seed_source: str
    note: str = ""

    @property
    def ratio(self) -> float | None:
        """This machine's figure over the book's (for times above 1 is slower, for rates above 1 faster)."""
        if self.value is None or not self.seed:
            return None
        return self.value / self.seed


@dataclass
class ProbeResult:
    machine: dict
    quick: bool
    created: float
    rows: list[ProbeRow] = field(default_factory=list)
    format: int = FORMAT
    interrupted: bool = False

    def to_dict(self) -> dict:
        doc = asdict(self)
        for row, out in zip(self.rows, doc["rows"]):
            out["ratio"] = row.ratio
        return doc

    def row(self, key: str) -> ProbeRow | None:
        return next((r for r in self.rows if r.key == key), None)

    def figures(self) -> dict[str, float | None]:
        """Each row's figure by key, in the row's unit (ns, GB/s or GFLOP/s); None where unavailable."""
        return {r.key: r.value for r in self.rows}

"""``cpu``: add everything in host memory, then copy the total to every device (d2l Fig. 12.7.3)."""

from __future__ import annotations

import torch

from .base import AllreduceAlgorithm, Phase, register_algorithm


class HostAllreduce(AllreduceAlgorithm):
    name = "cpu"
    summary = "sum in a host buffer, copy back; every device's link carries its data twice"

    def schedule(self, flats: list[torch.Tensor]) -> list[Phase]:
        k = len(flats)
        box: dict[str, torch.Tensor] = {}

        def reduce() -> None:
            acc = flats[0].to("cpu", copy=True)
            for t in flats[1:]:
                acc.add_(t.to("cpu"))
            box["sum"] = acc

        def copy_back(t: torch.Tensor):
            return lambda: t.copy_(box["sum"], non_blocking=t.device.type == "cuda" and
                                   box["sum"].is_pinned())

        return [[reduce] + [None] * (k - 1), [copy_back(t) for t in flats]]


register_algorithm(HostAllreduce())

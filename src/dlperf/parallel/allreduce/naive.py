"""``naive``: add everything on the first device, then copy the total back (d2l 12.5.4)."""

from __future__ import annotations

import torch

from .base import AllreduceAlgorithm, Phase, fetch, register_algorithm


class NaiveAllreduce(AllreduceAlgorithm):
    name = "naive"
    summary = "sum on the first device, broadcast back; its link carries 2(k-1) full copies"

    def schedule(self, flats: list[torch.Tensor]) -> list[Phase]:
        root, others = flats[0], flats[1:]

        def reduce() -> None:
            for t in others:
                root.add_(fetch(t, root))

        def broadcast_to(t: torch.Tensor):
            return lambda: t.copy_(root, non_blocking=True)

        return [[reduce] + [None] * len(others), [None] + [broadcast_to(t) for t in others]]


register_algorithm(NaiveAllreduce())

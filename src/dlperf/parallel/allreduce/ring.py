"""``ring``: chunked ring reduce-scatter, then ring all-gather (d2l 12.7.2).

The data is cut into k chunks. In each of k-1 reduce-scatter steps every device adds the chunk its
left neighbour passes on; afterwards device d holds the full sum of chunk d+1. In k-1 all-gather steps
the finished chunks travel once more round the ring. Every link carries 2(k-1)/k of the data, however
large k is, which is why the time to synchronize does not grow with the ring.
"""

from __future__ import annotations

import torch

from .base import AllreduceAlgorithm, Phase, chunk_bounds, fetch, register_algorithm


class RingAllreduce(AllreduceAlgorithm):
    name = "ring"
    summary = "k-1 reduce-scatter + k-1 all-gather steps between ring neighbours"

    def schedule(self, flats: list[torch.Tensor]) -> list[Phase]:
        k = len(flats)
        bounds = chunk_bounds(flats[0].numel(), k)

        def piece(t: torch.Tensor, c: int) -> torch.Tensor:
            lo, hi = bounds[c]
            return t[lo:hi]

        def add_from_left(d: int, c: int):
            return lambda: piece(flats[d], c).add_(fetch(piece(flats[d - 1], c), flats[d]))

        def copy_from_left(d: int, c: int):
            return lambda: piece(flats[d], c).copy_(piece(flats[d - 1], c), non_blocking=True)

        # In one step device d writes chunk c(d) and reads chunk c(d) of device d-1, which itself
        # writes chunk c(d-1) != c(d): the tasks of a step never touch the same memory.
        phases: list[Phase] = []
        for s in range(k - 1):
            phases.append([add_from_left(d, (d - 1 - s) % k) for d in range(k)])
        for s in range(k - 1):
            phases.append([copy_from_left(d, (d - s) % k) for d in range(k)])
        return phases


register_algorithm(RingAllreduce())

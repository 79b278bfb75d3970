"""Checks every reader and command shares: one-line messages, and memory refused before it is allocated.

The library's configs and file readers call :func:`require_memory` with an estimate (:func:`batch_bytes`
for a zoo network's training or inference batch) so that work which could not fit fails at once, with
one line naming the request and the fix, instead of swapping or being killed. The ``dlperf`` option
types (:mod:`dlperf.cli.options`) build on :func:`one_line`.
"""

from __future__ import annotations

import os

from .errors import UsageError
from .machine import read_meminfo

__all__ = ["one_line", "short_repr", "available_memory_bytes", "require_memory", "batch_bytes"]


def one_line(text: str) -> str:
    """``text`` with line breaks and other control characters escaped: an error stays one line."""
    return "".join(ch if ch.isprintable() or ch == " " else ascii(ch)[1:-1] for ch in text)


def short_repr(value: object, limit: int = 60) -> str:
    """``repr(value)`` on one line, cut to ``limit`` characters: a value shown in an error message.

    >>> short_repr("x" * 100, 10)
    "'xxxxxx..."
    """
    text = one_line(repr(value))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def available_memory_bytes() -> int | None:
    """Memory a new allocation can get without swapping: MemAvailable, else free pages; None if unknown."""
    available = read_meminfo().get("MemAvailable")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def require_memory(nbytes: float, what: str, fix: str) -> None:
    """Refuse, before allocating, work whose estimated ``nbytes`` exceed the memory available now."""
    available = available_memory_bytes()
    if available is not None and nbytes > available:
        raise UsageError(one_line(f"{what} needs about {_gib(nbytes)} but only {_gib(available)} of memory is "
                                  f"available; {fix}"))


def batch_bytes(spec, batch: int, *, training: bool) -> int:
    """Estimated bytes a batch of ``batch`` examples of zoo network ``spec`` needs, without allocating it.

    The network runs one example on PyTorch's meta device (shapes only, no memory), and every layer's
    output is measured: a training step keeps them all for the backward pass, inference at least the
    largest. A network the meta device cannot run is estimated by its input alone.
    """
    import torch

    sizes: dict[int, int] = {}  # by tensor id: an in-place layer's output is its input, counted once
    outputs: list = []  # keeps measured tensors alive so that their ids stay unique

    def measure(_module, _inputs, output) -> None:
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor):
                sizes[id(t)] = t.numel() * t.element_size()
                outputs.append(t)

    from .batch import tensors_of

    # made on the CPU and moved: a user's batch factory may hold real tensors, which the meta device cannot copy
    x, _ = spec.input.make_batch(1, device="meta")
    with torch.device("meta"):
        try:
            model = spec.build()
            # leaves only: a block's output is its last layer's, already counted
            handles = [m.register_forward_hook(measure) for m in model.modules() if not any(m.children())]
            with torch.no_grad():
                model(x)
            for h in handles:
                h.remove()
        except Exception:  # noqa: BLE001 (an estimate: any failure falls back to the input's size)
            sizes = {}
    measured = list(sizes.values())
    activations = (sum(measured) if training else max(measured)) if measured else 0
    per_example = sum(t.numel() * t.element_size() for t in tensors_of(x)) + activations
    return batch * per_example

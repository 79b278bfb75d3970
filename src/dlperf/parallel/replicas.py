"""Copies of one module on k devices with identical parameters (d2l's ``get_params``).

Each replica owns its parameters, gradients and buffers. BatchNorm running statistics therefore stay
per device by default, as d2l 12.5.2 suggests; :func:`broadcast_buffers` copies the first replica's
into the others when one set is wanted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from ..devices import Device, copy_to, device_of
from ..errors import DeviceMismatchError, UsageError

__all__ = ["replicate", "broadcast_parameters", "broadcast_buffers", "max_replica_difference"]


def replicate(module: nn.Module, devices: Sequence[Device]) -> list[nn.Module]:
    """One independent copy of ``module`` per device; the original is left untouched.

    >>> from dlperf.devices import cpu
    >>> reps = replicate(nn.Linear(3, 2), [cpu(0), cpu(1)])
    >>> torch.equal(reps[0].weight, reps[1].weight), reps[0].weight is reps[1].weight
    (True, False)
    """
    if not isinstance(module, nn.Module):
        raise UsageError(f"replicate expects an nn.Module, got {type(module).__name__}")
    return [copy_to(module, d) for d in devices]


def _pairs(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]):
    if len(src) != len(dst):
        raise UsageError(f"replicas differ in structure: {len(src)} vs {len(dst)} tensors")
    return zip(src, dst)


@torch.no_grad()
def _broadcast(replicas: Sequence[nn.Module], tensors: Callable[[nn.Module], Iterable[torch.Tensor]]) -> None:
    src = list(tensors(replicas[0]))
    for r in replicas[1:]:
        for s, d in _pairs(src, list(tensors(r))):
            d.copy_(s, non_blocking=True)


def broadcast_parameters(replicas: Sequence[nn.Module]) -> None:
    """Copy the first replica's parameters into every other replica."""
    _broadcast(replicas, nn.Module.parameters)


def broadcast_buffers(replicas: Sequence[nn.Module]) -> None:
    """Copy the first replica's buffers (BatchNorm statistics) into every other replica."""
    _broadcast(replicas, nn.Module.buffers)


@torch.no_grad()
def max_replica_difference(replicas: Sequence[nn.Module]) -> float:
    """Largest absolute parameter difference between the first replica and any other (0.0 = identical)."""
    worst = 0.0
    ref = [p.detach().cpu() for p in replicas[0].parameters()]
    for r in replicas[1:]:
        for a, b in _pairs(ref, list(r.parameters())):
            if a.numel():
                worst = max(worst, float((a - b.detach().cpu()).abs().max()))
    return worst


def check_replica_device(module: nn.Module, device: Device) -> None:
    """Raise when a replica is not where the trainer expects it."""
    have = device_of(module)
    if have != device:
        raise DeviceMismatchError(f"replica is on {have} but was expected on {device}")

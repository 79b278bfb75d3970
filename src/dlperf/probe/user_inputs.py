"""The batch for a user's model, as ``--input`` names it: tensor specs, or a ``module:factory`` that makes one.

``dlperf profile`` and ``dlperf bench --networks module:factory`` share this: a list of
:class:`~dlperf.models.inputs.TensorSpec` (one per positional argument, integer ids drawn below the
model's embedding sizes unless a range is given) or the name of a function that takes no arguments and
returns the batch (a tensor, a tuple of positional arguments, a dict). The factory is imported by the one
mechanism that imports a model factory (:func:`dlperf.probe.targets.load_factory`), only because the user
named it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..batch import Batch, describe, tensors_of
from ..errors import UsageError
from ..models.inputs import TensorSpec, make_inputs
from .targets import load_factory

__all__ = ["InputSource", "batch_maker", "input_bytes"]

InputSource = Sequence[TensorSpec] | str
"""Tensor specs, or the ``module:factory`` of a function returning a batch."""


def input_bytes(source: InputSource) -> int:
    """Bytes the specs' tensors take (0 for a factory: its batch is only known once it is made)."""
    return 0 if isinstance(source, str) else sum(s.nbytes for s in source)


def _factory_batch(target: str) -> Callable[[nn.Module, torch.Generator | None], Batch]:
    factory = load_factory(target)
    made: list[Any] = []

    def example(_model: nn.Module, _generator: torch.Generator | None) -> Batch:
        if not made:  # the user's function runs once; every step then reuses its batch, as a loader's would
            try:
                batch = factory()
            except (Exception, SystemExit) as exc:  # noqa: BLE001 (user code)
                raise UsageError(f"{target}() raised {type(exc).__name__}: {exc}; fix the batch factory, or name "
                                 "one that takes no arguments") from None
            if not tensors_of(batch):
                raise UsageError(f"{target}() returned {describe(batch)}, with no tensor; return the model's "
                                 "inputs: a tensor, a tuple of tensors (positional arguments) or a dict of tensors")
            made.append(batch)
        return made[0]

    return example


def batch_maker(source: InputSource) -> Callable[[nn.Module, torch.Generator | None], Batch]:
    """``make(model, generator) -> batch`` for ``source``; a factory is imported now, called on first use.

    >>> from dlperf.models.inputs import parse_tensor_spec
    >>> make = batch_maker([parse_tensor_spec("2x5:int64"), parse_tensor_spec("2:int64:1-5")])
    >>> describe(make(nn.Embedding(7, 3), torch.Generator().manual_seed(0)))
    'tuple(int64[2,5], int64[2])'
    """
    if isinstance(source, str):
        return _factory_batch(source)
    specs = list(source)
    return lambda model, generator: make_inputs(specs, model, generator)

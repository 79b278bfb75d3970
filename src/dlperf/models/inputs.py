"""Synthetic batches for a user's own model: tensor specs with dtypes and value ranges, and their targets.

A spec is written as on the command line, batch first: ``64x3x32x32`` (float32), ``64x32:int64``
(token ids), ``64x32:int64:0-1000`` (ids in ``[0, 1000)``), ``64:bool``. Several specs make a tuple
(the model's positional arguments, :func:`dlperf.batch.call_model`'s rule). Integer inputs without a
range are drawn below the smallest ``nn.Embedding`` of the model, so every id is one it can look up.

>>> import torch
>>> from torch import nn
>>> specs = [parse_tensor_spec("4x6:int64"), parse_tensor_spec("4:int64:0-3")]
>>> ids, lengths = make_inputs(specs, nn.Embedding(10, 2), torch.Generator().manual_seed(0))
>>> ids.dtype, int(ids.max()) < 10, int(lengths.max()) < 3
(torch.int64, True, True)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..batch import Batch, batch_size, describe, map_tensors, tensors_of
from ..errors import UsageError

__all__ = ["TensorSpec", "parse_tensor_spec", "embedding_range", "make_inputs", "resize_batch", "make_targets",
           "structured_loss", "StructuredLoss", "DTYPES", "MAX_DIM", "MAX_ELEMENTS"]

MAX_DIM = 2**24
MAX_ELEMENTS = 2**31
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "float64": torch.float64, "double": torch.float64,
    "float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_RANGE = re.compile(r"^(-?[0-9]{1,18})-(-?[0-9]{1,18})$")
# integer inputs of a model without embeddings: small non-negative values (indices, lengths, flags)
DEFAULT_INT_HIGH = 2


@dataclass(frozen=True)
class TensorSpec:
    """One input tensor: its shape (batch first), dtype and, for integers, the range ``[low, high)``."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    low: int | None = None
    high: int | None = None

    @property
    def is_integer(self) -> bool:
        return not self.dtype.is_floating_point and self.dtype != torch.bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def text(self) -> str:
        dims = "x".join(map(str, self.shape))
        name = str(self.dtype).removeprefix("torch.")
        rng = f":{self.low}-{self.high}" if self.high is not None else ""
        return dims if self.dtype == torch.float32 and not rng else f"{dims}:{name}{rng}"

    def make(self, generator: torch.Generator | None, high: int | None = None) -> torch.Tensor:
        """A random tensor of this spec; integers below ``high`` (an embedding size) unless a range is given."""
        if self.dtype.is_floating_point:
            return torch.randn(self.shape, generator=generator).to(self.dtype)
        if self.dtype == torch.bool:
            return torch.randint(0, 2, self.shape, generator=generator).bool()
        low = self.low if self.low is not None else 0
        top = self.high if self.high is not None else (high or DEFAULT_INT_HIGH)
        return torch.randint(low, top, self.shape, generator=generator, dtype=torch.int64).to(self.dtype)


def parse_tensor_spec(text: str, what: str = "--input") -> TensorSpec:
    """``SHAPE[:DTYPE[:LOW-HIGH]]`` -> :class:`TensorSpec`; a bad spec is one :class:`UsageError` naming it."""
    shown = repr(text if len(text) <= 60 else text[:57] + "...")
    fix = (f"give {what} a batch-first shape, a dtype and for integers a range, e.g. 64x3x32x32, 64x32:int64 or "
           "64x32:int64:0-1000")
    parts = text.strip().split(":") if len(text) <= 200 else []
    if not 1 <= len(parts) <= 3:
        raise UsageError(f"{shown} is not a tensor spec; {fix}")
    dims_text = parts[0].strip().lower().split("x")
    if not 1 <= len(dims_text) <= 8 or not all(d.strip().isdigit() and len(d.strip()) <= 12 for d in dims_text):
        raise UsageError(f"{shown} is not a shape; {fix}")
    dims = tuple(int(d) for d in dims_text)
    if any(not 1 <= d <= MAX_DIM for d in dims):
        raise UsageError(f"{shown} has a dimension outside 1..{MAX_DIM}; {fix}")
    if math.prod(dims) > MAX_ELEMENTS:
        raise UsageError(f"{shown} has more than {MAX_ELEMENTS} elements; give a smaller {what}")
    dtype = torch.float32
    if len(parts) >= 2:
        name = parts[1].strip().lower()
        if name not in DTYPES:
            raise UsageError(f"{shown} names dtype {name[:20]!r}; expected one of {', '.join(DTYPES)}")
        dtype = DTYPES[name]
    spec = TensorSpec(dims, dtype)
    if len(parts) == 3:
        m = _RANGE.match(parts[2].strip())
        if not spec.is_integer:
            raise UsageError(f"{shown} gives a value range to a {parts[1].strip()} input; ranges are for integer "
                             "dtypes (int64, int32, ...): drop the range")
        if not m or int(m.group(1)) >= int(m.group(2)):
            raise UsageError(f"{shown} has range {parts[2][:30]!r}; expected LOW-HIGH with LOW < HIGH, ids drawn "
                             "from [LOW, HIGH), e.g. 0-1000")
        info = torch.iinfo(dtype)
        low, high = int(m.group(1)), int(m.group(2))
        if low < info.min or high - 1 > info.max:
            raise UsageError(f"{shown}: range {low}-{high} does not fit {parts[1].strip()} ({info.min} to "
                             f"{info.max}); give a range inside it")
        spec = TensorSpec(dims, dtype, low, high)
    return spec


def embedding_range(model: nn.Module) -> int | None:
    """The number of ids every ``nn.Embedding``/``nn.EmbeddingBag`` of ``model`` accepts (the smallest); None
    without embeddings."""
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    return min(sizes) if sizes else None


def make_inputs(specs: Sequence[TensorSpec], model: nn.Module | None,
                generator: torch.Generator | None = None) -> Batch:
    """One tensor for one spec, a tuple (positional arguments) for several; integer ids valid for ``model``."""
    if not specs:
        raise UsageError("no input spec given; give at least one, e.g. 64x3x32x32")
    sizes = {s.shape[0] for s in specs}
    if len(sizes) > 1:
        raise UsageError(f"the input specs {', '.join(s.text() for s in specs)} have batch sizes "
                         f"{', '.join(map(str, sorted(sizes)))}; give every input the same first dimension")
    high = embedding_range(model) if model is not None else None
    made = [s.make(generator, high) for s in specs]
    return made[0] if len(made) == 1 else tuple(made)


def resize_batch(batch: Batch, n: int) -> Batch:
    """``batch`` with ``n`` examples: its rows repeated in order (or cut), every tensor with a first axis alike."""
    have = batch_size(batch)
    if n == have:
        return batch
    rows = torch.arange(n) % have
    return map_tensors(lambda t: t[rows.to(t.device)] if t.dim() > 0 else t, batch)


# --- targets and a loss for any output -----------------------------------------------------------------------

def make_targets(output: Batch, n: int, generator: torch.Generator | None = None, loss: Any = None) -> Batch:
    """Targets for ``n`` examples shaped like ``output`` (a model's output at any batch size), one per floating
    output, as :func:`dlperf.losses.made_up_targets` makes them for ``loss``; None when the model computes its own
    loss (an output with ``loss``)."""
    from ..losses import made_up_targets, model_loss, predictions

    if model_loss(output) is not None:
        return None
    option = loss if isinstance(loss, str) or loss is None else "callable"
    targets = [made_up_targets(t, option, n, generator) for t in tensors_of(predictions(output))
               if t.is_floating_point()]
    return targets[0] if len(targets) == 1 else tuple(targets)


class StructuredLoss:
    """A user network's loss for ``bench``: the model's own, else ``loss`` (the default rule when None) summed
    over its floating outputs against :func:`make_targets`'s targets."""

    def __init__(self, loss: Any = None) -> None:
        from ..losses import resolve_loss

        self.step_loss = resolve_loss(loss)
        self.name = self.step_loss.name

    def __call__(self, output: Batch, target: Batch) -> torch.Tensor:
        from ..losses import model_loss, predictions

        own = model_loss(output)
        if own is not None:
            return own
        outs = [t for t in tensors_of(predictions(output)) if t.is_floating_point()]
        targets = tensors_of(target)
        if not outs or len(outs) != len(targets):
            raise UsageError(f"the model returned {describe(output)}; expected the floating tensors of "
                             f"{describe(target)} (return the outputs the loss is computed on)")
        total = self.step_loss(outs[0], targets[0])
        for out, tgt in zip(outs[1:], targets[1:]):
            total = total + self.step_loss(out, tgt)
        return total


structured_loss = StructuredLoss()
"""The default :class:`StructuredLoss`: the model's own, else cross-entropy where the outputs are class scores."""

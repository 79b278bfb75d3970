"""The loss a training step minimises, decided by one rule wherever dlperf trains or times a step.

A loss is a name (``ce``, ``mse``, ``l1``, ``smooth-l1``, ``bce``) or a ``torch.nn`` loss (given the predictions:
a mapping output's ``logits``), a callable ``loss(outputs, targets)`` of yours (given the outputs as the model
returns them; ``loss(outputs, batch)`` when the batch carries its own labels), or, with none
named, the model's own: an output mapping or object with a ``loss`` (the HuggingFace convention). Without a
loss of the model's, the default is cross-entropy, and only where it can be right: integer class labels of
shape ``[B]`` beside scores ``[B, C]`` with at least two classes. Anything else (float targets, a one-column
head, shapes that do not pair) is one error naming ``loss=``, never a loss that trains nothing.

>>> import torch
>>> scores, labels = torch.tensor([[2.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])
>>> round(float(resolve_loss(None)(scores, labels)), 4)
0.1269
>>> resolve_loss(None)(torch.zeros(2, 1), torch.zeros(2))
Traceback (most recent call last):
  ...
dlperf.errors.UsageError: the default loss, cross-entropy, needs integer class labels [B] beside scores [B, C] \
with C >= 2, but the model returned float32[2,1] for targets float32[2]; name the loss: loss='mse' (or l1, \
smooth-l1, bce, ce, a torch.nn loss, or fn(outputs, targets))
>>> resolve_loss("mse")(torch.zeros(2, 1), torch.ones(2)).item()  # a [B, 1] head against [B] targets
1.0
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .batch import describe
from .errors import UsageError
from .registry import Registry

__all__ = ["LOSSES", "StepLoss", "resolve_loss", "model_loss", "predictions", "labels_of", "made_up_targets",
           "TimedLoss"]

LossFn = Callable[[Any, Any], torch.Tensor]

LOSSES: Registry[LossFn] = Registry("loss", normalize=str.lower)
LOSSES.register("ce", nn.functional.cross_entropy)
LOSSES.register("mse", nn.functional.mse_loss)
LOSSES.register("l1", nn.functional.l1_loss)
LOSSES.register("smooth-l1", nn.functional.smooth_l1_loss)
LOSSES.register("bce", nn.functional.binary_cross_entropy_with_logits)

# Losses that compare outputs and targets element by element: a [B, 1] head against [B] targets is meant as one
# value per example (torch would broadcast it to [B, B] with only a warning)
_ELEMENTWISE = {"mse", "l1", "smooth-l1", "bce"}
_NAMES = "'mse' (or l1, smooth-l1, bce, ce, a torch.nn loss, or fn(outputs, targets))"


def _field(outputs: Any, name: str) -> Any:
    if isinstance(outputs, Mapping):
        return outputs.get(name)
    if isinstance(outputs, (torch.Tensor, tuple, list)):
        return None
    return getattr(outputs, name, None)


def model_loss(outputs: Any) -> torch.Tensor | None:
    """The loss a model computed itself: ``outputs["loss"]`` or ``outputs.loss`` (HuggingFace's convention)."""
    found = _field(outputs, "loss")
    return found if isinstance(found, torch.Tensor) else None


def predictions(outputs: Any) -> Any:
    """What a model predicts: ``outputs["logits"]``/``outputs.logits`` where it returns a mapping or object, else
    its output itself."""
    found = _field(outputs, "logits")
    return found if found is not None else outputs


def labels_of(inputs: Any, targets: Any) -> Any:
    """The labels of a batch: ``targets``, else the ``labels`` a mapping batch carries (None without either)."""
    if targets is not None:
        return targets
    return inputs.get("labels") if isinstance(inputs, Mapping) else None


def _cross_entropy_fits(scores: Any, targets: Any) -> bool:
    if not isinstance(scores, torch.Tensor) or not isinstance(targets, torch.Tensor):
        return False
    if not scores.is_floating_point() or targets.is_floating_point() or targets.dtype == torch.bool:
        return False
    return scores.dim() >= 2 and scores.shape[1] >= 2 and \
        tuple(targets.shape) == (scores.shape[0], *scores.shape[2:])


def _classes_last(scores: Any, targets: Any) -> bool:
    """Scores ``[B, T, C]`` against labels ``[B, T]`` (a label per token, HuggingFace's layout)."""
    return isinstance(scores, torch.Tensor) and isinstance(targets, torch.Tensor) and scores.dim() == 3 and \
        scores.is_floating_point() and not targets.is_floating_point() and targets.dtype != torch.bool and \
        scores.shape[-1] >= 2 and tuple(targets.shape) == tuple(scores.shape[:2])


class StepLoss:
    """A resolved loss: call it with ``(outputs, targets, inputs)``; ``name`` says in a header what is minimised.

    ``targets`` is None when the batch carries its labels (a mapping batch): a loss of the model's own is used
    then, or a callable given ``(outputs, inputs)``.
    """

    def __init__(self, fn: LossFn | None, name: str, elementwise: bool = False, on_predictions: bool = True) -> None:
        self.fn, self.name, self._elementwise = fn, name, elementwise
        self._on_predictions = on_predictions
        """A named or ``torch.nn`` loss takes the predictions (a mapping output's logits); a callable of the
        user's takes the outputs as the model returned them."""

    def __repr__(self) -> str:
        return f"StepLoss({self.name})"

    @property
    def __name__(self) -> str:
        """What an error calls this loss: the user's function or ``torch.nn`` class, or the default's."""
        if self.fn is None:
            return "cross_entropy"
        return getattr(self.fn, "__name__", type(self.fn).__name__)

    def __call__(self, outputs: Any, targets: Any, inputs: Any = None) -> torch.Tensor:
        if self.fn is None:
            return self._default(outputs, targets, inputs)
        if targets is None:  # the batch carries its labels: the callable reads them from it
            return self.fn(outputs, inputs)
        if not self._on_predictions:
            return self.fn(outputs, targets)
        scores = predictions(outputs)
        if self._elementwise and isinstance(scores, torch.Tensor) and isinstance(targets, torch.Tensor):
            if scores.shape != targets.shape and scores.numel() == targets.numel():
                targets = targets.reshape(scores.shape)
            if not targets.is_floating_point() and scores.is_floating_point():
                targets = targets.to(scores.dtype)
        return self.fn(scores, targets)

    def _default(self, outputs: Any, targets: Any, inputs: Any) -> torch.Tensor:
        own = model_loss(outputs)
        if own is not None:
            return own
        scores = predictions(outputs)
        if targets is None:
            raise UsageError(f"the model returned {describe(outputs)} with no loss in it, and the batch "
                             f"{describe(inputs)} has no separate targets; name the loss: loss=fn(outputs, batch), "
                             "or return {'loss': ...} from the model")
        if _cross_entropy_fits(scores, targets):
            return nn.functional.cross_entropy(scores, targets)
        if _classes_last(scores, targets):
            return nn.functional.cross_entropy(scores.reshape(-1, scores.shape[-1]), targets.reshape(-1))
        raise UsageError(f"the default loss, cross-entropy, needs integer class labels [B] beside scores [B, C] with "
                         f"C >= 2, but the model returned {describe(outputs)} for targets {describe(targets)}; "
                         f"name the loss: loss={_NAMES}")


def resolve_loss(loss: str | LossFn | nn.Module | StepLoss | None) -> StepLoss:
    """The :class:`StepLoss` for ``loss``: a name from :data:`LOSSES`, a ``torch.nn`` loss or callable, or None
    (the model's own loss, else cross-entropy where it fits)."""
    if isinstance(loss, StepLoss):
        return loss
    if loss is None:
        return StepLoss(None, "the model's own loss, else cross-entropy on integer class labels")
    if isinstance(loss, str):
        fn = LOSSES.get(loss)
        name = loss.lower()
        return StepLoss(fn, "cross-entropy" if name == "ce" else name, name in _ELEMENTWISE)
    if not callable(loss):
        raise UsageError(f"loss={loss!r}: expected a name ({', '.join(LOSSES.names())}), a torch.nn loss, a "
                         "callable loss(outputs, targets), or None")
    elementwise = isinstance(loss, (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.BCEWithLogitsLoss, nn.BCELoss))
    torch_loss = isinstance(loss, nn.modules.loss._Loss)
    name = type(loss).__name__ if isinstance(loss, nn.Module) else getattr(loss, "__qualname__", repr(loss))
    return StepLoss(loss, name, elementwise, on_predictions=torch_loss)


def made_up_targets(scores: torch.Tensor, loss: str | None, n: int | None = None,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Targets for timing a step on ``scores`` (a model's floating output) with ``loss``, for ``n`` examples: class
    labels for cross-entropy (the default only where the output is class scores, classes last: ``[B, C]`` or
    ``[B, T, C]`` with C >= 2), zeros for the element-wise losses. Anything else is one line naming ``loss=``."""
    n = scores.shape[0] if n is None else n
    name = None if loss is None else str(loss).lower()
    if name in _ELEMENTWISE or (name is not None and name not in LOSSES):  # a callable's: zeros of the scores
        return torch.zeros((n, *scores.shape[1:]), dtype=scores.dtype)
    if scores.dim() in (2, 3) and scores.shape[-1] >= 2:
        return torch.randint(0, scores.shape[-1], (n, *scores.shape[1:-1]), generator=generator)
    what = "cross-entropy" if name == "ce" else "the default loss, cross-entropy,"
    raise UsageError(f"{what} needs class scores [B, C] (or [B, T, C]) with C >= 2, but the model returned "
                     f"{describe(scores)}; name the loss: loss={_NAMES}")


class TimedLoss:
    """The loss of a step timed on a made-up batch (``bench``, ``profile``, ``scale``, the planner's reports):
    the model's own where it returns one, else ``loss`` (or the default rule) on each floating output against
    :func:`made_up_targets`. ``name`` is what their headers print."""

    def __init__(self, loss: str | LossFn | nn.Module | None, outputs: Any, n: int | None = None,
                 generator: torch.Generator | None = None) -> None:
        self.step_loss = resolve_loss(loss)
        self.own = model_loss(outputs) is not None
        scores = predictions(outputs)
        from .batch import tensors_of

        leaves = [t for t in tensors_of(scores) if t.is_floating_point()]
        if not self.own and not leaves:
            raise UsageError(f"the model returned {describe(outputs)}, with no floating tensor to take a loss of; "
                             "return the outputs the loss is computed on")
        option = loss if isinstance(loss, str) else (None if loss is None else "callable")
        self.targets = [] if self.own else [made_up_targets(t, option, n, generator) for t in leaves]
        default = "cross-entropy (the default, on class scores)" if self.step_loss.fn is None else self.step_loss.name
        self.name = "the model's own (outputs['loss'])" if self.own else default

    def __call__(self, outputs: Any) -> torch.Tensor:
        if self.own:
            own = model_loss(outputs)
            assert own is not None
            return own
        from .batch import tensors_of

        leaves = [t for t in tensors_of(predictions(outputs)) if t.is_floating_point()]
        total = self.step_loss(leaves[0], self.targets[0].to(leaves[0].device))
        for out, target in zip(leaves[1:], self.targets[1:]):
            total = total + self.step_loss(out, target.to(out.device))
        return total

"""What a benchmark network is: a builder, the shape of its input, its loss and batch sizes."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from ..registry import Registry


@dataclass(frozen=True)
class InputSpec:
    """Shape and kind of one sample and its target, enough to make a synthetic batch.

    ``kind`` is ``"dense"`` (float features, class targets) or ``"tokens"`` (integer token ids;
    the target is the next token at every position).
    """

    shape: tuple[int, ...]
    num_classes: int
    kind: str = "dense"

    def make_batch(self, batch_size: int, device: torch.device | str = "cpu",
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of random inputs and targets of the right shapes, dtypes and value ranges."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        g = generator
        if self.kind == "tokens":
            (steps,) = self.shape
            x = torch.randint(0, self.num_classes, (batch_size, steps), generator=g)
            y = torch.randint(0, self.num_classes, (batch_size, steps), generator=g)
        else:
            x = torch.randn((batch_size, *self.shape), generator=g)
            y = torch.randint(0, self.num_classes, (batch_size,), generator=g)
        return x.to(device), y.to(device)


def check_class_targets(output: torch.Tensor, target: torch.Tensor) -> None:
    """Raise one clear :class:`~dlperf.errors.UsageError` where cross-entropy would fail cryptically or train nothing.

    Float labels (other than one probability per output column) and a one-column output, over which
    cross-entropy is 0 whatever the weights, are refused; labels out of range are the loss's own error.
    Attributes only: nothing is read from the device.
    """
    if not isinstance(output, torch.Tensor) or not isinstance(target, torch.Tensor) or output.dim() < 2:
        return
    if target.dtype is torch.int64 and output.shape[-1] > 1:  # the usual case, checked first: once per step
        return
    soft = target.is_floating_point() and target.shape == output.shape
    if (target.is_floating_point() and not soft) or target.is_complex() or target.dtype == torch.bool:
        raise UsageError(f"cross-entropy needs integer class labels (0 to {output.shape[-1] - 1}), got targets of "
                         f"{str(target.dtype).removeprefix('torch.')}{list(target.shape)} for output "
                         f"{str(output.dtype).removeprefix('torch.')}{list(output.shape)}; give int64 class labels")
    if output.shape[-1] == 1:
        raise UsageError(f"cross-entropy over a one-column output ({list(output.shape)}) is 0 whatever the weights, "
                         "so nothing would train; give the model one output column per class, with integer class "
                         "labels")


def classification_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Softmax cross-entropy; sequence outputs (N, T, C) are flattened over time steps."""
    check_class_targets(output, target)
    if output.dim() == 3:
        output = output.reshape(-1, output.shape[-1])
        target = target.reshape(-1)
    return nn.functional.cross_entropy(output, target)


@dataclass(frozen=True)
class ModelSpec:
    """A registered network: how to build it and how Shi et al. (2016) fed it."""

    name: str
    build: Callable[[], nn.Module]
    input: InputSpec | UserInputs
    cpu_batch: int
    gpu_batch: int
    description: str
    paper: bool = True  # one of the seven networks of Shi et al. Table 7
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = classification_loss

    def batch_size_for(self, device_kind: str) -> int:
        """Table 9's batch size on CPUs, Table 7's on GPUs."""
        return self.gpu_batch if device_kind == "gpu" else self.cpu_batch


_MODELS: Registry[ModelSpec] = Registry("network", normalize=str.lower)


def register(spec: ModelSpec, *, replace: bool = False) -> ModelSpec:
    """Add a network under ``spec.name``; a name already taken raises unless ``replace=True``."""
    _MODELS.register(spec.name, spec, replace=replace)
    return spec


def unregister(name: str) -> None:
    """Forget ``name`` (a no-op when it is not registered)."""
    _MODELS.remove(name)


def model_names(paper_only: bool = False) -> list[str]:
    """Registered names in registration order (the paper's table order first)."""
    return [n for n, s in _MODELS.items() if s.paper or not paper_only]


def get_spec(name: str) -> ModelSpec:
    """The registered network called ``name`` (case-insensitive); a miss lists what exists."""
    return _MODELS.get(name)


def get_model(name: str) -> nn.Module:
    """Build a fresh, randomly initialized network by name.

    >>> sum(p.numel() for p in get_model("fcn-r").parameters())
    14205962
    """
    return get_spec(name).build()


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@dataclass(frozen=True)
class UserInputs:
    """A user network's batch: ``example()`` makes one at its own size (from specs or the user's factory);
    ``make_batch`` resizes it and adds targets shaped like the model's output (:mod:`dlperf.models.inputs`)."""

    example: Callable[[torch.Generator | None], Any]
    output: Any
    """The model's output on the example batch (any structure): what the targets are shaped after."""
    description: str = ""
    loss: Any = None
    """The loss named for it (None: the model's own, else cross-entropy on class scores)."""

    def make_batch(self, batch_size: int, device: torch.device | str = "cpu",
                   generator: torch.Generator | None = None) -> tuple[Any, Any]:
        from ..batch import map_tensors
        from .inputs import make_targets, resize_batch

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        x = resize_batch(self.example(generator), batch_size)
        y = make_targets(self.output, batch_size, generator, self.loss)
        return map_tensors(lambda t: t.to(device), x), map_tensors(lambda t: t.to(device), y)


class CallsWithBatch(nn.Module):
    """The user's model called on a batch by :func:`dlperf.batch.call_model`'s rule (a tuple: positional
    arguments), so a step written ``loss_fn(model(x), y)`` runs it on any batch structure."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *inputs: Any) -> Any:
        from ..batch import call_model

        # one argument: the batch (``model(x)``); several: already unpacked (``call_model(model, x)``)
        return call_model(self.inner, inputs[0]) if len(inputs) == 1 else self.inner(*inputs)


def user_network(name: str, build: Callable[[], nn.Module], example: Callable[[nn.Module, torch.Generator | None],
                 Any], *, description: str = "", loss: Any = None) -> ModelSpec:
    """A :class:`ModelSpec` for a user's model factory and batch maker, registered under ``name`` (replacing
    an earlier one of that name); the model is built and run once here, to shape the targets."""
    from ..batch import batch_size, describe
    from ..errors import UsageError
    from .inputs import StructuredLoss, make_targets

    model = build()
    first = example(model, torch.Generator().manual_seed(0))
    try:
        probe = copy.deepcopy(model).eval()  # eval: one forward must not move BatchNorm's running statistics
        with torch.no_grad():
            output = CallsWithBatch(probe)(first)
    except Exception as exc:  # noqa: BLE001 (user code: any failure is the batch not fitting the model)
        raise UsageError(f"{name} failed on the batch {describe(first)}: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}; give the inputs the model expects "
                         "(shape, dtype, one tensor per positional argument)") from None
    n = batch_size(first, "example batch")
    make_targets(output, n, None, loss)  # a loss that cannot be right for these outputs: one line, now
    inputs = UserInputs(lambda g: example(model, g), output, describe(first), loss)
    spec = ModelSpec(name, lambda: CallsWithBatch(build()), inputs, n, n, description or f"{name} on {describe(first)}",
                     paper=False, loss=StructuredLoss(loss))
    return register(spec, replace=True)

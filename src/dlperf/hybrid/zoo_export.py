"""Export a model (a zoo model by name, or any module with its example batch), then load the export back and
compare its output with the model's.

``dlperf export`` is :func:`export_zoo_model` (or :func:`export_model`) and :func:`check_export` with printing::

    done = export_zoo_model(ZooExportConfig("lenet", "out/lenet", batch=2))
    max_difference, matches = check_export(done)
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UsageError
from .export import CHECK_ATOL, CHECK_RTOL

__all__ = ["ZooExportConfig", "ZooExport", "export_zoo_model", "export_model", "check_export", "MAX_BATCH",
           "CHECK_RTOL", "CHECK_ATOL"]

MAX_BATCH = 2**24


@dataclass
class ZooExportConfig:
    """One export of a zoo model; checked when made, before any model is built or file written."""

    model: str
    """Zoo model name (dlperf.models.model_names())."""
    directory: str
    """Output directory (created; existing export files are replaced)."""
    batch: int = 2
    """Batch size of the example input (dimension 0 stays dynamic where the model allows)."""
    weights: str | None = None
    """A state_dict file saved with torch.save to load first; None keeps the random initialization."""
    seed: int = 0
    """Seed for the random initialization and the example input."""
    pt2: bool = False
    """Also write model.pt2 (the torch.export program)."""

    def __post_init__(self) -> None:
        from .._cliargs import batch_bytes, require_memory
        from ..models import get_spec

        spec = get_spec(self.model)  # a miss lists the zoo
        if self.batch < 1:
            raise UsageError(f"batch={self.batch}: expected >= 1")
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise UsageError(f"{self.directory!r} is not a directory; give a directory for the export files")
        require_memory(batch_bytes(spec, self.batch, training=False), f"batch={self.batch}",
                       "give a smaller batch")


@dataclass
class ZooExport:
    """A finished export: the model as exported, its example input, and the files written."""

    model: torch.nn.Module
    """The model, in eval mode, with the weights that were exported."""
    example: Any
    """The example input the export was traced with (a tensor, or a tuple of the forward's inputs)."""
    directory: str
    """Where the files are."""
    paths: dict[str, str]
    """Each written file by kind (graph, params, pt2)."""


def export_zoo_model(config: ZooExportConfig) -> ZooExport:
    """Build ``config.model`` (seeded, with ``config.weights`` if given) and export it into ``config.directory``."""
    from ..models import get_spec
    from .export import export

    spec = get_spec(config.model)
    torch.manual_seed(config.seed)
    model = spec.build().eval()
    if config.weights:
        _load_weights(model, config.weights, config.model)
    x, _ = spec.input.make_batch(config.batch, generator=torch.Generator().manual_seed(config.seed))
    paths = export(model, config.directory, (x,), pt2=config.pt2)
    return ZooExport(model, x, config.directory, paths)


def export_model(model: torch.nn.Module, example: Any, directory: str, *, pt2: bool = False) -> ZooExport:
    """Export any ``model`` traced on ``example`` (a tensor, or a tuple of its forward's positional inputs)."""
    from .export import export

    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError(f"{directory!r} is not a directory; give a directory for the export files")
    model = model.eval()
    inputs = example if isinstance(example, tuple) else (example,)
    paths = export(model, directory, inputs, pt2=pt2)
    return ZooExport(model, example, directory, paths)


def check_export(done: ZooExport) -> tuple[float, bool]:
    """Load the export back and run the example: (max absolute difference from the model, within tolerance).

    :func:`~dlperf.hybrid.export.export` made the same check before it wrote the files; this one reads what
    was written, and its difference is what ``dlperf export`` prints."""
    # the module, not the package's function of the same name; its load is looked up now, so it can be replaced
    export_module = importlib.import_module(".export", __package__)

    inputs = done.example if isinstance(done.example, tuple) else (done.example,)
    with torch.no_grad():
        got, want = export_module.load(done.directory)(*inputs), done.model(*inputs)
    return export_module.reproduces(got, want)


def _load_weights(model: torch.nn.Module, path: str, name: str) -> None:
    """Load a state_dict file into ``model``; a wrong file is a one-line UsageError."""
    from .._io import safe_torch_load

    # tensors in dicts only: nothing in the file may run code
    state = safe_torch_load(path, "weights", "a state_dict of tensors saved with torch.save")
    if not isinstance(state, dict):
        raise UsageError(f"weights={path!r}: holds a {type(state).__name__}, not a state_dict "
                         "(save model.state_dict())")
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        missing = sorted(set(model.state_dict()) - set(state))
        unexpected = sorted(set(state) - set(model.state_dict()))
        if missing or unexpected:
            detail = f"missing {_few(missing)}, unexpected {_few(unexpected)}"
        else:
            detail = "tensor shapes differ"
        raise UsageError(f"weights={path!r}: does not fit model {name!r}: {detail}") from exc


def _few(keys: list[str], n: int = 3) -> str:
    if not keys:
        return "none"
    shown = ", ".join(keys[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")

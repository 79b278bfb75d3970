"""What a hybridize backend is, and the registry that names them.

A backend turns a captured graph (see :mod:`dlperf.hybrid.capture`) into a *runner*: a callable
taking the same positional tensors as the module's forward. Backends differ in what they can
replay: some keep autograd (training), some are inference-only, some need a GPU.

>>> from dlperf.hybrid.backends import backend_names
>>> "graph" in backend_names()
True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...registry import Registry
from ..capture import Captured

Runner = Callable[..., object]


class BackendUnsupported(Exception):
    """This backend cannot replay this graph here; the message says why (shown by ``auto``)."""


@dataclass(frozen=True)
class Backend:
    """A named way to replay a captured graph.

    ``prepare(captured, example_args)`` returns a runner or raises :class:`BackendUnsupported`.
    """

    name: str
    prepare: Callable[[Captured, tuple], Runner]
    supports_grad: bool  # the runner's outputs carry autograd history, so training works
    devices: tuple[str, ...]  # device types it runs on ("cpu", "cuda")
    in_auto: bool  # tried by backend="auto" (backends with long compiles are opt-in)
    description: str
    runs_python: bool = False  # the runner executes forward's Python, side effects (print) included

    def unsupported_reason(self, device: torch.device, needs_grad: bool) -> str | None:
        """Why this backend cannot serve a call on ``device`` (None when it can)."""
        if device.type not in self.devices:
            return f"runs on {'/'.join(self.devices)}, not {device.type}"
        if needs_grad and not self.supports_grad:
            return "inference only (call under torch.no_grad() or torch.inference_mode())"
        return None


# "auto" is not a backend but a policy (try the in-auto backends, keep the fastest): reserved.
_BACKENDS: Registry[Backend] = Registry("hybridize backend", extra_choices=("auto",))


def register_backend(backend: Backend) -> Backend:
    """Add a backend under its name; names are unique."""
    _BACKENDS.register(backend.name, backend)
    return backend


def get_backend(name: str) -> Backend:
    """The backend called ``name``; a miss lists what exists."""
    _load_builtin()
    return _BACKENDS.get(name)


def backend_names() -> list[str]:
    """Registered backend names in registration order (``auto`` is not a backend but a policy)."""
    _load_builtin()
    return _BACKENDS.names()


def _load_builtin() -> None:
    # Imported here, not at module top, because each built-in module registers itself on import
    # and imports this module for the Backend class.
    from . import compiled, cuda_graphs, eager, graph, native  # noqa: F401

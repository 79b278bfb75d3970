"""What ``dlperf profile`` is pointed at: a model factory named ``module:attr``, and hardware figures.

:func:`build_model` imports and calls user code: only for a module the user named. :func:`read_hardware`
reads a JSON file of figures as data, with a size cap.
"""

from __future__ import annotations

import importlib
import os
import sys

from ..errors import UsageError

__all__ = ["load_factory", "build_model", "read_hardware", "MAX_HARDWARE_BYTES"]

MAX_HARDWARE_BYTES = 1 << 20


def read_hardware(source: str):
    """The :class:`~dlperf.probe.cost.Hardware` a ``--hardware`` value names; a bad file is one clear error."""
    import json

    from ..probe.cost import Hardware

    if source.startswith("seed:"):
        return Hardware.from_seed(source[5:])
    with open(source, "rb") as f:
        data = f.read(MAX_HARDWARE_BYTES + 1)
    if len(data) > MAX_HARDWARE_BYTES:
        raise UsageError(f"--hardware {source!r} is larger than {MAX_HARDWARE_BYTES} bytes; give a JSON file of "
                         "hardware figures (Hardware.from_probe's format)")

    def no_constant(name: str):
        raise ValueError(f"{name} is not a number")

    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=no_constant)
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"--hardware {source!r} is not valid JSON ({str(exc)[:80]}); give a JSON file of "
                         "hardware figures (Hardware.from_probe's format)") from None
    try:
        return Hardware.from_probe(doc)
    except UsageError as exc:
        raise UsageError(f"--hardware {source!r}: {exc}") from None


def load_factory(spec: str):
    """Import ``module:attr`` and return the attribute, which must be callable; errors say how to fix."""
    module_name, _, attr_path = spec.partition(":")
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise UsageError(f"no module named {module_name!r} (missing: {exc.name!r}); run from the directory that "
                             "holds it or add that directory to PYTHONPATH") from None
        raise UsageError(f"importing {module_name!r} failed: {exc}; install what it imports") from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 (user code: any failure at import is the module's)
        raise UsageError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}; fix the module (a script "
                         "that runs on import needs an `if __name__ == '__main__':` guard)") from None
    finally:
        if added and os.getcwd() in sys.path:
            sys.path.remove(os.getcwd())
    obj = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"module {module_name!r} has no attribute {attr_path!r}; name a function or class in it "
                             "that builds the model")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{spec!r} is a {type(obj).__name__}, not callable; name a function or class that "
                         "builds the model")
    return obj


def build_model(spec: str):
    from torch import nn

    factory = load_factory(spec)
    try:
        model = factory()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 (user code; sys.exit in a factory is a failure too)
        raise UsageError(f"{spec}() raised {type(exc).__name__}: {exc}; fix the factory, or name one that takes "
                         "no arguments") from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"{spec}() returned {type(model).__name__}, not a torch.nn.Module; return the model")
    return model

"""What ``dlperf profile`` is pointed at: a model factory named ``module:attr``, and hardware figures.

:func:`build_model` imports and calls user code: only for a module the user named. :func:`read_hardware`
reads a JSON file of figures as data, with a size cap.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

from .._cliargs import one_line
from .._io import decode_json
from ..errors import UsageError
from .cache import read_cache_file
from .reference import GBPS, GFLOPS, NS, PLAUSIBLE

__all__ = ["load_factory", "build_model", "read_hardware", "MAX_HARDWARE_BYTES"]

MAX_HARDWARE_BYTES = 1 << 20
_MAX_NAME = 200


def read_hardware(source: str):
    """The :class:`~dlperf.probe.cost.Hardware` a ``--hardware`` value names; a bad file is one clear error.

    Every figure must be one a machine can show (:data:`dlperf.probe.reference.PLAUSIBLE`): 0, 5e-324 or
    1e308 would give a floor of nothing or of forever. The name is shown with control characters escaped.
    """
    import dataclasses

    from .cost import Hardware

    if source.startswith("seed:"):
        return Hardware.from_seed(source[5:])
    try:
        data = read_cache_file(source, _bad_file, cache=False, max_bytes=MAX_HARDWARE_BYTES)
    except OSError as exc:
        raise _bad_file(source, f"cannot be read ({exc.strerror or exc})") from None
    doc = decode_json(data, source, _bad_file, allow_nan=False, unique_keys=True)
    if isinstance(doc, dict):
        _check_figures(doc, source)
    try:
        hardware = Hardware.from_probe(doc)
    except UsageError as exc:
        raise UsageError(f"hardware={source!r}: {exc}") from None
    return dataclasses.replace(hardware, name=one_line(hardware.name))


def _bad_file(source: str, problem: str) -> UsageError:
    return UsageError(f"hardware={source!r} is {problem}; give a JSON file of hardware figures "
                      "(Hardware.from_probe's format)")


# (the file's unit, the unit of PLAUSIBLE it is checked in, the factor from one to the other)
_SECONDS = ("seconds", NS, 1e9)
_BYTES_PER_S = ("bytes/s", GBPS, 1e-9)
_FLOP_PER_S = ("FLOP/s", GFLOPS, 1e-9)


def _check_figures(doc: dict, source: str) -> None:
    """Refuse, naming the field, a figure no machine shows (types and missing keys are from_probe's)."""
    name = doc.get("name")
    if isinstance(name, str) and len(name) > _MAX_NAME:
        raise UsageError(f"hardware={source!r}: 'name' is longer than {_MAX_NAME} characters; give a short name")
    fields: list[tuple[str, object, tuple[str, str, float], bool]] = [
        ("memory_bandwidth", doc.get("memory_bandwidth"), _BYTES_PER_S, False),
        ("dispatch_s", doc.get("dispatch_s"), _SECONDS, False)]
    flops = doc.get("flops")
    if isinstance(flops, dict):
        fields += [(f"flops[{one_line(repr(k))[:40]}]", v, _FLOP_PER_S, False) for k, v in flops.items()]
    links = doc.get("links")
    if isinstance(links, dict):
        for kind, spec in links.items():
            if isinstance(spec, dict):
                where = f"links[{one_line(repr(kind))[:40]}]"
                fields += [(f"{where}.alpha_s", spec.get("alpha_s"), _SECONDS, True),
                           (f"{where}.bandwidth", spec.get("bandwidth"), _BYTES_PER_S, False)]
    for key, value, (unit, plausible_unit, factor), zero_ok in fields:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue  # from_probe names it, with what it expects
        if zero_ok and value == 0:
            continue
        lo, hi = (bound / factor for bound in PLAUSIBLE[plausible_unit])
        if not lo <= value <= hi:
            raise UsageError(f"hardware={source!r}: {key} is {value!r} {unit}, outside what any machine shows "
                             f"({lo:g} to {hi:g} {unit}{' or 0' if zero_ok else ''}); fix the figure or measure it "
                             "again with `dlperf probe`")


def load_factory(spec: str):
    """Import ``module:attr`` and return the attribute, which must be callable; errors say how to fix."""
    module_name, _, attr_path = spec.partition(":")
    # the current directory first, as `python -m` puts it, and kept: processes started later (a plan's, a
    # launch's) unpickle the user's objects by their module, and spawned interpreters take this path list
    if os.getcwd() not in sys.path:
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
    problem = trainable_problem(model)
    if problem:
        raise UsageError(f"{spec}() built a model {problem}")
    return model


def trainable_problem(model) -> str | None:
    """Why ``model`` cannot train (``"with no parameters, ..."``), or None: every verb that builds a user's model
    trains it, and each of these would otherwise fail deep inside a step, or train nothing."""
    try:
        params = list(model.named_parameters())
        tensors = [*params, *model.named_buffers()]
        list(model.parameters())  # what optimizers and the Trainer call: a model may override it alone
    except Exception as exc:  # noqa: BLE001 (user code)
        text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        return (f"whose parameters() raised {type(exc).__name__}{': ' + text if text else ''}; fix the model's "
                "parameters() (nn.Module's own walks its layers)")
    import torch

    # (unless the caller builds on the meta device itself, to count a step's work without memory)
    meta = [name for name, t in tensors if t.is_meta] if torch.get_default_device().type != "meta" else []
    if meta:
        return (f"on the meta device ({', '.join(meta[:3])}{', ...' if len(meta) > 3 else ''}), whose tensors hold "
                "no values to train; build it on the CPU (or call to_empty() and load its weights) in the factory")
    if not params:
        return ("that has no trainable parameters (no parameters at all), so there is nothing to train; give a model "
                "with layers that have weights")
    if not any(p.requires_grad for _, p in params):
        return ("that has no trainable parameters (every one has requires_grad=False), so there is nothing to train; "
                "leave some trainable")
    return None

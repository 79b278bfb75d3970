"""Plain torch tensors (parameters, buffers, their gradients) used by engine operations.

``net(x)`` with an engine array ``x`` reads ``net.weight`` on a worker, and ``l.backward()`` writes
``net.weight.grad`` there; code outside the engine (a torch optimizer, ``state_dict``, an eager forward) would
otherwise see stale values. Each such tensor gets, per engine, a ``value`` and a ``grad`` variable, and while any
engine tracks tensors, global torch hooks make ``optimizer.step()``, module calls with plain tensors and
``state_dict``/``load_state_dict`` wait for the pending work they need. :func:`wait_for` waits explicitly. What
exactly is covered, and what it costs: docs/design/engine.md.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from .arguments import EngineArgumentError
from .var import Var

__all__ = ["External", "external", "wait_for", "watch", "hooks_installed", "release_unused_hooks"]


class External:
    """The engine variables of one plain tensor in one engine."""

    __slots__ = ("value", "grad", "__weakref__")

    def __init__(self) -> None:
        self.value = Var("tensor")
        self.grad = Var("grad")


# engine -> (tensor -> External). Weak both ways: neither keeps an engine or a tensor alive.
_TABLES: weakref.WeakKeyDictionary[Any, WeakIdKeyDictionary] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_handles: list[Any] = []
_watched: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# Bumped whenever a tensor starts being tracked: a module's cached list of tracked tensors is
# rebuilt when it is older. Most module calls then cost one dictionary lookup.
_generation = 0
_by_module: weakref.WeakKeyDictionary[nn.Module, tuple[int, list]] = weakref.WeakKeyDictionary()
_UNUSED_CHECK_EVERY = 1024  # module calls between checks whether the hooks can go
_calls_until_check = _UNUSED_CHECK_EVERY


def external(engine: Any, tensor: torch.Tensor) -> External:
    """The variables of ``tensor`` in ``engine``, created on first use (installs the hooks)."""
    table = _TABLES.get(engine)
    if table is None:
        with _LOCK:
            table = _TABLES.get(engine)
            if table is None:
                table = _TABLES[engine] = WeakIdKeyDictionary()
    ext = table.get(tensor)
    if ext is None:
        global _generation
        ext = table[tensor] = External()
        _generation += 1
        if not _handles:
            _install()
    return ext


def hooks_installed() -> bool:
    """Whether the global torch hooks are in place (some open engine tracks a tensor)."""
    return bool(_handles)


def _idle(var: Var) -> bool:
    # Read without the engine's lock, as a hint: only the pushing thread makes a variable busy, so
    # "idle" seen here stays true until it pushes again; a stale "busy" costs one needless wait.
    return not var._writing and not var._readers and not var._queue and var._bulk_write is None


def _settle(engine: Any, ext: External, write: bool) -> None:
    try:
        if not _idle(ext.grad) or ext.grad.exc is not None:
            engine.wait_to_read(ext.grad)
        if write:
            if not _idle(ext.value):
                engine.wait_to_write(ext.value)
        elif not _idle(ext.value) or ext.value.exc is not None:
            engine.wait_to_read(ext.value)
        if ext.value.exc is not None:
            engine.wait_to_read(ext.value)  # raises it
    except BaseException:
        # Reported now; later operations on this tensor must not be skipped for it.
        ext.value, ext.grad = Var("tensor"), Var("grad")
        raise


def wait_for(tensors: Iterable[torch.Tensor] | nn.Module, *, write: bool = True) -> None:
    """Block until no pending engine operation uses these tensors (or a module's tensors).

    ``write=False`` waits only for pending writes (enough to read the values). Raises the error
    of a failed operation that wrote one of them, once.
    """
    checked = _checked_tensors(tensors)
    if not isinstance(write, bool):
        raise EngineArgumentError(f"wait_for: write={write!r:.60} is not a bool; expected True (wait for reads "
                                  "and writes) or False (only writes)")
    _wait_for(checked, write)


def _wait_for(tensors: list[torch.Tensor], write: bool) -> None:
    for engine, table in list(_TABLES.items()):
        if engine.closed or not len(table) or engine._running_ops():
            continue  # inside one of its operations, the engine's own ordering applies
        for t in tensors:
            ext = table.get(t)
            if ext is not None:
                _settle(engine, ext, write)


def _checked_tensors(tensors: Any) -> list[torch.Tensor]:
    if isinstance(tensors, nn.Module):
        return _module_tensors(tensors)
    if isinstance(tensors, torch.Tensor):  # iterating it would give its rows, which nothing tracks
        raise EngineArgumentError("wait_for: tensors is one tensor; expected a list of tensors or a module, "
                                  "e.g. wait_for([p])")
    try:
        out = list(tensors)
    except TypeError:
        raise EngineArgumentError(f"wait_for: tensors is {type(tensors).__name__}; expected a list of tensors or a "
                                  "module") from None
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise EngineArgumentError(f"wait_for: tensors[{i}] is {type(t).__name__} {t!r:.60}; expected a "
                                      "torch.Tensor")
    return out


def _module_tensors(module: nn.Module, recurse: bool = True) -> list[torch.Tensor]:
    return [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]


def _any_tracked() -> bool:
    for engine, table in list(_TABLES.items()):
        if engine.closed:
            _TABLES.pop(engine, None)  # nothing of a closed engine is pending
        elif len(table):
            return True
    return False


# --------------------------------------------------------------------------- global hooks
def _install() -> None:
    with _LOCK:
        if _handles:
            return
        _handles.extend([
            register_optimizer_step_pre_hook(_before_step),
            nn.modules.module.register_module_forward_pre_hook(_before_forward),
            nn.modules.module.register_module_forward_hook(_after_forward),
        ])


def release_unused_hooks() -> bool:
    """Remove the global torch hooks now if no engine tracks a tensor any more; whether they went.

    They go lazily otherwise, at a module call or optimizer step that finds nothing tracked: a caller
    that refuses to run under global hooks (a captured training step) asks first."""
    if _any_tracked():
        return False
    with _LOCK:
        for h in _handles:
            h.remove()
        _handles.clear()
    return True


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if release_unused_hooks():
        return
    _wait_for([p for group in optimizer.param_groups for p in group["params"]], True)


_array_type: type | None = None  # set by dlperf.engine.ndarray, which defines it (and imports this module)


def register_array_type(cls: type) -> None:
    """Make the hooks here recognise ``cls`` as the engine array (its module calls this once).

    The hooks compare types by identity, the cheapest test on a path every module call in the
    process takes; before any array class exists, no call can hold an array.
    """
    global _array_type
    _array_type = cls


def _holds_array(values: Any) -> bool:
    array_type = _array_type
    if array_type is None:
        return False
    for v in values:
        if type(v) is array_type:
            return True
    return False


def _tracked_in(module: nn.Module) -> list[tuple[Any, External]]:
    """(engine reference, variables) of the module's own tracked tensors, cached per generation."""
    entry = _by_module.get(module)
    if entry is not None and entry[0] == _generation:
        return entry[1]
    found = []
    tensors = _module_tensors(module, recurse=False)
    for engine, table in list(_TABLES.items()):
        for t in tensors:
            ext = table.get(t)
            if ext is not None:
                found.append((weakref.ref(engine), ext))
    _by_module[module] = (_generation, found)
    return found


def _before_forward(module: nn.Module, args: tuple) -> None:
    global _calls_until_check
    if _holds_array(args):
        return  # the engine orders this call's operations itself
    tracked = _tracked_in(module)  # direct tensors only: each submodule's own call checks its own
    if not tracked:
        _calls_until_check -= 1
        if _calls_until_check <= 0:
            _calls_until_check = _UNUSED_CHECK_EVERY
            release_unused_hooks()
        return
    live = False
    for engine_ref, ext in tracked:
        engine = engine_ref()
        if engine is None or engine.closed:
            continue
        live = True
        if _idle(ext.value) and _idle(ext.grad) and ext.value.exc is None and ext.grad.exc is None:
            continue
        if not engine._running_ops():  # inside one of its operations, the engine's own ordering applies
            _settle(engine, ext, True)
    if not live:  # its engines are closed: forget them here, and drop the hooks if nothing else needs them
        _by_module[module] = (_generation, [])
        release_unused_hooks()


def _after_forward(module: nn.Module, args: tuple, output: Any) -> None:
    # Registered after the call, so the very first call with engine arrays is covered too (the
    # hooks were installed while it ran).
    if module not in _watched and _holds_array(args):
        watch(module)


def watch(module: nn.Module) -> None:
    """Make ``state_dict``/``load_state_dict`` of ``module`` and its submodules wait for engine work.

    Done automatically for modules called with engine arrays through ``nn.Module.__call__``;
    wrappers that bypass it (a hybridized module is one engine operation) call this.
    """
    for m in module.modules():
        if m in _watched:
            continue
        _watched.add(m)
        m.register_state_dict_pre_hook(_before_state_dict)
        m.register_load_state_dict_pre_hook(_before_load_state_dict)


def _before_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    _wait_for(_module_tensors(module), True)


def _before_load_state_dict(module: nn.Module, *args: Any) -> None:
    _wait_for(_module_tensors(module), True)

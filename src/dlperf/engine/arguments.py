"""Checks of what callers pass to the engine's public calls: one error naming the call, the
argument, what was given and what is expected.

The array frontend and the engines themselves push through unchecked internal paths (they build
their arguments), so these checks cost only calls made from outside.
"""

from __future__ import annotations

import operator
from typing import Any

from .._cliargs import short_repr
from ..errors import UsageError
from .var import Op, Var

__all__ = ["EngineArgumentError", "as_var", "as_vars", "check_count", "check_callable", "check_priority"]


class EngineArgumentError(UsageError, TypeError):
    """An engine call got an argument of the wrong type or value (a ``ValueError`` and a ``TypeError``).

    >>> from dlperf.engine import create_engine
    >>> with create_engine("naive") as eng:
    ...     eng.push(print, writes=["x"])
    Traceback (most recent call last):
    ...
    dlperf.engine.arguments.EngineArgumentError: push: writes[0] is str 'x'; expected an engine variable \
(engine.new_var()) or an engine array
    """


def _given(value: Any) -> str:
    """The value with its type's name in front, unless its repr starts with it: ``str 'x'``, ``Device(...)``."""
    text, kind = short_repr(value), type(value).__name__
    return text if text.startswith(kind) else f"{kind} {text}"


def as_var(call: str, arg: str, value: Any, engine: Any = None) -> Var:
    """The engine variable ``value`` stands for: itself, or an engine array's (of ``engine``, if given)."""
    if isinstance(value, Var):
        return value
    var = getattr(value, "_var", None) if not isinstance(value, type) else None
    if isinstance(var, Var):
        owner = getattr(value, "engine", None)
        if engine is not None and owner is not engine:
            raise EngineArgumentError(f"{call}: {arg} is an array of another engine; copy it into this one with "
                                      "array(x.tensor(), engine=...) first")
        return var
    if isinstance(value, Op):
        raise EngineArgumentError(f"{call}: {arg} is an operation handle ({value!r}); pass a variable it writes, "
                                  "or wait for the operation with op.wait()")
    raise EngineArgumentError(f"{call}: {arg} is {_given(value)}; expected an engine variable (engine.new_var()) "
                              "or an engine array")


def as_vars(call: str, arg: str, value: Any, engine: Any = None) -> tuple[Var, ...]:
    """``value`` (a list, tuple or other iterable of variables and arrays) as a tuple of variables."""
    if isinstance(value, (str, bytes, Var, Op)) or isinstance(getattr(value, "_var", None), Var):
        raise EngineArgumentError(f"{call}: {arg} is {_given(value)}, not a collection; expected an iterable of "
                                  f"engine variables or arrays, e.g. {arg}=[v]")
    try:
        items = tuple(value)
    except TypeError:
        raise EngineArgumentError(f"{call}: {arg} is {_given(value)}, not iterable; expected an iterable of engine "
                                  f"variables or arrays, e.g. {arg}=[v]") from None
    for item in items:
        if type(item) is not Var:
            return tuple(as_var(call, f"{arg}[{j}]", v, engine) for j, v in enumerate(items))
    return items


def check_count(call: str, arg: str, value: Any, low: int = 1, *, also: str = "") -> int:
    """``value`` if it is an integer (not a bool) of at least ``low``; ``also`` ends the expectation
    in the message (``" or None"``, ``" (0: off)"``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise EngineArgumentError(f"{call}: {arg}={_given(value)} is not an integer; expected an integer >= "
                                  f"{low}{also}")
    if value < low:
        raise EngineArgumentError(f"{call}: {arg}={value} is too small; expected an integer >= {low}{also}")
    return value


def check_callable(call: str, arg: str, value: Any, example: str) -> None:
    """Raise unless ``value`` can be called."""
    if not callable(value):
        raise EngineArgumentError(f"{call}: {arg} is {_given(value)}, which cannot be called; expected a function, "
                                  f"e.g. {example}")


def check_priority(call: str, value: Any) -> int:
    """``value`` as an int priority (any integer type but bool)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise EngineArgumentError(f"{call}: priority={_given(value)} is not an integer; expected an integer "
                              "(higher runs first among ready operations, default 0)")

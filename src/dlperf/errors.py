"""Exceptions that carry a message meant for the user.

The CLI prints these as one line and exits with status 2; library callers catch them like any
``ValueError``/``RuntimeError``.
"""

from __future__ import annotations

from collections.abc import Iterable


class DlperfError(Exception):
    """Base class: the message says which value was wrong, what was expected and how to fix it."""


class UsageError(DlperfError, ValueError):
    """A value given by the user is not one of the valid choices."""


class ShapeError(UsageError, RuntimeError):
    """An operation asks for a shape its operands cannot have (a ``ValueError`` as in NumPy, a
    ``RuntimeError`` as in torch and MXNet)."""


class DeviceUnavailableError(DlperfError, RuntimeError):
    """A device was requested that this machine does not have."""


class DeviceMismatchError(DlperfError, RuntimeError):
    """Operands of one operation live on different devices."""


def unknown_choice(what: str, value: object, choices: Iterable[str]) -> UsageError:
    """Build the one-line error for a lookup miss, listing what exists."""
    valid = ", ".join(choices)
    return UsageError(f"unknown {what} {value!r}; valid choices: {valid}")

"""Exceptions that carry a message meant for the user.

The CLI prints these as one line and exits with status 2; library callers catch them like any
``ValueError``/``RuntimeError``.
"""

from __future__ import annotations

import signal
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


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in a dlperf command's main thread as Ctrl-C raises KeyboardInterrupt: whatever
    a Ctrl-C stops and removes (processes started, temporary directories) a termination stops and removes too,
    and finished work is kept. The command then says ``stopped by SIGTERM`` and exits 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = int(signum)

    @property
    def status(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}"


def stop_status(exc: KeyboardInterrupt) -> tuple[str, int]:
    """(what a command says, its exit status) when ``exc`` stopped it: Ctrl-C is "interrupted", 130."""
    return (str(exc), exc.status) if isinstance(exc, Terminated) else ("interrupted", 130)


def unknown_choice(what: str, value: object, choices: Iterable[str]) -> UsageError:
    """Build the one-line error for a lookup miss, listing what exists."""
    valid = ", ".join(choices)
    return UsageError(f"unknown {what} {value!r}; valid choices: {valid}")


# --- failures of the user's own code ----------------------------------------------------------------------

_USER_CALL = "_dlperf_user_call"


def blame_user_code(exc: BaseException, call: str, fix: str) -> None:
    """Note on ``exc`` that the user's code raised it inside ``call`` (``"LeNet(float32[8,3,32,32])"``).

    The exception itself goes on unchanged (its type is what a library caller catches, and what a plan's
    fallback tells apart); :func:`user_code_line` makes the one line the CLI prints of it. The innermost
    call that notes an exception names it; dlperf's own errors are not the user's code's.
    """
    if isinstance(exc, DlperfError) or hasattr(exc, _USER_CALL):
        return
    try:
        setattr(exc, _USER_CALL, (call, fix))
    except AttributeError:  # an exception type that takes no attributes stays a traceback
        pass


def user_code_line(exc: BaseException) -> str | None:
    """One line for an exception the user's model, loss or data raised (None for any other): the call, what it
    raised and the fix."""
    noted = getattr(exc, _USER_CALL, None)
    if noted is None:
        return None
    call, fix = noted
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    first = first if len(first) <= 300 else first[:297] + "..."
    return f"{call} raised {type(exc).__name__}{': ' + first if first else ''}; {fix}"

"""The one registry: names that map to things (models, backends, store types, step builders).

Every table of named choices in dlperf is a :class:`Registry`, so they all behave alike: a name is
registered once (a second registration is a mistake unless it says ``replace=True``), names keep
their registration order, and a miss raises one line listing what exists
(:func:`dlperf.errors.unknown_choice`), which the CLI prints as is.

An entry may be a ``"package.module:attribute"`` string: the module is imported on the first
:meth:`Registry.get` of that name, and the attribute then replaces the string. That keeps heavy or
circular imports (a step builder that needs the compiler) out of the import of the registry's owner.

>>> steps = Registry("mode")
>>> steps.register("eager", print)
>>> steps.register("joined", "os.path:join")   # imported on first use
>>> steps.get("joined")("a", "b")
'a/b'
>>> steps.get("compiled")
Traceback (most recent call last):
  ...
dlperf.errors.UsageError: unknown mode 'compiled'; valid choices: eager, joined
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from .errors import unknown_choice

__all__ = ["Registry"]

T = TypeVar("T")

_LAZY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class Registry(Generic[T]):
    """Named entries of one kind, in registration order.

    ``what`` names the kind in messages (``"network"``, ``"kvstore type"``). ``normalize`` maps a
    looked-up name to its registered form (e.g. ``str.lower`` for case-insensitive names); the
    message of a miss still shows the name as given. ``extra_choices`` are names accepted elsewhere
    (a policy such as ``"auto"``) that a miss lists before the registered ones; they cannot be
    registered.
    """

    def __init__(self, what: str, *, normalize: Callable[[str], str] | None = None,
                 extra_choices: tuple[str, ...] = ()) -> None:
        self.what = what
        self._normalize = normalize
        self._extra = tuple(extra_choices)
        self._entries: dict[str, T | str] = {}
        # Two threads resolving one lazy entry import it once; reentrant because the imported module
        # may register further entries here.
        self._lock = threading.RLock()

    def register(self, name: str, obj: T | str, *, replace: bool = False) -> None:
        """Add ``obj`` under ``name``; a name already taken raises unless ``replace=True``.

        A string ``"module:attr"`` is a lazy entry, imported on first :meth:`get`.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.what} name must be a non-empty string, got {name!r}")
        if isinstance(obj, str) and not _LAZY.fullmatch(obj):
            raise ValueError(f"lazy {self.what} entry {obj!r} is not of the form 'package.module:attribute'")
        with self._lock:
            if name in self._extra or (name in self._entries and not replace):
                raise ValueError(f"{self.what} {name!r} is registered twice (pass replace=True to replace it)"
                                 if name in self._entries else f"{self.what} name {name!r} is reserved")
            self._entries[name] = obj

    def remove(self, name: str) -> None:
        """Forget ``name`` (a no-op when it is not registered): for tests that register doubles."""
        with self._lock:
            self._entries.pop(name, None)

    def get(self, name: str) -> T:
        """The entry called ``name`` (resolving a lazy one); a miss raises one line listing what exists."""
        key = self._key(name)
        if key is None or key not in self._entries:
            raise unknown_choice(self.what, name, self.choices())
        entry = self._entries[key]
        if isinstance(entry, str):
            entry = self._resolve(key)
        return entry

    def _resolve(self, key: str) -> T:
        with self._lock:
            entry = self._entries[key]
            if isinstance(entry, str):  # another thread may have resolved it while we waited
                module, _, attr = entry.partition(":")
                entry = getattr(importlib.import_module(module), attr)
                self._entries[key] = entry
        return entry

    def _key(self, name: object) -> str | None:
        """The registered form of ``name``; None for anything but a string, which names no entry."""
        if not isinstance(name, str):
            return None
        return self._normalize(name) if self._normalize is not None else name

    def names(self) -> list[str]:
        """Registered names in registration order (``extra_choices`` excluded)."""
        return list(self._entries)

    def choices(self) -> list[str]:
        """What a caller may name: ``extra_choices`` then the registered names."""
        return [*self._extra, *self._entries]

    def items(self) -> list[tuple[str, T]]:
        """``(name, entry)`` pairs in registration order, lazy entries resolved."""
        return [(name, self.get(name)) for name in self.names()]

    def __contains__(self, name: object) -> bool:
        key = self._key(name)
        return key is not None and key in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(self._entries)})"

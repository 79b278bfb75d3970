"""The KVStore a store-based strategy talks to: opened from a type name or taken as given, bound to the engine."""

from __future__ import annotations

from ...kvstore import KVStore, create_kvstore
from .context import StepContext

__all__ = ["BoundStore"]


class BoundStore:
    """A store whose asynchronous calls run on the trainer's engine; closed on :meth:`close` if opened here."""

    def __init__(self, option: str | KVStore) -> None:
        self.option = option
        self._kv: KVStore | None = None
        self.owned = isinstance(option, str)

    @property
    def kv(self) -> KVStore:
        """The store (opened by :meth:`open` or :meth:`adopt`)."""
        if self._kv is None:
            raise RuntimeError("the kvstore is not open yet")
        return self._kv

    def adopt(self, kv: KVStore) -> None:
        """Use ``kv``, already opened (a distributed store is opened with the processes)."""
        self._kv = kv

    def open(self, ctx: StepContext) -> KVStore:
        """Open the store (unless adopted) and run its asynchronous calls on the first communication lane."""
        if self._kv is None:
            self._kv = create_kvstore(self.option) if isinstance(self.option, str) else self.option
        self._kv.bind_engine(ctx.engine, ctx.lanes.lanes[0], ctx.lanes.kind)
        return self._kv

    def close(self) -> None:
        """Close a store opened here; unbind one the caller passed in."""
        kv, self._kv = self._kv, None
        if kv is None:
            return
        if self.owned:
            kv.close()
        else:
            kv.bind_engine(None)

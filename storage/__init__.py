"""Where rollout state lives: the `Store` protocol, an in-memory store, and a durable LMDB store.

    store = open_store("lmdb", "/data/run-7/rollout")   # or open_store("memory", None)
    async_store = AsyncStore(store)                      # what the stages use
"""

from __future__ import annotations

import os
from typing import Any

from .async_store import AsyncStore
from .lmdb_store import LmdbStore
from .memory import MemoryStore
from .protocol import Cursor, GroupState, RecoveryReport, RunMeta, Store, StoreStatistics

__all__ = [
    "AsyncStore",
    "Cursor",
    "GroupState",
    "LmdbStore",
    "MemoryStore",
    "RecoveryReport",
    "RunMeta",
    "Store",
    "StoreStatistics",
    "open_store",
]

TRANSPORTS = ("memory", "lmdb")


def open_store(transport: str, path: str | os.PathLike[str] | None, **kw: Any) -> Store:
    """The store for `--rollout-data-transport`: "memory" (path unused) or "lmdb" (path required).

    Keyword arguments go to `LmdbStore` (map_size, sync, readonly); the memory store takes none.
    """
    if transport == "memory":
        if kw:
            raise ValueError(f"the memory store takes no options, got {sorted(kw)}")
        return MemoryStore()
    if transport == "lmdb":
        if path is None:
            raise ValueError("the lmdb store needs a directory path, got None")
        return LmdbStore(path, **kw)
    raise ValueError(f"unknown rollout data transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")

"""Where rollout state lives: the `Store` protocol, an in-memory store, and a durable LMDB store.

plan = check_storage("/data/run-7/rollout")          # refuses an undeclared network filesystem
store = open_store("lmdb", "/data/run-7/rollout", **plan.store_options())  # or open_store("memory", None)
async_store = AsyncStore(store)                      # what the stages use
"""

from __future__ import annotations

import os
from typing import Any

from core.types import StoreTransport

from .async_store import AsyncStore
from .declaration import PROFILES, StorageDeclaration, StoragePlan, check_storage, load_declaration
from .history import GroupOutcome, PromptHistory
from .lmdb_store import LmdbStore
from .memory import MemoryStore
from .protocol import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_OWNER,
    Coverage,
    Cursor,
    GroupState,
    Lease,
    RecoveryReport,
    RunMeta,
    Store,
    StoreStatistics,
    VerifyReport,
)
from .salvage import Salvage, salvage_store, unreadable_reason
from .transitions import requeue_id

__all__ = [
    "DEFAULT_LEASE_SECONDS",
    "DEFAULT_OWNER",
    "PROFILES",
    "AsyncStore",
    "Coverage",
    "Cursor",
    "GroupOutcome",
    "GroupState",
    "Lease",
    "LmdbStore",
    "MemoryStore",
    "PromptHistory",
    "RecoveryReport",
    "RunMeta",
    "Salvage",
    "StorageDeclaration",
    "StoragePlan",
    "Store",
    "StoreStatistics",
    "VerifyReport",
    "check_storage",
    "load_declaration",
    "open_store",
    "requeue_id",
    "salvage_store",
    "unreadable_reason",
]

TRANSPORTS = tuple(StoreTransport)  # the one spelling is core.types.StoreTransport


def open_store(transport: StoreTransport | str, path: str | os.PathLike[str] | None, **kw: Any) -> Store:
    """The store for `--rollout-data-transport`: "memory" (path unused) or "lmdb" (path required).

    Keyword arguments go to `LmdbStore` (map_size, sync, readonly, clock); the memory store takes
    only `clock`.
    """
    if transport == StoreTransport.MEMORY:
        if set(kw) - {"clock"}:
            raise ValueError(f"the memory store takes no options but clock, got {sorted(kw)}")
        return MemoryStore(**kw)
    if transport == StoreTransport.LMDB:
        if path is None:
            raise ValueError("the lmdb store needs a directory path, got None")
        return LmdbStore(path, **kw)
    raise ValueError(f"unknown rollout data transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")

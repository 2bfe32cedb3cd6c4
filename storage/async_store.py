"""`AsyncStore`: the `Store` methods as `async def`, for stages running on the event loop.

An LMDB transaction can wait on a disk (fsync), so `AsyncStore` runs every call of a blocking store
in a worker thread, one call at a time (a `CapacityLimiter(1)`): the store sees a single writer,
and its transactions never overlap. The memory store never blocks, so its calls run inline.

Cancellation: a call that has started runs to the end. The worker thread is never abandoned (a
transaction half-seen by its caller would lose work, e.g. groups claimed but never received), and
the cancellation is delivered at the caller's next checkpoint. A call cancelled before it starts
does nothing.

Lease arguments are passed on only when given, so a store written against the older signatures
(`admit(groups, cursor)`, `put_ready(group)`) keeps working behind `AsyncStore`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from pipeline.types import Batch, Group

from .memory import MemoryStore
from .protocol import Cursor, GroupState, Lease, RecoveryReport, RunMeta, Store, StoreStatistics

__all__ = ["AsyncStore"]

T = TypeVar("T")

_CLOSE_DEADLINE_S = 30.0


class AsyncStore:
    """A `Store` for async code: every call runs on one worker thread, so the store stays single-writer
    and the event loop never blocks on a transaction."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._inline = isinstance(store, MemoryStore)
        self._limiter = anyio.CapacityLimiter(1)

    @property
    def store(self) -> Store:
        """The synchronous store underneath (for code that already runs off the event loop)."""
        return self._store

    async def _call(self, fn: Callable[..., T], *args: object, **kwargs: Any) -> T:
        if kwargs:
            return await self._call(lambda: fn(*args, **kwargs))
        if self._inline:
            # A checkpoint before, never after: a caller cancelled here loses nothing.
            await anyio.lowlevel.checkpoint()
            return fn(*args)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def read_meta(self) -> RunMeta | None:
        return await self._call(self._store.read_meta)

    async def write_meta(self, meta: RunMeta) -> None:
        await self._call(self._store.write_meta, meta)

    async def cursor(self) -> Cursor:
        return await self._call(self._store.cursor)

    async def admit(
        self, groups: Sequence[Group], cursor: Cursor, *, owner: str | None = None, lease_seconds: float | None = None
    ) -> None:
        await self._call(self._store.admit, groups, cursor, **_given(owner=owner, lease_seconds=lease_seconds))

    async def claim_partial(
        self, limit: int, *, owner: str | None = None, lease_seconds: float | None = None
    ) -> list[Group]:
        return await self._call(self._store.claim_partial, limit, **_given(owner=owner, lease_seconds=lease_seconds))

    async def put_partial(self, group: Group, *, owner: str | None = None) -> None:
        await self._call(self._store.put_partial, group, **_given(owner=owner))

    async def put_ready(self, group: Group, *, owner: str | None = None) -> None:
        await self._call(self._store.put_ready, group, **_given(owner=owner))

    async def put_rejected(self, group: Group, *, owner: str | None = None) -> None:
        await self._call(self._store.put_rejected, group, **_given(owner=owner))

    async def put_failed(self, group: Group, *, owner: str | None = None) -> None:
        await self._call(self._store.put_failed, group, **_given(owner=owner))

    async def lease(self, group_id: str) -> Lease | None:
        return await self._call(self._store.lease, group_id)

    async def renew_leases(self, owner: str, lease_seconds: float) -> int:
        return await self._call(self._store.renew_leases, owner, lease_seconds)

    async def hand_over(self, group_id: str, *, owner: str, to: str, lease_seconds: float) -> None:
        await self._call(self._store.hand_over, group_id, owner=owner, to=to, lease_seconds=lease_seconds)

    async def reclaim_expired(self, now: float | None = None) -> int:
        return await self._call(self._store.reclaim_expired, now)

    async def collect_garbage(self, up_to_step: int) -> int:
        return await self._call(self._store.collect_garbage, up_to_step)

    async def take_batch(self, step: int, size: int) -> Batch | None:
        return await self._call(self._store.take_batch, step, size)

    async def finish_batch(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        await self._call(self._store.finish_batch, step, metrics)

    async def step_metrics(self, first: int = 0) -> dict[int, dict[str, Any]]:
        return await self._call(self._store.step_metrics, first)

    async def trained_step(self) -> int:
        return await self._call(self._store.trained_step)

    async def recover(self) -> RecoveryReport:
        return await self._call(self._store.recover)

    async def count(self, state: GroupState) -> int:
        return await self._call(self._store.count, state)

    async def get(self, group_id: str) -> tuple[GroupState, Group] | None:
        return await self._call(self._store.get, group_id)

    async def groups(self, state: GroupState) -> list[Group]:
        """A snapshot list (an iterator would read the store lazily from the event loop)."""
        return await self._call(lambda: list(self._store.groups(state)))

    async def batch(self, step: int) -> Batch | None:
        return await self._call(self._store.batch, step)

    def statistics(self) -> StoreStatistics:
        """Synchronous: a writing store answers from memory, without a transaction."""
        return self._store.statistics()

    async def aclose(self) -> None:
        """Closes the store after any call in flight; runs even if the caller is being cancelled."""
        with anyio.move_on_after(_CLOSE_DEADLINE_S, shield=True):
            await self._call(self._store.close)

    async def __aenter__(self) -> AsyncStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _given(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}

"""The collector: puts accepted groups in the ready set, where the trainer bridge takes batches.

It keeps at most `capacity` (demand + prefetch) ready groups ahead of the trainer: when the ready
set is full it stops receiving, its input stream fills, and generation slows down behind it. That
bound is the only brake on producers in async mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from pipeline.types import Group
from stages.admission import Admission, Outcome
from storage import AsyncStore, GroupState

__all__ = ["Collector", "CollectorStatistics"]


@dataclass(frozen=True, slots=True)
class CollectorStatistics:
    collected: int
    ready: int
    capacity: float  # math.inf once unbound


class Collector:
    def __init__(
        self,
        *,
        store: AsyncStore,
        admission: Admission,
        capacity: float,
        on_ready: Callable[[str], None] | None = None,
    ) -> None:
        self._store = store
        self._admission = admission
        self._capacity = capacity
        self._on_ready = on_ready
        self._collected = 0
        self._ready = 0
        self._taken = anyio.Event()
        self._added = anyio.Event()

    async def run(self, receive: MemoryObjectReceiveStream[Group], *, task_status: TaskStatus[None]) -> None:
        self._ready = await self._store.count(GroupState.READY)
        task_status.started()
        async with receive:
            async for group in receive:
                while self._ready >= self._capacity:
                    await self._taken.wait()
                await self._store.put_ready(group)
                self._ready += 1
                self._collected += 1
                self._admission.settle(Outcome.READY)
                if self._on_ready is not None:
                    self._on_ready(group.group_id)
                self._added.set()
                self._added = anyio.Event()

    async def wait_ready(self, n: int) -> None:
        """Wait until at least `n` groups are ready."""
        while self._ready < n:
            await self._added.wait()

    def taken(self, n: int) -> None:
        """The trainer bridge took `n` ready groups: room for more."""
        self._ready -= n
        self._taken.set()
        self._taken = anyio.Event()

    def unbound(self) -> None:
        """Lift the bound, for the end of a run: nothing takes batches any more, and groups that
        finish while the pool drains must still land as ready instead of waiting for room forever."""
        self._capacity = math.inf
        self._taken.set()
        self._taken = anyio.Event()

    @property
    def ready(self) -> int:
        return self._ready

    def statistics(self) -> CollectorStatistics:
        return CollectorStatistics(self._collected, self._ready, self._capacity)

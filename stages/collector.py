"""The collector: puts accepted groups in the ready set, where the trainer bridge takes batches.

It keeps at most `capacity` (demand + prefetch) ready groups ahead of the trainer: when the ready
set is full it stops receiving, its input stream fills, and generation slows down behind it. That
bound is the only brake on producers in async mode.

Groups that are already waiting when it receives one are stored with it in one store call (up to
`batch`, and never past the bound): one transaction for all of them, never a wait for more.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from core.types import Group
from stages.admission import Admission, Outcome
from stages.store_ports import CollectorStore
from stages.streams import drain_nowait
from storage import GroupState

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
        store: CollectorStore,
        admission: Admission,
        capacity: float,
        on_ready: Callable[[str], None] | None = None,
        batch: int = 1,
    ) -> None:
        """`batch`: the most groups stored in one store call, of those already waiting."""
        if batch < 1:
            raise ValueError(f"the collector's batch is at least 1 group, got {batch}")
        self._batch = batch
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
                # With the group in hand, whatever else is already waiting goes into the same
                # store call, as far as the bound leaves room; never wait for more to come.
                room = min(self._batch, self._capacity - self._ready)
                groups = [group, *drain_nowait(receive, int(room) - 1)]
                await self._store.put_ready_groups(groups)
                self._ready += len(groups)
                self._collected += len(groups)
                for g in groups:
                    self._admission.settle(Outcome.READY)
                    if self._on_ready is not None:
                        self._on_ready(g.group_id)
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

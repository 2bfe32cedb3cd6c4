"""The dispenser: decides which group generates next, one admission ticket at a time.

Partial groups come first (the store serves them oldest token version first, then FIFO), then new
prompts from the dataset cursor. Taking a new prompt and moving the cursor is one store transaction,
so a crash can neither skip nor repeat a prompt. Nothing is admitted while the clock publishes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from pipeline.clock import VersionClock
from pipeline.types import Group, PromptTask
from stages.admission import Admission
from storage import AsyncStore, Cursor

__all__ = ["Dispenser", "DispenserStatistics"]


@dataclass(frozen=True, slots=True)
class DispenserStatistics:
    new_groups: int
    resumed_groups: int
    cursor: Cursor


class Dispenser:
    def __init__(
        self,
        store: AsyncStore,
        dataset: Sequence[PromptTask],
        *,
        n_samples: int,
        clock: VersionClock,
        admission: Admission,
        on_admit: Callable[[str], None] | None = None,
    ) -> None:
        if not dataset:
            raise ValueError("the dataset is empty: there is nothing to generate")
        self._store = store
        self._dataset = dataset
        self._n_samples = n_samples
        self._clock = clock
        self._admission = admission
        self._on_admit = on_admit
        self._cursor: Cursor | None = None
        self._new = 0
        self._resumed = 0

    async def run(self, send: MemoryObjectSendStream[Group], *, task_status: TaskStatus[None]) -> None:
        self._cursor = await self._store.cursor()
        task_status.started()
        async with send:
            while True:
                await self._admission.take_ticket()
                version = await self._clock.wait_serving()
                group = await self._next_group(version)
                if self._on_admit is not None:
                    self._on_admit(group.group_id)
                try:
                    await send.send(group)
                except anyio.BrokenResourceError:
                    # The pool is gone: the pipeline is going down for another reason. The group
                    # stays RUNNING in the store, and a restart brings it back as partial.
                    return

    async def _next_group(self, version: int) -> Group:
        resumed = await self._store.claim_partial(1)
        if resumed:
            self._resumed += 1
            return resumed[0]
        cursor = self._cursor
        assert cursor is not None
        task = self._dataset[cursor.index]
        group = Group.fresh(task, epoch=cursor.epoch, n_samples=self._n_samples, version=version, seq=cursor.next_seq)
        nxt = cursor.index + 1
        # Past the last row a new epoch starts: the same prompt in a new epoch is a new group id.
        moved = Cursor(cursor.epoch + nxt // len(self._dataset), nxt % len(self._dataset), cursor.next_seq + 1)
        await self._store.admit([group], moved)
        self._cursor = moved
        self._new += 1
        return group

    def statistics(self) -> DispenserStatistics:
        return DispenserStatistics(self._new, self._resumed, self._cursor or Cursor())

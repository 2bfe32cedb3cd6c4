"""The dispenser: decides which groups generate next, as admission tickets come.

Partial groups come first (the store serves them oldest token version first, then FIFO), then new
prompts from the dataset cursor. Taking a new prompt and moving the cursor is one store transaction,
so a crash can neither skip nor repeat a prompt. Nothing is admitted while the clock publishes.

When several tickets are free at once (a round starts, or a refill), it takes up to `batch` of
them and admits their groups in one store call: one transaction, one fsync with LMDB synced,
instead of one each. It hands them to the pool one by one, as slots free, as before. A stop (the
end of a partial-rollout round) returns those not handed over yet through the pool as partial
groups without tokens, served first next round: the same prompts, in the same order, where one
at a time they would have stayed unadmitted tickets, revoked. `batch=1` is the old behaviour.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from core.clock import VersionClock
from core.types import Group, PromptTask
from stages.admission import Admission
from stages.store_ports import DispenserStore
from storage import Cursor

__all__ = ["Dispenser", "DispenserStatistics"]


@dataclass(frozen=True, slots=True)
class DispenserStatistics:
    new_groups: int
    resumed_groups: int
    cursor: Cursor


class Dispenser:
    def __init__(
        self,
        store: DispenserStore,
        dataset: Sequence[PromptTask],
        *,
        n_samples: int,
        clock: VersionClock,
        admission: Admission,
        on_admit: Callable[[str], None] | None = None,
        batch: int = 1,
    ) -> None:
        """`batch`: the most groups admitted in one store call when that many tickets are free."""
        if not dataset:
            raise ValueError("the dataset is empty: there is nothing to generate")
        if batch < 1:
            raise ValueError(f"the dispenser's batch is at least 1 group, got {batch}")
        self._batch = batch
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
                n = await self._admission.take_tickets(self._batch)
                version = await self._clock.wait_serving()
                for group in await self._next_groups(n, version):
                    if self._on_admit is not None:
                        self._on_admit(group.group_id)
                    try:
                        await send.send(group)
                    except anyio.BrokenResourceError:
                        # The pool is gone: the pipeline is going down for another reason. The
                        # groups not handed over stay RUNNING in the store, and a restart brings
                        # them back as partial.
                        return

    async def _next_groups(self, n: int, version: int) -> list[Group]:
        """`n` groups, RUNNING in the store: partial ones first, then new prompts, admitted in one
        call with the cursor (so a crash can neither skip nor repeat a prompt)."""
        resumed = await self._store.claim_partial(n)
        self._resumed += len(resumed)
        if len(resumed) == n:
            return resumed
        cursor = self._cursor
        assert cursor is not None
        fresh = []
        for _ in range(n - len(resumed)):
            task = self._dataset[cursor.index]
            fresh.append(
                Group.fresh(task, epoch=cursor.epoch, n_samples=self._n_samples, version=version, seq=cursor.next_seq)
            )
            nxt = cursor.index + 1
            # Past the last row a new epoch starts: the same prompt in a new epoch is a new group id.
            cursor = Cursor(cursor.epoch + nxt // len(self._dataset), nxt % len(self._dataset), cursor.next_seq + 1)
        await self._store.admit(fresh, cursor)
        self._cursor = cursor
        self._new += len(fresh)
        return resumed + fresh

    def statistics(self) -> DispenserStatistics:
        return DispenserStatistics(self._new, self._resumed, self._cursor or Cursor())

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

With a `PromptSelection` (`stages.selection`) it reads the stored histories of the prompts ahead of
the cursor, in one store call per admission: a prompt drawn to be skipped is stored REJECTED
(`SKIP_REASON`) in the same transaction that admits the others and moves the cursor past it, so a
kill before that transaction leaves nothing decided and a kill after it leaves the skip stored,
never both and never twice; its ticket goes to the next prompt. New prompts can then be handed to
the pool longest predicted first. In one admission it skips at most a dataset's worth of prompts,
then admits the next ones whatever their streak: an admission always ends, with all its groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from core.clock import VersionClock
from core.types import Group, PromptTask
from stages.admission import Admission
from stages.selection import SKIP_REASON, PromptSelection, longest_first, skips
from stages.store_ports import DispenserStore
from storage import Cursor, PromptHistory

__all__ = ["Dispenser", "DispenserStatistics"]


@dataclass(frozen=True, slots=True)
class DispenserStatistics:
    new_groups: int
    resumed_groups: int
    cursor: Cursor
    skipped: int = 0  # prompts skipped before generation (stored REJECTED, `SKIP_REASON`)


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
        selection: PromptSelection | None = None,
    ) -> None:
        """`batch`: the most groups admitted in one store call when that many tickets are free.
        `selection`: skips and order read from the prompts' histories (None: neither)."""
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
        self._selection = selection if selection is not None and selection.reads_history else None
        self._new = 0
        self._resumed = 0
        self._skipped = 0

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
        assert self._cursor is not None
        fresh, skipped, cursor, histories = await self._draw(n - len(resumed), version, self._cursor)
        if skipped:
            await self._store.admit(fresh, cursor, skipped=skipped)
        else:
            await self._store.admit(fresh, cursor)
        self._cursor = cursor
        self._new += len(fresh)
        self._skipped += len(skipped)
        if self._selection is not None and self._selection.longest_first:
            fresh = longest_first(fresh, histories)
        return resumed + fresh

    async def _draw(
        self, n: int, version: int, cursor: Cursor
    ) -> tuple[list[Group], list[Group], Cursor, dict[int, PromptHistory]]:
        """`n` new groups from `cursor` on, the prompts skipped on the way, the cursor after them,
        and the histories read."""
        fresh: list[Group] = []
        skipped: list[Group] = []
        histories: dict[int, PromptHistory] = {}
        selection, rows = self._selection, len(self._dataset)
        while len(fresh) < n:
            ahead = self._ahead(cursor, n - len(fresh))
            if selection is not None:
                histories.update(await self._store.prompt_history([c.index for c in ahead]))
            for at in ahead:
                task = self._dataset[at.index]
                group = Group.fresh(task, epoch=at.epoch, n_samples=self._n_samples, version=version, seq=at.next_seq)
                cursor = self._after(at)
                skip = (
                    selection is not None
                    and selection.skip_zero_std
                    and len(skipped) < rows
                    and skips(
                        histories.get(at.index),
                        seed=selection.seed,
                        epoch=at.epoch,
                        index=at.index,
                        explore_floor=selection.explore_floor,
                    )
                )
                if skip:
                    skipped.append(dataclasses.replace(group, rejected_reason=SKIP_REASON))
                else:
                    fresh.append(group)
                    if len(fresh) == n:
                        break
        return fresh, skipped, cursor, histories

    def _ahead(self, cursor: Cursor, wanted: int) -> list[Cursor]:
        """The positions of the next prompts from `cursor`: `wanted` of them, twice that when some
        may be skipped, never more than one pass over the dataset (each row's history read once)."""
        skipping = self._selection is not None and self._selection.skip_zero_std
        out = [cursor]
        while len(out) < min(len(self._dataset), 2 * wanted if skipping else wanted):
            out.append(self._after(out[-1]))
        return out

    def _after(self, at: Cursor) -> Cursor:
        nxt = at.index + 1
        # Past the last row a new epoch starts: the same prompt in a new epoch is a new group id.
        return Cursor(at.epoch + nxt // len(self._dataset), nxt % len(self._dataset), at.next_seq + 1)

    def statistics(self) -> DispenserStatistics:
        return DispenserStatistics(self._new, self._resumed, self._cursor or Cursor(), self._skipped)

"""The killed process of `test_history`'s SIGKILL test (run as `python -m tests.history_kill_child STORE LIFE`).

It is the one LMDB writer. Life 1 stores two finished epochs of a 16-prompt dataset (even rows:
every reward equal, odd rows: a spread), so the even rows start epoch 2 on a zero-variance streak
of 2, then runs the dispenser with skipping on, 4 tickets at a time. It prints `COMMITTED` with
the skipped ids and the cursor after each admission that stored skips; at the second one it prints
`DECIDED` with what it is about to store and stops inside the store call, before the transaction,
and prints `HELD`: the test SIGKILLs it there. Life 2 recovers the store and dispenses until the
cursor reaches epoch 4, then prints `DONE`. Nothing finishes a group after the seeding, so the
histories the skips are drawn from never change: the test computes every skip from them alone.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from core.clock import VersionClock
from core.types import Group, PromptTask
from stages.admission import Admission
from stages.dispenser import Dispenser
from stages.selection import PromptSelection
from storage import AsyncStore, Cursor, LmdbStore
from tests.test_store import finished

ROWS = 16
SEED = 11
FLOOR = 0.1
SEEDED_EPOCHS = 2  # epochs 0 and 1 finished before the dispenser starts
LAST_EPOCH = 3  # the dispenser runs epochs 2 and 3
DATASET = [PromptTask(index=i, prompt_ids=(5, 6, i), label=i) for i in range(ROWS)]


def seed_history(store: LmdbStore) -> None:
    """Epochs 0 and 1, admitted and finished: even rows with equal rewards, odd rows with a spread."""
    for epoch in range(SEEDED_EPOCHS):
        groups = [Group.fresh(t, epoch=epoch, n_samples=2, version=0, seq=epoch * ROWS + t.index) for t in DATASET]
        store.admit(groups, Cursor(epoch + 1, 0, (epoch + 1) * ROWS))
        done = []
        for g in groups:
            f = finished(g, 0)
            rewards = (1.0, 1.0) if g.task.index % 2 == 0 else (0.0, 1.0)
            done.append(f.with_samples([s.with_reward(r) for s, r in zip(f.samples, rewards, strict=True)]))
        store.put_ready_groups(done)


class HoldingStore(LmdbStore):
    """Reports each admission that stores skips; holds the `hold_at`-th one before its transaction."""

    def __init__(self, path: Path, *, hold_at: int | None) -> None:
        super().__init__(path)
        self._hold_at = hold_at
        self._skipping = 0

    def admit(self, groups: Sequence[Group], cursor: Cursor, *, skipped: Sequence[Group] = (), **kw: Any) -> None:
        if skipped:
            self._skipping += 1
            shown = f"{' '.join(g.group_id for g in skipped)} {cursor.epoch} {cursor.index}"
            if self._skipping == self._hold_at:
                print(f"DECIDED {shown}", flush=True)
                print("HELD", flush=True)
                threading.Event().wait()  # the SIGKILL comes here, before the transaction
        super().admit(groups, cursor, skipped=skipped, **kw)
        if skipped:
            print(f"COMMITTED {shown}", flush=True)


async def main(path: Path, life: int) -> None:
    store = HoldingStore(path, hold_at=2 if life == 1 else None)
    if life == 1:
        seed_history(store)
    else:
        store.recover()  # the groups the killed life admitted come back as partial, served first
    async with AsyncStore(store) as astore:
        admission = Admission()
        selection = PromptSelection(seed=SEED, skip_zero_std=True, explore_floor=FLOOR)
        dispenser = Dispenser(
            astore, DATASET, n_samples=2, clock=VersionClock(), admission=admission, batch=4, selection=selection
        )
        send, receive = anyio.create_memory_object_stream[Group](0)
        async with receive, anyio.create_task_group() as tg:
            await tg.start(dispenser.run, send)
            while dispenser.statistics().cursor.epoch <= LAST_EPOCH:
                admission.grant(4)
                for _ in range(4):
                    await receive.receive()
            tg.cancel_scope.cancel()
    print("DONE", flush=True)


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]), int(sys.argv[2]))

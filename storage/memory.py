"""`MemoryStore`: the `Store` protocol in plain dicts and heaps. Lost on exit, by design.

It keeps Group objects as they are (they are frozen), so nothing is encoded on this path. It obeys
the same rules and raises the same errors as the LMDB store; the shared test suite holds both to it.

Serving order lives in two heaps of `(oldest_version, seq, group_id)`. A group leaves PARTIAL only
through `claim_partial` and READY only through `take_batch`, and both pop from the top, so the heaps
never need deletions from the middle: every take is O(k log n). A lease reclaim puts a group back
into PARTIAL, which is a push, so that holds with leases too.

Prompt histories (`storage.history`) live in a dict by dataset row, one small summary per prompt,
for as long as the store: a memory run remembers its prompts for its own lifetime.

`clock` (default `time.time`) measures lease expiry, injectable for tests as in the LMDB store.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from core.errors import CorruptRecordError, IncompatibleStoreError, StoreError
from core.types import Batch, Group

from . import keys
from . import transitions as tr
from .codec import meta_difference
from .history import PromptHistory, outcome_of, updated_history
from .protocol import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_OWNER,
    Coverage,
    Cursor,
    GroupState,
    Lease,
    RecoveryReport,
    RunMeta,
    StoreStatistics,
    VerifyReport,
    decode_step_metrics,
    encode_step_metrics,
)
from .transitions import PutMoves, check_hand_over, check_lease

__all__ = ["MemoryStore"]

_RUNNING, _PARTIAL, _READY, _BATCHED = GroupState.RUNNING, GroupState.PARTIAL, GroupState.READY, GroupState.BATCHED
_REJECTED = GroupState.REJECTED
_Order = tuple[int, int, str]


class MemoryStore(PutMoves):
    """Synchronous, one process, not thread-safe on its own (`AsyncStore` calls it from one task at a time)."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._leases: dict[str, Lease] = {}  # exactly the RUNNING groups
        self._tombstones: dict[str, int] = {}  # collected group id -> the step it trained in
        self._collected = 0
        self._collected_step = -1
        self._meta: RunMeta | None = None
        self._cursor = Cursor()
        self._trained_step = -1
        self._groups: dict[str, tuple[GroupState, Group]] = {}
        # Members of each state, in arrival order (a dict is an ordered set).
        self._members: dict[GroupState, dict[str, None]] = {s: {} for s in GroupState}
        self._partial: list[_Order] = []
        self._ready: list[_Order] = []
        self._batches: dict[int, tuple[str, ...]] = {}
        self._open_steps: set[int] = set()  # batches taken but not finished: steps > trained_step
        self._step_metrics: dict[int, bytes] = {}  # step -> its metrics record, as the LMDB store keeps it
        self._history: dict[int, PromptHistory] = {}  # dataset row -> its history, for the store's life
        self._transactions = 0
        self._closed = False

    # --- run metadata and cursor ----------------------------------------------------------------

    def read_meta(self) -> RunMeta | None:
        self._check_open()
        return self._meta

    def write_meta(self, meta: RunMeta) -> None:
        """Records what the store is for. Refuses (IncompatibleStoreError) to change what names the run
        once written (`codec.meta_difference`); `extra`, the settings and their changes, may change."""
        self._check_open()
        if self._meta is not None and (diff := meta_difference(self._meta, meta)) is not None:
            raise IncompatibleStoreError(*diff)
        self._meta = meta
        self._transactions += 1

    def cursor(self) -> Cursor:
        self._check_open()
        return self._cursor

    # --- the state machine ----------------------------------------------------------------------

    def admit(
        self,
        groups: Sequence[Group],
        cursor: Cursor,
        *,
        owner: str = DEFAULT_OWNER,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        skipped: Sequence[Group] = (),
    ) -> None:
        self._check_open()
        check_lease(owner, lease_seconds)
        tr.check_skipped(skipped)
        seen: set[str] = set()
        for group in (*groups, *skipped):
            gid = group.group_id
            keys.group_key(gid)  # the same id rules as the LMDB store
            if gid in seen:
                raise tr.duplicate_in_admit(gid)
            seen.add(gid)
            if (step := self._tombstones.get(gid)) is not None:
                raise tr.already_collected(gid, step)
            if (entry := self._groups.get(gid)) is not None:
                raise tr.already_exists(gid, entry[0])
        lease = Lease(owner, self._clock() + lease_seconds)
        for group in groups:
            self._set(group, _RUNNING)
            self._leases[group.group_id] = lease
        for group in skipped:
            tr.check_move(group.group_id, None, _REJECTED)
            self._set(group, _REJECTED)
        self._cursor = cursor
        self._transactions += 1

    def claim_partial(
        self, limit: int, *, owner: str = DEFAULT_OWNER, lease_seconds: float = DEFAULT_LEASE_SECONDS
    ) -> list[Group]:
        self._check_open()
        check_lease(owner, lease_seconds)
        lease = Lease(owner, self._clock() + lease_seconds)
        claimed: list[Group] = []
        while self._partial and len(claimed) < limit:
            _, _, gid = heapq.heappop(self._partial)
            group = self._groups[gid][1]
            self._move(gid, _PARTIAL, _RUNNING, group)
            self._leases[gid] = lease
            claimed.append(group)
        self._transactions += 1
        return claimed

    # put_partial, put_ready, ...: transitions.PutMoves, through `_put`

    # --- leases ---------------------------------------------------------------------------------

    def lease(self, group_id: str) -> Lease | None:
        self._check_open()
        return self._leases.get(group_id)

    def renew_leases(self, owner: str, lease_seconds: float) -> int:
        self._check_open()
        check_lease(owner, lease_seconds)
        lease = Lease(owner, self._clock() + lease_seconds)
        mine = [gid for gid, held in self._leases.items() if held.owner == owner]
        for gid in mine:
            self._leases[gid] = lease
        self._transactions += 1
        return len(mine)

    def hand_over(self, group_id: str, *, owner: str, to: str, lease_seconds: float) -> None:
        self.hand_over_groups([group_id], owner=owner, to=to, lease_seconds=lease_seconds)

    def hand_over_groups(self, group_ids: Sequence[str], *, owner: str, to: str, lease_seconds: float) -> None:
        self._check_open()
        check_lease(to, lease_seconds)
        if not group_ids:
            return
        tr.check_distinct_ids(group_ids, f"hand-over to {to!r}")
        for gid in group_ids:  # every check before the first lease moves: all or nothing
            entry = self._groups.get(gid)
            held = self._leases.get(gid)
            check_hand_over(gid, None if entry is None else entry[0], owner, None if held is None else held.owner, to)
        lease = Lease(to, self._clock() + lease_seconds)
        for gid in group_ids:
            self._leases[gid] = lease
        self._transactions += 1

    def accept_results(
        self,
        owner: str,
        results: Sequence[tuple[GroupState, Group]],
        *,
        to: str = DEFAULT_OWNER,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> dict[str, str]:
        self._check_open()
        check_lease(to, lease_seconds)
        if not results:
            return {}
        tr.check_distinct_ids([g.group_id for _, g in results], f"batch of results from {owner!r}")
        for state, group in results:
            tr.check_result_state(group.group_id, state)
        refused: dict[str, str] = {}
        lease = Lease(to, self._clock() + lease_seconds)
        for state, group in results:
            gid = group.group_id
            entry = self._groups.get(gid)
            held = self._leases.get(gid)
            now, holder = None if entry is None else entry[0], None if held is None else held.owner
            try:
                if state is _RUNNING:
                    check_hand_over(gid, now, owner, holder, to)
                else:
                    tr.check_put(gid, now, state, owner, holder)
            except StoreError as exc:  # fenced: this one is left out, the others go on
                refused[gid] = str(exc)
                continue
            if state is _RUNNING:
                self._leases[gid] = lease
            else:
                self._move(gid, _RUNNING, state, group)
        self._transactions += 1
        return refused

    def reclaim_expired(self, now: float | None = None) -> int:
        self._check_open()
        at = self._clock() if now is None else now
        expired = [gid for gid, held in self._leases.items() if held.expires_at <= at]
        for gid in expired:
            self._move(gid, _RUNNING, _PARTIAL, self._groups[gid][1])
        self._transactions += 1
        return len(expired)

    # --- housekeeping ---------------------------------------------------------------------------

    def collect_garbage(self, up_to_step: int) -> int:
        self._check_open()
        tr.check_collect(up_to_step, self._trained_step)
        self._transactions += 1
        if up_to_step <= self._collected_step:
            return 0
        deleted = 0
        for step in sorted(s for s in self._batches if self._collected_step < s <= up_to_step):
            for gid in self._batches.pop(step):
                del self._groups[gid]
                del self._members[GroupState.TRAINED][gid]
                self._tombstones[gid] = step
                deleted += 1
        self._collected += deleted
        self._collected_step = up_to_step
        return deleted

    def take_batch(self, step: int, size: int) -> Batch | None:
        self._check_open()
        tr.check_batch_size(size)
        if step in self._batches:
            self._transactions += 1
            return self._batch_of(step)
        if step <= self._trained_step:
            raise tr.already_trained(step, self._trained_step)
        self._transactions += 1
        if len(self._ready) < size:
            return None
        ids = []
        for _ in range(size):
            _, _, gid = heapq.heappop(self._ready)
            self._move(gid, _READY, _BATCHED, self._groups[gid][1])
            ids.append(gid)
        self._batches[step] = tuple(ids)
        self._open_steps.add(step)
        return self._batch_of(step)

    def finish_batch(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        self._check_open()
        # Encoded up front: a record that is not JSON is refused before anything changes.
        record = None if metrics is None else encode_step_metrics(step, metrics)
        if step not in self._batches and 0 <= step <= self._collected_step:  # finished, then collected
            self._transactions += 1
            return
        if step not in self._batches:
            raise tr.no_batch(step)
        if step <= self._trained_step:  # finished already: a retry after a crash
            self._transactions += 1
            return
        if earlier := [s for s in self._open_steps if s < step]:
            raise tr.out_of_order(step, min(earlier))
        for gid in self._batches[step]:
            self._move(gid, _BATCHED, GroupState.TRAINED, self._groups[gid][1])
        self._open_steps.discard(step)
        self._trained_step = step
        if record is not None:
            self._step_metrics[step] = record
        self._transactions += 1

    def step_metrics(self, first: int = 0) -> dict[int, dict[str, Any]]:
        self._check_open()
        return {
            step: decode_step_metrics(raw, key=f"metrics/{step}")
            for step, raw in sorted(self._step_metrics.items())
            if step >= first
        }

    def trained_step(self) -> int:
        self._check_open()
        return self._trained_step

    def recover(self) -> RecoveryReport:
        self._check_open()
        running = list(self._members[_RUNNING])
        for gid in running:
            self._move(gid, _RUNNING, _PARTIAL, self._groups[gid][1])
        requeued = 0
        for step in sorted(self._open_steps):
            for gid in self._batches.pop(step):
                self._move(gid, _BATCHED, _READY, self._groups[gid][1])
                requeued += 1
        self._open_steps.clear()
        self._transactions += 1
        return RecoveryReport(running_to_partial=len(running), batched_to_ready=requeued)

    def seed(
        self,
        cursor: Cursor,
        trained_step: int,
        *,
        partial: Sequence[Group] = (),
        ready: Sequence[Group] = (),
        replay: Sequence[tuple[Batch, Mapping[str, Any] | None]] = (),
    ) -> None:
        self._check_open()
        held = len(self._groups) + len(self._tombstones)
        tr.check_seed(trained_step, held, self._trained_step, [batch.step for batch, _ in replay])
        trained = [g for batch, _ in replay for g in batch.groups]
        ids = [g.group_id for g in (*partial, *ready, *trained)]
        if len(set(ids)) != len(ids):
            raise tr.duplicate_in_admit(next(i for i in ids if ids.count(i) > 1))
        records = {b.step: encode_step_metrics(b.step, m) for b, m in replay if m is not None}  # may refuse: first
        for group in partial:
            self._set(group, _PARTIAL)
        for group in ready:
            self._set(group, _READY)
        for group in trained:
            self._set(group, GroupState.TRAINED)
        for batch, _ in replay:
            self._batches[batch.step] = tuple(g.group_id for g in batch.groups)
        self._step_metrics.update(records)
        self._cursor = cursor
        self._trained_step = trained_step
        self._collected_step = trained_step - len(replay)
        self._transactions += 1

    def coverage(self, step: int) -> Coverage:
        self._check_open()
        unsettled = [gid for state in (_RUNNING, _PARTIAL, _READY) for gid in self._members[state]]
        quarantined = self._members[GroupState.QUARANTINED]
        unsettled += [gid for gid in quarantined if tr.requeue_id(gid) not in self._groups]
        unsettled += [gid for s, ids in sorted(self._batches.items()) if s > step for gid in ids]
        return Coverage(step, self._cursor, tuple(unsettled))

    def quarantine_damaged(self) -> int:
        """Nothing in memory is ever damaged."""
        self._check_open()
        return 0

    def requeue_quarantined(self, fresh: Callable[[str], Group | None]) -> int:
        """Nothing is ever damaged in memory, but a QUARANTINED group is served the same way."""
        return len(self._requeue(list(self._members[GroupState.QUARANTINED]), fresh))

    def requeue_failed(self, fresh: Callable[[str], Group | None]) -> int:
        return len(self._requeue(list(self._members[GroupState.FAILED]), fresh))

    def requeue_trained(self, group_ids: Sequence[str], fresh: Callable[[str], Group | None]) -> list[str]:
        self._check_open()
        for gid in group_ids:
            entry = self._groups.get(gid)
            if entry is None or entry[0] is not GroupState.TRAINED:
                found = "missing" if entry is None else entry[0].value
                raise StoreError(f"group {gid!r} is indexed as trained but its state is {found}")
        return self._requeue(list(group_ids), fresh)

    def _requeue(self, ids: Sequence[str], fresh: Callable[[str], Group | None]) -> list[str]:
        self._check_open()
        requeued = []
        for gid in ids:
            new_id = tr.requeue_id(gid)
            if new_id in self._groups or new_id in self._tombstones or (group := fresh(gid)) is None:
                continue
            self._set(dataclasses.replace(group, group_id=new_id), _PARTIAL)
            requeued.append(new_id)
        self._transactions += 1
        return requeued

    # --- reading --------------------------------------------------------------------------------

    def prompt_history(self, indexes: Sequence[int]) -> dict[int, PromptHistory]:
        self._check_open()
        return {i: h for i in indexes if (h := self._history.get(i)) is not None}

    def count(self, state: GroupState) -> int:
        self._check_open()
        return len(self._members[state])

    def get(self, group_id: str) -> tuple[GroupState, Group] | None:
        self._check_open()
        return self._groups.get(group_id)

    def verify(self) -> VerifyReport:
        """Nothing in memory is ever damaged: every group is counted as checked."""
        return VerifyReport(records=len(self._groups), damaged=())

    def groups(self, state: GroupState, *, damaged: list[CorruptRecordError] | None = None) -> Iterator[Group]:
        self._check_open()
        if state is _PARTIAL or state is _READY:
            ids = [gid for _, _, gid in sorted(self._partial if state is _PARTIAL else self._ready)]
        else:
            ids = list(self._members[state])
        return iter([self._groups[gid][1] for gid in ids])

    def batch(self, step: int, *, damaged: list[CorruptRecordError] | None = None) -> Batch | None:
        self._check_open()
        return self._batch_of(step) if step in self._batches else None

    def damaged_in_batch(self, step: int) -> list[tuple[str, CorruptRecordError]] | None:
        self._check_open()
        return [] if step in self._batches else None  # nothing in memory is ever damaged

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            counts={s: len(m) for s, m in self._members.items()},
            cursor=self._cursor,
            trained_step=self._trained_step,
            transactions=self._transactions,
            bytes_used=0,
            collected=self._collected,
            collected_step=self._collected_step,
        )

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._groups.clear()
            self._batches.clear()
            self._history.clear()

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the memory store is closed")

    def _put(self, groups: Sequence[Group], to: GroupState, owner: str | None) -> None:
        """Every group RUNNING -> `to`, or none: all are checked before the first one moves."""
        self._check_open()
        if not groups:
            return
        if len(groups) > 1:
            tr.check_distinct(groups, to)
        for group in groups:
            gid = group.group_id
            entry = self._groups.get(gid)
            held = self._leases.get(gid)
            tr.check_put(gid, None if entry is None else entry[0], to, owner, None if held is None else held.owner)
        for group in groups:
            self._move(group.group_id, _RUNNING, to, group)
        self._transactions += 1

    def _set(self, group: Group, state: GroupState) -> None:
        gid = group.group_id
        self._groups[gid] = (state, group)
        self._members[state][gid] = None
        if state is _PARTIAL:
            heapq.heappush(self._partial, (group.oldest_version, group.seq, gid))
        elif state is _READY:
            heapq.heappush(self._ready, (group.oldest_version, group.seq, gid))

    def _move(self, gid: str, old: GroupState, new: GroupState, group: Group) -> None:
        # The heap entry of `old` (PARTIAL or READY) was already popped by the caller.
        tr.check_move(gid, old, new)
        del self._members[old][gid]
        if old is _RUNNING:
            del self._leases[gid]
            if (new is _READY or new is _REJECTED) and (outcome := outcome_of(group)) is not None:
                index = group.task.index
                self._history[index] = updated_history(self._history.get(index), index, outcome)
        self._set(group, new)

    def _batch_of(self, step: int) -> Batch:
        return Batch(step=step, groups=tuple(self._groups[gid][1] for gid in self._batches[step]))

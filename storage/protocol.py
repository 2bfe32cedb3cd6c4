"""The `Store` protocol: where rollout state lives, in memory or in LMDB.

A group moves through these states; every arrow is one store method and one transaction:

    admit ──► RUNNING ──put_ready──► READY ──take_batch──► BATCHED ──finish_batch──► TRAINED
                 │  ▲                                          │                          │
     put_partial │  │ claim_partial                   recover  │ (crash before    collect_garbage
 reclaim_expired │  │                                          │  the step finished)      ▼
                 ▼  │                                          ▼                   (id kept as a tombstone)
               PARTIAL ◄──────── recover (crash while RUNNING)  READY
                 RUNNING ──put_rejected──► REJECTED    RUNNING ──put_failed──► FAILED
     (put_ready_groups and put_rejected_groups: the same moves for many groups, one transaction;
      hand_over_groups: many leases moved, one transaction; accept_results: a producer's results,
      each a put_* or its lease handed back, one transaction, each fenced on its own)
     any state but TRAINED ──(its record fails its checksum)──► QUARANTINED
     admit(skipped=...) ──► REJECTED   a prompt skipped before generation (`rejected_reason` says
                                       why), stored with the cursor that passed it

`storage.transitions` holds this table and every message a refused move gives; both stores use it.

RUNNING is leased: `admit` and `claim_partial` give the lease, every move out of RUNNING ends it.

Ordering, the same for both implementations:
- `claim_partial` and `take_batch` serve the oldest token version first (`Group.oldest_version`),
  then FIFO by `Group.seq`.
- The dispenser serves partial groups before new prompts (it calls `claim_partial` first).

A group id exists once: `admit` refuses an id the store already holds, in any state, and also an
id whose TRAINED group `collect_garbage` deleted (a tombstone of the id stays). That, plus the
cursor moving in the same transaction, is why a prompt is never generated twice.

Leases. A RUNNING group (admitted, or claimed with `claim_partial`) is leased: an owner id and an
expiry time (seconds since the epoch, from the store's clock). The owner renews its leases
(`renew_leases`) well inside the lease time; `reclaim_expired(now)` turns RUNNING groups whose
expiry is <= now back into PARTIAL, prefixes kept, so a lost producer's work is served again.
A `put_*` that names its `owner` is refused unless that owner still holds the lease (a producer
that lost its lease must not overwrite the group another owner now runs). The defaults (owner
"controller", a lease that never expires) are the single-process controller's: nothing expires,
and `recover()` after a restart requeues everything RUNNING regardless of leases.

History. A group moving RUNNING -> READY or REJECTED with every reward set adds its outcome to its
dataset row's `PromptHistory` (`storage.history`) in the same transaction; `prompt_history(rows)`
reads them, one lookup a row. Skipped groups add nothing (nothing was generated).

Garbage. `collect_garbage(step)` deletes the TRAINED groups and the batch records of steps up to
`step` (call it once the checkpoint of `step` is durable). Counters keep the truth: `count(TRAINED)`
falls, `StoreStatistics.collected` rises by the same number.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import orjson

from core.errors import CorruptRecordError
from core.types import Batch, Group

from .history import PromptHistory

__all__ = [
    "DEFAULT_LEASE_SECONDS",
    "DEFAULT_OWNER",
    "Coverage",
    "Cursor",
    "GroupState",
    "Lease",
    "RecoveryReport",
    "RunMeta",
    "Store",
    "StoreStatistics",
    "VerifyReport",
]

SCHEMA_VERSION = 1
DEFAULT_OWNER = "controller"
DEFAULT_LEASE_SECONDS = math.inf  # the lone controller's lease: never expires, `recover()` requeues


class GroupState(enum.Enum):
    RUNNING = "running"
    PARTIAL = "partial"
    READY = "ready"
    BATCHED = "batched"
    TRAINED = "trained"
    REJECTED = "rejected"
    FAILED = "failed"
    QUARANTINED = "quarantined"  # its stored record is damaged: kept, never served, its prompt requeued


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where the next new prompt comes from: dataset row `index` of pass `epoch`.

    `next_seq` is the FIFO number the next admitted group gets.
    """

    epoch: int = 0
    index: int = 0
    next_seq: int = 0


@dataclass(frozen=True, slots=True)
class Coverage:
    """What training steps 0..`step` settled, as a checkpoint of `step` records it (`Store.coverage`).

    Every group below `cursor` is settled (trained in a step up to `step`, rejected by the filter,
    failed) except those named in `unsettled`: running, partial, ready, batched or trained for a
    later step, or quarantined with its prompt not requeued yet. Only the ids of the unsettled
    groups are kept, so the record stays as small as the work in flight."""

    step: int
    cursor: Cursor
    unsettled: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RunMeta:
    """What a store was written for. A restart with different values is refused."""

    run_id: str
    dataset_fingerprint: str
    tokenizer_fingerprint: str
    n_samples_per_prompt: int
    schema_version: int = SCHEMA_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What `recover()` found after an unclean stop."""

    running_to_partial: int
    batched_to_ready: int


@dataclass(frozen=True, slots=True)
class Lease:
    """Who runs a RUNNING group, and until when (seconds since the epoch; inf = never expires)."""

    owner: str
    expires_at: float


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    counts: Mapping[GroupState, int]  # groups held now, per state (collected ones are not held)
    cursor: Cursor
    trained_step: int
    transactions: int
    bytes_used: int  # pages in use x page size; 0 for the memory store
    collected: int = 0  # TRAINED groups deleted by collect_garbage, over the store's life
    collected_step: int = -1  # the last step collect_garbage covered
    map_size: int = 0  # the LMDB map reservation now (it doubles when full); 0 for the memory store


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What `Store.verify()` read, and every damaged thing it found (empty: the store is sound)."""

    records: int  # values read and checked
    damaged: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.damaged


@runtime_checkable
class Store(Protocol):
    """Synchronous; each method is one transaction. Async code goes through `AsyncStore`."""

    def read_meta(self) -> RunMeta | None: ...

    def write_meta(self, meta: RunMeta) -> None: ...

    def cursor(self) -> Cursor: ...

    def admit(
        self,
        groups: Sequence[Group],
        cursor: Cursor,
        *,
        owner: str = DEFAULT_OWNER,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        skipped: Sequence[Group] = (),
    ) -> None:
        """New groups enter RUNNING, leased to `owner` for `lease_seconds`, and the cursor moves to
        `cursor`, together. `skipped`: prompts the cursor passes without generating them (each a
        fresh group with its `rejected_reason`), which enter REJECTED in the same transaction, so
        a skip is stored exactly when the cursor moves past its prompt.

        Raises StoreError, storing nothing, if any group id already exists or was collected.
        """
        ...

    def prompt_history(self, indexes: Sequence[int]) -> dict[int, PromptHistory]:
        """The history of each dataset row in `indexes` that has one (`storage.history`), read in
        one transaction, one lookup a row."""
        ...

    def claim_partial(
        self, limit: int, *, owner: str = DEFAULT_OWNER, lease_seconds: float = DEFAULT_LEASE_SECONDS
    ) -> list[Group]:
        """Up to `limit` PARTIAL groups, oldest version then FIFO, now RUNNING and leased to `owner`."""
        ...

    def put_partial(self, group: Group, *, owner: str | None = None) -> None:
        """RUNNING -> PARTIAL, keeping every token the group has (its prefixes); the lease ends.

        With `owner`, refused (StoreError, nothing changes) unless `owner` holds the lease; the
        same holds for every `put_*`.
        """
        ...

    def put_ready(self, group: Group, *, owner: str | None = None) -> None:
        """RUNNING -> READY: all samples finished, rewarded and accepted."""
        ...

    def put_rejected(self, group: Group, *, owner: str | None = None) -> None:
        """RUNNING -> REJECTED by the dynamic filter. Kept for accounting and replay, never trained."""
        ...

    def put_failed(self, group: Group, *, owner: str | None = None) -> None:
        """RUNNING -> FAILED: a sample failed for good. Kept, visible, never trained."""
        ...

    def put_ready_groups(self, groups: Sequence[Group], *, owner: str | None = None) -> None:
        """`put_ready` of every group in `groups`, in one transaction: all of them move, or none does
        (StoreError naming the group that cannot). A group named twice is refused, nothing stored.
        No groups, no transaction. This is how the collector stores what arrived together."""
        ...

    def put_rejected_groups(self, groups: Sequence[Group], *, owner: str | None = None) -> None:
        """`put_rejected` of every group in `groups`, in one transaction; as `put_ready_groups`."""
        ...

    def lease(self, group_id: str) -> Lease | None:
        """The lease of a RUNNING group; None for any other group or an unknown id."""
        ...

    def renew_leases(self, owner: str, lease_seconds: float) -> int:
        """Every lease `owner` holds now expires `lease_seconds` from the store's clock. Returns how
        many. An expired lease not yet reclaimed is renewed too (it was never taken away)."""
        ...

    def hand_over(self, group_id: str, *, owner: str, to: str, lease_seconds: float) -> None:
        """A RUNNING group's lease moves from `owner` to `to`, expiring `lease_seconds` from the store's
        clock; the group stays RUNNING with its record unchanged. Refused (StoreError, nothing changes)
        unless `owner` holds the lease: the controller hands a group to a producer, and takes a
        producer's result back, through this fence."""
        ...

    def hand_over_groups(self, group_ids: Sequence[str], *, owner: str, to: str, lease_seconds: float) -> None:
        """`hand_over` of every group in `group_ids`, in one transaction: all leases move, or none
        does (StoreError naming the group that cannot; a group named twice is refused, nothing
        changed). No groups, no transaction. This is how the controller hands a producer the groups
        waiting together."""
        ...

    def accept_results(
        self,
        owner: str,
        results: Sequence[tuple[GroupState, Group]],
        *,
        to: str = DEFAULT_OWNER,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> dict[str, str]:
        """A producer's results in one transaction, each fenced on its own by `owner`'s lease.

        `(RUNNING, group)`: the lease comes back from `owner` to `to` (as `hand_over`; the record
        is unchanged, the group stays RUNNING). `(PARTIAL | READY | REJECTED | FAILED, group)`:
        that `put_*` with `owner`. A result `owner` may not commit (its lease expired or was
        reassigned, the group is no longer RUNNING) is left out and everything else is committed:
        returns {group id: why} of those left out, empty when all were. A group named twice is
        refused whole (StoreError, nothing changed). No results, no transaction."""
        ...

    def reclaim_expired(self, now: float | None = None) -> int:
        """RUNNING groups whose lease expires at or before `now` (default: the store's clock) ->
        PARTIAL, prefixes kept, claimable again. Returns how many."""
        ...

    def collect_garbage(self, up_to_step: int) -> int:
        """Deletes the TRAINED groups and the batch records of steps <= `up_to_step` (which must be
        <= `trained_step()`); their ids stay refused by `admit`. Returns the groups deleted.
        Repeating it, or a lower step, deletes nothing more."""
        ...

    def take_batch(self, step: int, size: int) -> Batch | None:
        """The batch for training step `step`: `size` READY groups, oldest version then FIFO,
        moved to BATCHED and recorded under `step`. None (and no change) if fewer are ready.

        If a batch for `step` was already taken (a restart after a crash), returns that batch.
        """
        ...

    def finish_batch(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """The step's groups -> TRAINED; trainer progress becomes `step`. Finishing a finished step
        again (a retry after a crash) changes nothing, even after its groups were collected.

        `metrics`, the step's metrics record (str keys; numbers, strings, booleans, None), is stored
        in the same transaction, so a step counts as trained exactly when its record is stored;
        `collect_garbage` keeps it. Refused (ValueError, nothing changes) if it is not JSON.
        """
        ...

    def step_metrics(self, first: int = 0) -> dict[int, dict[str, Any]]:
        """The metrics records `finish_batch` stored, by step, for steps >= `first`, in step order.
        A step finished without a record has none here."""
        ...

    def trained_step(self) -> int:
        """The last finished step, -1 before the first."""
        ...

    def recover(self) -> RecoveryReport:
        """After an unclean stop: RUNNING groups -> PARTIAL (their prefixes kept), and the groups of
        batches after `trained_step()` -> READY (their batch records dropped)."""
        ...

    def seed(
        self,
        cursor: Cursor,
        trained_step: int,
        *,
        partial: Sequence[Group] = (),
        ready: Sequence[Group] = (),
        replay: Sequence[tuple[Batch, Mapping[str, Any] | None]] = (),
    ) -> None:
        """Start an empty store where another one left off (a damaged store's salvage): the cursor,
        the last trained step, and groups that enter PARTIAL or READY. `replay` holds the batches
        of the last trained steps (consecutive, ending at `trained_step`), each with its metrics
        record: their groups enter TRAINED, as `finish_batch` left them, so that a resume trains
        them again; the steps before them count as trained and collected. One transaction.
        Raises StoreError on a store that is not empty."""
        ...

    def coverage(self, step: int) -> Coverage:
        """What steps 0..`step` settled (`Coverage`), read in one transaction: what a checkpoint of
        `step` records, so that a resume from it after the store is lost knows which prompts the
        checkpoint covers. Call it between `take_batch(step)` and the next step's batch."""
        ...

    def quarantine_damaged(self) -> int:
        """Groups that can still be served (RUNNING, PARTIAL, READY, BATCHED) whose records fail their
        checksum -> QUARANTINED, in one transaction. Returns how many."""
        ...

    def requeue_quarantined(self, fresh: Callable[[str], Group | None]) -> int:
        """For each QUARANTINED group not requeued yet, `fresh(group_id)` (a new group for the same
        prompt, or None when the prompt is unknown) enters PARTIAL under `transitions.requeue_id`.
        The quarantined group stays, counted. Returns how many were requeued."""
        ...

    def requeue_failed(self, fresh: Callable[[str], Group | None]) -> int:
        """As `requeue_quarantined`, for FAILED groups (`--requeue-failed-groups` on resume, once
        the cause is fixed): each enters PARTIAL again, once, under `transitions.requeue_id`; the
        failed group stays, counted and visible. Returns how many were requeued."""
        ...

    def requeue_trained(self, group_ids: Sequence[str], fresh: Callable[[str], Group | None]) -> list[str]:
        """The prompts of TRAINED groups whose training a resume cannot repeat (their records are
        damaged and the checkpoint it resumes from is older than their step): for each not
        requeued yet, `fresh(group_id)` enters PARTIAL under `transitions.requeue_id`, once. The
        trained group stays as it is. Returns the new ids requeued now (empty when done before)."""
        ...

    def count(self, state: GroupState) -> int: ...

    def get(self, group_id: str) -> tuple[GroupState, Group] | None: ...

    def groups(self, state: GroupState, *, damaged: list[CorruptRecordError] | None = None) -> Iterator[Group]:
        """The groups in `state`; PARTIAL and READY in serving order, the rest in any order.

        A damaged record raises CorruptRecordError; with `damaged`, it is appended there and skipped."""
        ...

    def batch(self, step: int, *, damaged: list[CorruptRecordError] | None = None) -> Batch | None: ...

    def damaged_in_batch(self, step: int) -> list[tuple[str, CorruptRecordError]] | None:
        """(group id, error) for each group of step `step`'s batch whose record is missing or
        damaged, found by checksums without decoding (a resume checks what it trains again so);
        None when the step has no batch record. A damaged batch record raises CorruptRecordError."""
        ...

    def verify(self) -> VerifyReport:
        """Every record read and checked, every index checked against the group states."""
        ...

    def statistics(self) -> StoreStatistics: ...

    def close(self) -> None: ...


def encode_step_metrics(step: int, metrics: Mapping[str, Any]) -> bytes:
    """A step's metrics record as JSON (never pickle); both stores keep exactly what this keeps.

    NaN and infinities become null (JSON has no such numbers), as in the metrics file.
    """
    if not all(isinstance(k, str) for k in metrics):
        raise ValueError(f"step {step}: metrics keys must be strings, got {sorted(map(repr, metrics))}")
    try:
        return orjson.dumps(dict(metrics), option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as exc:
        raise ValueError(f"step {step}: the metrics record is not JSON ({exc})") from exc


def decode_step_metrics(raw: bytes, *, key: str) -> dict[str, Any]:
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise CorruptRecordError(key, f"metrics record is not JSON: {exc}") from exc
    if not isinstance(record, dict):
        raise CorruptRecordError(key, f"metrics record is a {type(record).__name__}, not an object")
    return record

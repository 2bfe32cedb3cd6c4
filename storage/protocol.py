"""The `Store` protocol: where rollout state lives, in memory or in LMDB.

A group moves through these states; every arrow is one store method and one transaction:

    admit ──► RUNNING ──put_ready──► READY ──take_batch──► BATCHED ──finish_batch──► TRAINED
                 │  ▲                                          │
     put_partial │  │ claim_partial                   recover  │ (crash before the step finished)
                 ▼  │                                          ▼
               PARTIAL ◄──────── recover (crash while RUNNING)  READY
                 RUNNING ──put_rejected──► REJECTED    RUNNING ──put_failed──► FAILED

Ordering, the same for both implementations:
- `claim_partial` and `take_batch` serve the oldest token version first (`Group.oldest_version`),
  then FIFO by `Group.seq`.
- The dispenser serves partial groups before new prompts (it calls `claim_partial` first).

A group id exists once: `admit` refuses an id the store already holds, in any state. That, plus
the cursor moving in the same transaction, is why a prompt is never generated twice.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pipeline.types import Batch, Group

__all__ = ["Cursor", "GroupState", "RecoveryReport", "RunMeta", "Store", "StoreStatistics"]

SCHEMA_VERSION = 1


class GroupState(enum.Enum):
    RUNNING = "running"
    PARTIAL = "partial"
    READY = "ready"
    BATCHED = "batched"
    TRAINED = "trained"
    REJECTED = "rejected"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where the next new prompt comes from: dataset row `index` of pass `epoch`.

    `next_seq` is the FIFO number the next admitted group gets.
    """

    epoch: int = 0
    index: int = 0
    next_seq: int = 0


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
class StoreStatistics:
    counts: Mapping[GroupState, int]
    cursor: Cursor
    trained_step: int
    transactions: int
    bytes_used: int  # 0 for the memory store


@runtime_checkable
class Store(Protocol):
    """Synchronous; each method is one transaction. Async code goes through `AsyncStore`."""

    def read_meta(self) -> RunMeta | None: ...

    def write_meta(self, meta: RunMeta) -> None: ...

    def cursor(self) -> Cursor: ...

    def admit(self, groups: Sequence[Group], cursor: Cursor) -> None:
        """New groups enter RUNNING and the cursor moves to `cursor`, together.

        Raises StoreError, storing nothing, if any group id already exists.
        """
        ...

    def claim_partial(self, limit: int) -> list[Group]:
        """Up to `limit` PARTIAL groups, oldest version then FIFO, now RUNNING."""
        ...

    def put_partial(self, group: Group) -> None:
        """RUNNING -> PARTIAL, keeping every token the group has (its prefixes)."""
        ...

    def put_ready(self, group: Group) -> None:
        """RUNNING -> READY: all samples finished, rewarded and accepted."""
        ...

    def put_rejected(self, group: Group) -> None:
        """RUNNING -> REJECTED by the dynamic filter. Kept for accounting and replay, never trained."""
        ...

    def put_failed(self, group: Group) -> None:
        """RUNNING -> FAILED: a sample failed for good. Kept, visible, never trained."""
        ...

    def take_batch(self, step: int, size: int) -> Batch | None:
        """The batch for training step `step`: `size` READY groups, oldest version then FIFO,
        moved to BATCHED and recorded under `step`. None (and no change) if fewer are ready.

        If a batch for `step` was already taken (a restart after a crash), returns that batch.
        """
        ...

    def finish_batch(self, step: int) -> None:
        """The step's groups -> TRAINED; trainer progress becomes `step`."""
        ...

    def trained_step(self) -> int:
        """The last finished step, -1 before the first."""
        ...

    def recover(self) -> RecoveryReport:
        """After an unclean stop: RUNNING groups -> PARTIAL (their prefixes kept), and the groups of
        batches after `trained_step()` -> READY (their batch records dropped)."""
        ...

    def count(self, state: GroupState) -> int: ...

    def get(self, group_id: str) -> tuple[GroupState, Group] | None: ...

    def groups(self, state: GroupState) -> Iterator[Group]:
        """The groups in `state`; PARTIAL and READY in serving order, the rest in any order."""
        ...

    def batch(self, step: int) -> Batch | None: ...

    def statistics(self) -> StoreStatistics: ...

    def close(self) -> None: ...

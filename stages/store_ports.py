"""What each stage calls on the store: one narrow `Protocol` a stage (or family of stages).

A stage is typed by the calls it makes, not by the whole `storage.AsyncStore`, so a reader sees
what a stage can do to rollout state from its signature, and something that is not a store can
stand in where a stage runs without one (the Ray producer's outbox, `launch.ray_producer`, sends
each group back to the controller instead). `AsyncStore` satisfies every one of them; mypy checks
that where the controller builds the stages.

The calls are written without the `owner`/`lease_seconds` keywords: a stage acts as the lone
controller (the store's defaults); a producer's lease is the controller's business.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from core.types import Group
from storage import Cursor, GroupState, PromptHistory

__all__ = [
    "CollectorStore",
    "DispenserStore",
    "FilterStore",
    "PoolStore",
    "ProducerStore",
    "RewardStore",
]


class DispenserStore(Protocol):
    """`stages.dispenser.Dispenser`: partial groups first, then new prompts and the cursor, together
    with the prompts skipped on the way; the prompts' histories, for skips and order."""

    async def cursor(self) -> Cursor: ...

    async def claim_partial(self, limit: int) -> list[Group]: ...

    async def admit(self, groups: Sequence[Group], cursor: Cursor, *, skipped: Sequence[Group] = ()) -> None: ...

    async def prompt_history(self, indexes: Sequence[int]) -> dict[int, PromptHistory]: ...


class PoolStore(Protocol):
    """`stages.generator.GeneratorPool`: a group stopped with tokens kept, or failed for good."""

    async def put_partial(self, group: Group) -> None: ...

    async def put_failed(self, group: Group) -> None: ...


class RewardStore(Protocol):
    """`stages.reward.RewardStage`: a group whose reward failed for good."""

    async def put_failed(self, group: Group) -> None: ...


class FilterStore(Protocol):
    """`stages.filter.FilterStage`: the groups the dynamic filter turned down together."""

    async def put_rejected_groups(self, groups: Sequence[Group]) -> None: ...


class ProducerStore(PoolStore, RewardStore, FilterStore, Protocol):
    """The producer set (`stages.producers`: pool, reward, filter): every way a group leaves it
    other than accepted. Accepted groups go on to the collector by stream, never through here."""


class CollectorStore(Protocol):
    """`stages.collector.Collector`: how many groups are ready, and accepted groups made ready."""

    async def count(self, state: GroupState) -> int: ...

    async def put_ready_groups(self, groups: Sequence[Group]) -> None: ...

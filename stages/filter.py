"""The dynamic filter: accepts or rejects whole groups (DAPO-style, e.g. "rewards not all equal").

The user's function is `(group: Group) -> bool | FilterVerdict`-like: a bool, or any object with a
`keep` attribute and an optional `reason`. A rejected group is stored as rejected (its prompt is
used up and it is never trained) and counted by reason; the rollout policy refills for it.
Rejected groups that come together (what is already waiting, up to `batch`) are stored in one
store call.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from core.types import Group
from stages.admission import Admission, Outcome
from stages.store_ports import FilterStore
from stages.streams import drain_nowait

__all__ = ["FilterStage", "FilterStatistics", "reward_std_nonzero"]

FilterFn = Callable[[Group], Any]


@dataclass(frozen=True, slots=True)
class FilterStatistics:
    accepted: int
    rejected: dict[str, int]


def reward_std_nonzero(group: Group) -> bool:
    """Keep groups whose rewards differ: a group with equal rewards has zero advantage everywhere."""
    rewards = [s.reward for s in group.samples if s.reward is not None]
    return bool(rewards) and max(rewards) - min(rewards) > 1e-6


class FilterStage:
    def __init__(self, filter_fn: FilterFn | None, *, store: FilterStore, admission: Admission, batch: int = 1) -> None:
        """`batch`: the most rejected groups stored in one store call, of those already waiting."""
        if batch < 1:
            raise ValueError(f"the filter's batch is at least 1 group, got {batch}")
        self._batch = batch
        self._fn = filter_fn
        self._store = store
        self._admission = admission
        self._accepted = 0
        self._rejected: Counter[str] = Counter()

    async def run(
        self,
        receive: MemoryObjectReceiveStream[Group],
        send: MemoryObjectSendStream[Group],
        *,
        task_status: TaskStatus[None],
    ) -> None:
        task_status.started()
        async with receive, send:
            async for first in receive:
                # Judge what is already waiting too, one group at a time (only one accepted group
                # is ever in hand), and store its rejected groups together in one store call.
                rejected: list[Group] = []
                group: Group | None = first
                while group is not None:
                    keep, reason = self._verdict(group)
                    if keep:
                        self._accepted += 1
                        try:
                            send.send_nowait(group)
                        except anyio.WouldBlock:
                            # The collector is full: store the rejected before waiting for it.
                            await self._store_rejected(rejected)
                            rejected = []
                            await send.send(group)
                    else:
                        self._rejected[reason] += 1
                        rejected.append(dataclasses.replace(group, rejected_reason=reason))
                    more = drain_nowait(receive, 1) if len(rejected) < self._batch else []
                    group = more[0] if more else None
                await self._store_rejected(rejected)

    async def _store_rejected(self, groups: list[Group]) -> None:
        await self._store.put_rejected_groups(groups)
        for _ in groups:
            self._admission.settle(Outcome.REJECTED)

    def _verdict(self, group: Group) -> tuple[bool, str]:
        if self._fn is None:
            return True, ""
        out = self._fn(group)
        if isinstance(out, bool):
            return out, "" if out else "rejected"
        keep = bool(out.keep)
        return keep, str(getattr(out, "reason", "") or ("" if keep else "rejected"))

    def statistics(self) -> FilterStatistics:
        return FilterStatistics(self._accepted, dict(self._rejected))

"""The dynamic filter: accepts or rejects whole groups (DAPO-style, e.g. "rewards not all equal").

The user's function is `(group: Group) -> bool | FilterVerdict`-like: a bool, or any object with a
`keep` attribute and an optional `reason`. A rejected group is stored as rejected (its prompt is
used up and it is never trained) and counted by reason; the rollout policy refills for it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pipeline.types import Group
from stages.admission import Admission, Outcome
from storage import AsyncStore

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
    def __init__(self, filter_fn: FilterFn | None, *, store: AsyncStore, admission: Admission) -> None:
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
            async for group in receive:
                keep, reason = self._verdict(group)
                if keep:
                    self._accepted += 1
                    await send.send(group)
                else:
                    self._rejected[reason] += 1
                    await self._store.put_rejected(dataclasses.replace(group, rejected_reason=reason))
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

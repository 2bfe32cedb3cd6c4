"""The producer set: the part of the graph that generates and scores, behind one seam.

    dispenser ─► [ producer set: generator pool ─► reward ─► filter ] ─► collector
                   groups in (admitted, leased)      accepted groups out; partial, failed and
                                                     rejected groups stored, admission settled

The controller stays the single store writer and the single version clock; everything else about
where groups are generated is the producer set's. Two implementations:

- `LocalProducers` (here): the in-process generator pool, reward and filter stages, today's graph;
- `launch.ray_producers.RayProducers`: the same stages inside one Ray actor per node, leased work,
  fenced results (`--rollout-producers ray`). It lives in `launch/` because process control does,
  and so that nothing under `pipeline/` imports Ray.

The rollout modes (`pipeline.rollout_modes`) speak only this protocol: grant tickets, wait for a
free slot, stop and resume. A publish reaches producers that hold a clock of
their own through `gates` (`stages.publisher.AdmissionGates`); the local set shares the
controller's clock and has none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from core.types import Group
from stages.admission import Admission
from stages.filter import FilterStage, FilterStatistics
from stages.generator import GeneratorPool, GeneratorStatistics
from stages.publisher import AdmissionGates
from stages.reward import RewardStage

__all__ = ["LocalProducers", "Producers", "ProducersFactory"]


class Producers(Protocol):
    """Where admitted groups are generated, rewarded and filtered."""

    async def run(
        self,
        receive: MemoryObjectReceiveStream[Group],
        send: MemoryObjectSendStream[Group],
        *,
        task_status: TaskStatus[None],
    ) -> None:
        """Take admitted groups from `receive`; send accepted ones to `send`. Every other way out
        (partial, failed, rejected) is stored and settled with the admission here."""
        ...

    @property
    def idle_slots(self) -> int:
        """Sample slots with nothing to run (the partial policy's work-conserving refill)."""
        ...

    async def wait_slot_freed(self) -> None: ...

    async def stop(self) -> None:
        """Start nothing new, abort what runs; every group in hand ends finished or stored as partial."""
        ...

    def resume(self) -> None: ...

    @property
    def gates(self) -> AdmissionGates | None:
        """Admission gates a publish must close and reopen beyond the controller's clock."""
        ...

    def statistics(self) -> GeneratorStatistics: ...

    def filter_statistics(self) -> FilterStatistics: ...

    def metrics(self) -> dict[str, float]:
        """Counters of their own for the step record (e.g. `producers/fenced_results`)."""
        ...


# The graph builds its admission first; a producer set other than the local one is made from it.
ProducersFactory = Callable[[Admission], Producers]


class LocalProducers:
    """The generator pool, reward and filter stages in the controller's own task group."""

    def __init__(self, pool: GeneratorPool, reward: RewardStage, gate: FilterStage, *, buffer: int) -> None:
        self.pool, self.reward, self.gate = pool, reward, gate
        self._buffer = buffer

    async def run(
        self,
        receive: MemoryObjectReceiveStream[Group],
        send: MemoryObjectSendStream[Group],
        *,
        task_status: TaskStatus[None],
    ) -> None:
        to_reward_send, to_reward = anyio.create_memory_object_stream[Group](self._buffer)
        to_filter_send, to_filter = anyio.create_memory_object_stream[Group](self._buffer)
        ends = (to_reward_send, to_reward, to_filter_send, to_filter)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.pool.run, receive, to_reward_send)
                await tg.start(self.reward.run, to_reward, to_filter_send)
                await tg.start(self.gate.run, to_filter, send)
                task_status.started()
        finally:
            # A stage cancelled before it entered its `async with` never closed its ends.
            for end in (*ends, receive, send):
                end.close()

    @property
    def idle_slots(self) -> int:
        return self.pool.idle_slots

    async def wait_slot_freed(self) -> None:
        await self.pool.wait_slot_freed()

    async def stop(self) -> None:
        await self.pool.stop()

    def resume(self) -> None:
        self.pool.resume()

    @property
    def gates(self) -> AdmissionGates | None:
        return None  # the pool reads the controller's own clock

    def statistics(self) -> GeneratorStatistics:
        return self.pool.statistics()

    def filter_statistics(self) -> FilterStatistics:
        return self.gate.statistics()

    def metrics(self) -> dict[str, float]:
        return {
            "reward/retries_total": self.reward.statistics().retried_calls,
            "agent/retries_total": self.pool.statistics().agent_retries,
        }

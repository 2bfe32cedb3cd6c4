"""The stage graph: how one run's stages are wired, started and stopped.

    dataset ─► dispenser ─► [ generator pool ─► reward ─► filter ] ─► collector ─► Rollout.next_batch
                  ▲            the producer set: in process,           │ (bounded in async mode)
                  │            or on Ray actors                        │
                  └──── store (memory | LMDB): partial, ready, batches ◄┘

- `StageGraph.build` makes the stages from the plan and the run's parts (`pipeline.plan`); they
  share one `Admission` (the tickets that let groups in: `pipeline.rollout_modes` grants them) and
  one `GroupTimes` (when each group was admitted and became ready, for the step record).
- `StageGraph.running` starts them in one task group, joined by small bounded streams, so
  backpressure travels upstream and nothing piles up between two stages; in async mode it starts
  the feeder too. Leaving it normally stops generation and stores whatever is unfinished.

A new stage is a class with `async def run(self, receive, send, *, task_status)` in `stages/`,
built in `build` and started in `running` with `tg.start()`, joined by a bounded stream.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio

from core.clock import VersionClock
from core.types import Group, RolloutMode
from pipeline.metrics import GroupTimes
from pipeline.plan import RolloutParts, RolloutPlan
from pipeline.rollout_modes import Pace, Training, async_pace, feed_async
from stages.admission import Admission, Outcome
from stages.collector import Collector
from stages.dispenser import Dispenser
from stages.filter import FilterStage
from stages.generator import GeneratorPool
from stages.producers import LocalProducers, Producers
from stages.reward import RewardStage
from stages.selection import SKIP_REASON, PromptSelection

__all__ = ["StageGraph", "failing_limit"]


@dataclass(frozen=True, slots=True, eq=False)
class StageGraph:
    """The stages of one run and the bookkeeping they share, wired but not yet started."""

    plan: RolloutPlan
    admission: Admission
    times: GroupTimes
    dispenser: Dispenser
    producers: Producers  # generator pool, reward and filter: in process, or on Ray actors
    collector: Collector
    pace: Pace | None = None  # async admission's window (`pipeline.rollout_modes.Pace`); None: unpaced

    @classmethod
    def build(cls, plan: RolloutPlan, parts: RolloutParts, clock: VersionClock) -> StageGraph:
        """Make the stages from the plan and the run's parts, sharing `clock`; nothing starts yet."""
        admission = Admission(failing_limit=failing_limit(plan))
        store = parts.store
        # In sync mode admission alone bounds the ready set (a round grants exactly the groups its
        # batch lacks, plus bounded refills); the collector's own bound matters only in async mode.
        capacity = plan.batch_size + plan.ahead if plan.mode is RolloutMode.ASYNC else math.inf
        times = GroupTimes()
        dispenser = Dispenser(
            store,
            parts.dataset,
            n_samples=plan.n_samples,
            clock=clock,
            admission=admission,
            on_admit=times.admitted,
            batch=plan.store_batch,
            selection=PromptSelection(
                seed=plan.seed,
                skip_zero_std=plan.skip_zero_std,
                explore_floor=plan.skip_explore_floor,
                longest_first=plan.length_aware_admission,
            ),
        )
        # A producers factory puts generation elsewhere (Ray actors: `launch.ray_producers`).
        producers = (
            parts.producers(admission)
            if parts.producers is not None
            else _local_producers(plan, parts, clock, admission)
        )
        collector = Collector(
            store=store, admission=admission, capacity=capacity, on_ready=times.ready, batch=plan.store_batch
        )
        pace = async_pace(plan) if plan.mode is RolloutMode.ASYNC and plan.pace_async else None
        return cls(plan, admission, times, dispenser, producers, collector, pace)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Training]:
        """The stages started in one task group; on a normal exit, stopped with nothing left behind.

        Yields the training tracker that the step loop updates. An error in the block or in a
        stage cancels the task group; what was in flight stays in the store for the next run.
        """
        plan = self.plan
        # Small buffers: each stage hands over as soon as the next one can take, and backpressure
        # travels upstream. The dispenser hands over with no buffer at all, so groups it has not yet
        # handed over are still its own to place.
        to_pool_send, to_pool = anyio.create_memory_object_stream[Group](0)
        to_collect_send, to_collect = anyio.create_memory_object_stream[Group](plan.batch_size)
        ends = (to_pool_send, to_pool, to_collect_send, to_collect)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.dispenser.run, to_pool_send)
                await tg.start(self.producers.run, to_pool, to_collect_send)
                await tg.start(self.collector.run, to_collect)
                training = Training()
                feeding = None
                if plan.mode is RolloutMode.ASYNC:
                    feeding = await tg.start(feed_async, plan, self.admission, self.collector, training, self.pace)
                yield training
                await self._leave_nothing_behind(feeding)
                tg.cancel_scope.cancel()
        finally:
            # A stage cancelled before it entered its `async with` never closed its ends; closing
            # twice is harmless, and a stream left open is a leak the garbage collector reports.
            for end in ends:
                end.close()

    async def _leave_nothing_behind(self, feeding: anyio.CancelScope | None) -> None:
        """Running requests are aborted and their groups stored as partial, so the next run (or the
        next epoch of this one) continues them.

        The feeder stops first: it would otherwise re-admit each group the stop returns as partial,
        round and round. The collector takes every group that finishes meanwhile, full or not: no
        batch will make room.
        """
        if feeding is not None:
            feeding.cancel()
        self.collector.unbound()
        self.admission.revoke()
        await self.producers.stop()
        await self.admission.wait_settled()

    def counters(self) -> dict[str, float]:
        """The run's totals so far: groups by outcome, resumed samples, aborted requests, tokens,
        filter rejections by reason, and whatever the producer set adds."""
        g = self.producers.statistics()
        admission = self.admission
        return {
            "groups/ready_total": admission.count(Outcome.READY),
            "groups/rejected_total": admission.count(Outcome.REJECTED),
            "groups/failed_total": admission.count(Outcome.FAILED),
            "groups/partial_total": admission.count(Outcome.PARTIAL),
            "samples/resumed_total": g.resumed_samples,
            "requests/aborted_total": g.aborted_requests,
            "tokens/generated_total": g.generated_tokens,
            # Tokens stamped with the older version because the engine sent no per-token spans.
            "versions/unknown_boundary_tokens": g.unknown_boundary_tokens,
            # R3: tokens of aborted answers that came without their routes, replayed unrouted.
            "tokens/unrouted_total": g.unrouted_tokens,
            **self._rejected_by_reason(),
            **self.producers.metrics(),
        }

    def _rejected_by_reason(self) -> dict[str, float]:
        """Groups the filter rejected, by reason, and the prompts skipped before generation under
        the filter's name (`filter/rejected/skipped_zero_std`, there from the first step when
        skipping is on): a skip is the filter's rejection of a zero-variance group, made before its
        samples were generated. Skips take no admission ticket, so `groups/rejected_total` (the
        tickets the filter settled) does not count them."""
        rejected: dict[str, float] = dict(self.producers.filter_statistics().rejected)
        if self.plan.skip_zero_std:
            rejected[SKIP_REASON] = rejected.get(SKIP_REASON, 0) + self.dispenser.statistics().skipped
        return {f"filter/rejected/{reason}": n for reason, n in rejected.items()}


def failing_limit(plan: RolloutPlan) -> int:
    """How many groups in a row may fail, none succeeding in between, before the run stops.

    Two rounds' worth, and never fewer than 64: a burst of failures (a reward service down for a
    moment) loses those groups, counted and logged, but only a cause that fails everything (a
    prompt set longer than the engine's context) fails this many in a row, and then the run
    stops with its error instead of turning the dataset into failed groups forever.
    """
    return max(64, 2 * plan.batch_size, 2 * (plan.over_sampling or 0))


def _local_producers(plan: RolloutPlan, parts: RolloutParts, clock: VersionClock, admission: Admission) -> Producers:
    """Generator pool, reward and filter in this process, sharing the controller's clock."""
    store = parts.store
    return LocalProducers(
        GeneratorPool(
            parts.engines,
            slots=plan.slots,
            sampling_params=plan.sampling_params,
            max_response_len=plan.max_response_len,
            clock=clock,
            store=store,
            admission=admission,
            seed=plan.seed,
            events=parts.events,
            detokenize=parts.detokenize,
            agent=parts.agent,
            agent_max_retries=plan.agent_max_retries,
            payloads=plan.payloads,
        ),
        RewardStage(
            parts.reward_fn,
            timeout=plan.reward_timeout,
            store=store,
            admission=admission,
            max_retries=plan.reward_max_retries,
        ),
        FilterStage(parts.filter_fn, store=store, admission=admission, batch=plan.store_batch),
        buffer=plan.batch_size,
    )

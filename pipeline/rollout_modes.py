"""The rollout modes: how many groups each one lets into the graph, and when.

The stage graph (`pipeline.graph`) is the same in every mode; the one thing that differs is who
grants admission tickets (`stages.admission.Admission`) and how many:

- sync: a round grants exactly the groups its batch still lacks and waits for all of them,
  stragglers included (`fill_batch`, called by `Rollout.next_batch`);
- sync + partial: a round grants `over_sampling` groups at a time until the batch can fill, then
  stops the pool: running requests are aborted and their groups stored with their prefixes, resumed
  first next round (`fill_batch`);
- async: a feeder task keeps the pool fed across training steps (`feed_async`, started with the
  graph); the collector's bound, the pace (`Pace`: no further ahead than keeps the trainer fed)
  and the staleness rule are its brakes.

They speak only to the admission, the collector and the producer set (`stages.producers.Producers`),
never to a stage inside it, so Ray producers run under the same modes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import anyio
from anyio.abc import TaskStatus

from pipeline.plan import RolloutPlan
from stages.admission import Admission
from stages.collector import Collector
from stages.producers import Producers

__all__ = ["Pace", "Training", "async_pace", "feed_async", "fill_batch"]


async def fill_batch(
    plan: RolloutPlan,
    admission: Admission,
    collector: Collector,
    pool: Producers,
    stopping: AbstractContextManager[Any],
) -> None:
    """Run one synchronous rollout round until `batch_size` accepted groups are ready.

    `stopping` wraps partial rollout's stop (abort the rest, store their prefixes): the event
    log's "stop" span, so the timeline shows what the stop cost.
    """
    target = plan.batch_size
    if not plan.partial:
        while collector.ready < target:
            short = target - collector.ready - admission.outstanding
            if short > 0:
                admission.grant(short)
            await admission.wait_change()
        return
    chunk = plan.over_sampling or target
    while collector.ready < target:
        while collector.ready + admission.outstanding < target:
            admission.grant(chunk)
        # Work-conserving: while the round waits for the stragglers of its last groups, a slot
        # with nothing to run takes one more group. Nothing it generates is wasted (an unfinished
        # group is stored and resumed first next round), so idle engine time turns into tokens.
        # The backlog stays bounded: at most two refill chunks are out at once.
        if plan.fill_idle_slots and pool.idle_slots and not admission.tickets and admission.outstanding < 2 * chunk:
            admission.grant(1)
        await _first_of(admission.wait_change, pool.wait_slot_freed)
    # Enough: abort the rest. Groups that finish during the drain still become ready (surplus for
    # the next batch); the others go to the store with their prefixes, resumed first next round.
    with stopping:
        admission.revoke()
        await pool.stop()
        await admission.wait_settled()
    pool.resume()


class Pace:
    """How far async admission runs ahead of the trainer: as far as keeps it fed, and no further.

    A group finished earlier than the trainer needs it waits in the ready set while the weights
    move on, and is trained staler for it; when the trainer is the bottleneck that buys no
    throughput at all. So the feeder keeps a window: the groups it lets be ready or outstanding at
    once. It starts at `ceiling` (the most the collector's bound and the slots allow, the unpaced
    rule), and each time the trainer asks for a batch it learns from what the trainer found:

    - fewer than a batch ready: the trainer waits for the engines, so more work ahead helps (more
      groups run beside a slow group's stragglers); the window grows by the groups that were missing;
    - more than a batch ready: the engines ran ahead, and the surplus only ages. The window drops
      to what was in use (ready and in flight; the collector's bound or `--max-staleness` may
      have held it lower), less half the surplus (half: one fast step is no trend), and never below
      one batch, the least that lets generation overlap a training step.

    A run whose engines are the bottleneck keeps the ceiling, as if unpaced; a run whose trainer is
    the bottleneck settles at one batch ahead, staleness 1. `--max-staleness` still bounds both
    (`feed_async`).
    """

    def __init__(self, *, batch_size: int, ceiling: int) -> None:
        if batch_size < 1 or ceiling < batch_size:
            raise ValueError(f"Pace(batch_size={batch_size}, ceiling={ceiling}): need 1 <= batch_size <= ceiling")
        self.batch_size = batch_size
        self.ceiling = ceiling
        self.window = ceiling

    def asked(self, *, ready: int, in_flight: int) -> None:
        """The trainer asked for a batch and found `ready` groups ready and `in_flight` admitted
        groups not yet ready."""
        if ready < self.batch_size:
            self.window = min(self.ceiling, self.window + self.batch_size - ready)
            return
        surplus = ready - self.batch_size
        in_use = min(self.window, ready + in_flight)
        self.window = max(self.batch_size, in_use - (surplus + 1) // 2)


class Training:
    """The groups of the batch being trained whose weights are not published yet.

    They count as ahead of every group admitted meanwhile: that batch's publish bumps the version
    before any group admitted now can be trained. `changed` wakes the feeder when a step ends,
    since taking a batch and publishing move no admission ticket.
    """

    def __init__(self) -> None:
        self.groups = 0
        self.changed = anyio.Event()

    def start(self, groups: int) -> None:
        self.groups = groups
        self._notify()

    def done(self) -> None:
        self.groups = 0
        self._notify()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()


async def feed_async(
    plan: RolloutPlan,
    admission: Admission,
    collector: Collector,
    training: Training,
    pace: Pace | None,
    *,
    task_status: TaskStatus[anyio.CancelScope],
) -> None:
    """Keep enough groups in flight to fill every slot, across training steps.

    Tickets are granted for the room left in the collector plus twice the groups the slots can run
    at once: a group only starts generating when the pool has a free slot, so spare tickets cost
    nothing, while a group that waits for its last straggler no longer holds back new work. When
    the collector is full the cap is the second term alone, so finished groups held up behind it
    cannot pile up without bound. With a `pace`, ready and outstanding groups together stay within
    its window (it moves when the trainer takes a batch, which `training.changed` signals). With
    `max_staleness = N`, a group admitted at version v is only granted while at most
    `(N + 1) * batch_size` groups, itself included, are in training (taken, not yet published),
    ready or in flight: it then lands at the latest in the N-th batch after the one in training,
    trained at version v + N. (This assumes groups finish in the order they were admitted; one that
    is overtaken by later groups can end up staler.)
    """
    in_flight_cap = _in_flight_cap(plan)
    capacity = plan.batch_size + plan.ahead
    with anyio.CancelScope() as scope:
        task_status.started(scope)
        while True:
            limit = in_flight_cap + max(0, capacity - collector.ready - training.groups)
            if pace is not None:
                limit = min(limit, pace.window - collector.ready)
            if plan.max_staleness is not None:
                ahead = collector.ready + training.groups
                limit = min(limit, (plan.max_staleness + 1) * plan.batch_size - ahead)
            if admission.outstanding < limit:
                admission.grant(limit - admission.outstanding)
            await _first_of(admission.wait_change, training.changed.wait)


def async_pace(plan: RolloutPlan) -> Pace:
    """The pace of `feed_async` for `plan`: its window's ceiling is what the unpaced rule allows
    (the collector's bound plus twice the groups the slots run at once)."""
    return Pace(batch_size=plan.batch_size, ceiling=plan.batch_size + plan.ahead + _in_flight_cap(plan))


def _in_flight_cap(plan: RolloutPlan) -> int:
    """Twice the groups the slots run at once."""
    return 2 * max(1, -(-plan.slots // plan.n_samples))


async def _first_of(*waits: Callable[[], Any]) -> None:
    """Return as soon as one of `waits` returns."""
    async with anyio.create_task_group() as tg:

        async def one(wait: Callable[[], Any]) -> None:
            await wait()
            tg.cancel_scope.cancel()

        for wait in waits:
            tg.start_soon(one, wait)

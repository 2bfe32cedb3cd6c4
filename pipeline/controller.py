"""The controller: one task group, the stage graph, and the training loop, read top to bottom.

    dataset ─► dispenser ─► generator pool ─► reward ─► filter ─► collector ─► training loop
                  ▲                                                             │
                  └──── store (memory | LMDB) ◄── partial, ready, batches ◄─────┘

Components take plain parameters; only `launch/` knows the config tree and builds them.
The rollout policy is the one thing that differs between modes:
- sync: grant exactly the groups a batch still lacks, wait for all of them (stragglers included);
- sync + partial: grant `over_sampling` groups at a time until the batch can fill, then stop the
  pool: running requests are aborted and their groups stored with their prefixes for next round;
- async: keep the pool fed across training steps; the collector's bound and the staleness rule
  are the only brakes.

Why about 500 lines in one module: the stage graph, the rollout policies and the step loop are
one story whose order of events matters (admit, generate, stop, commit, publish); split over
files it would have to be read in pieces.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import structlog
from anyio.abc import TaskStatus

from core.clock import VersionClock
from core.errors import ConfigError, EngineError
from core.types import Batch, Group, PauseMode, PromptTask, RolloutMode
from pipeline.checkpoints import CheckpointPolicy, StepSaver, replay_then_publish
from pipeline.events import EventLog
from pipeline.metric_names import engine_load_metrics, slime_aliases, throughput_metrics
from pipeline.metrics import GroupTimes, MetricsSink, batch_metrics
from stages.admission import Admission, Outcome
from stages.agent import Agent
from stages.collector import Collector
from stages.continuation import Detokenize
from stages.dispenser import Dispenser
from stages.filter import FilterStage
from stages.generator import GenerateEngine, GeneratorPool
from stages.producers import LocalProducers, Producers, ProducersFactory
from stages.publisher import WeightTarget, WeightTransfer
from stages.reward import RewardFn, RewardStage
from stages.sglang.payloads import TokenPayloads
from storage import AsyncStore, GroupState

if TYPE_CHECKING:
    from pipeline.session import Rollout

__all__ = ["Engines", "RolloutPlan", "RunSummary", "Trainer", "run_pipeline"]

log = structlog.get_logger("pipeline")


class Trainer(Protocol):
    """A training backend. Both methods block; the controller runs them off the event loop."""

    def train_step(self, batch: Batch) -> Mapping[str, float]: ...

    def save_weights(self, path: Path) -> Path:
        """The full checkpoint (weights, optimizer, random state, step count). A trainer that also
        has `save_model(path)` (weights only) is given that for the folders published between
        checkpoints (`pipeline.checkpoints`)."""
        ...


class Engines(GenerateEngine, WeightTarget, Protocol):
    """What the pipeline needs from its engines: generate and abort (`stages.generator.GenerateEngine`)
    and pause, load weights, continue (`stages.publisher.WeightTarget`). `stages.sglang.EngineFleet`
    is the production one; anything speaking these methods over the SGLang protocol will do."""


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    """The rollout decisions, as plain values.

    `mode` and `pause_mode` take the enums; their string values ("async", "retract") are accepted
    and converted, so plans written before the enums keep working, and a misspelling fails here.
    """

    mode: RolloutMode
    batch_size: int  # groups per training step
    n_samples: int
    num_steps: int
    partial: bool = False
    over_sampling: int | None = None  # refill granularity in groups (partial rollout)
    fill_idle_slots: bool = True  # partial rollout: idle slots take one more group while the round waits
    prefetch: int | None = None  # ready groups kept ahead of the trainer (async)
    max_staleness: int | None = None
    pause_mode: PauseMode = PauseMode.ABORT
    overlap_publish: bool = False  # engines receive weights while decoding; no pause (publisher.py)
    slots: int = 64  # concurrent sample requests over all engines (C x E)
    max_response_len: int = 64
    sampling_params: Mapping[str, Any] = field(default_factory=dict)
    reward_timeout: float = 30.0
    reward_max_retries: int = 0  # calls again of a reward that raised or timed out, per sample
    agent_max_retries: int = 0  # runs again of an agent that raised, per sample
    seed: int = 0
    # The most groups one store call admits, or stores as ready or rejected, of those already
    # waiting: one transaction (one fsync with LMDB synced) for them all. Nothing waits to fill it.
    store_batch: int = 64
    # R3 routes and SC sampler heads asked of the engines with every request (off: neither).
    payloads: TokenPayloads = field(default_factory=TokenPayloads)

    def __post_init__(self) -> None:
        if not isinstance(self.store_batch, int) or self.store_batch < 1:
            raise ValueError(f"RolloutPlan store_batch={self.store_batch!r}: must be an integer >= 1")
        for name, kind in (("mode", RolloutMode), ("pause_mode", PauseMode)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                if value not in tuple(kind):
                    allowed = ", ".join(kind)
                    raise ValueError(f"RolloutPlan {name}={value!r}: must be one of {allowed}")
                object.__setattr__(self, name, kind(value))


@dataclass(frozen=True, slots=True)
class RunSummary:
    """What `run_pipeline` returns: steps trained by this call, the final version, every metrics record."""

    steps: int
    final_version: int
    metrics: list[dict[str, Any]]


async def run_pipeline(
    plan: RolloutPlan,
    *,
    engines: Engines,
    store: AsyncStore,
    trainer: Trainer,
    dataset: Sequence[PromptTask],
    reward_fn: RewardFn,
    filter_fn: Callable[..., Any] | None,
    weights_dir: Path,
    metrics: MetricsSink,
    clock: VersionClock | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    events: EventLog | None = None,
    detokenize: Detokenize | None = None,
    weight_transfer: WeightTransfer | None = None,
    agent: Agent | None = None,
    producers: ProducersFactory | None = None,
    evaluate: Callable[[int], Awaitable[dict[str, float]]] | None = None,
    checkpoints: CheckpointPolicy | None = None,
    resume_from: int | None = None,
) -> RunSummary:
    """Train `plan.num_steps` steps (those the store has not trained yet), then stop cleanly.

    The story: build the stage graph, start it, then per step wait for a batch, train it, commit
    it, publish the weights; at the end stop generating and store whatever is unfinished.

    `evaluate(step)` (sync mode: `pipeline.evaluation`) runs after each step's publish, when the
    engines serve that step's weights and nothing else is in flight; what it returns (nothing on
    a step that is not due) joins the step's record after the commit, as the publish times do.

    `checkpoints`: the cadence, retention and folders of `pipeline.checkpoints`; None saves a full
    checkpoint at every step to `weights_dir/vN` (the older layout). `resume_from`: the version of
    the checkpoint the trainer and engines were loaded with, when older than the store's trained
    step: the stored batches of the steps in between are trained again first (needs `checkpoints`
    and a `clock` at that version).
    """
    if evaluate is not None and plan.mode is RolloutMode.ASYNC:
        raise ConfigError(
            [
                "inline evaluation with --rollout-mode=async: generation never pauses there; "
                "evaluate saved weights with python -m pipeline.eval"
            ]
        )
    replayed = None
    if resume_from is not None and checkpoints is not None:
        assert clock is not None, "a replay needs the clock the engines were loaded at"
        replayed = await replay_then_publish(
            plan, trainer, store, engines, clock, checkpoints, resume_from=resume_from, transfer=weight_transfer
        )
    # The rollout side is the embedding object itself (`pipeline.session.Rollout`); this function
    # adds the built-in trainer loop and the metrics record. Imported here: session builds on this
    # module's graph, so it cannot be imported at the top without a cycle.
    from pipeline.session import Rollout

    rollout = Rollout(
        plan,
        engines=engines,
        store=store,
        dataset=dataset,
        reward_fn=reward_fn,
        filter_fn=filter_fn,
        clock=clock,
        events=events,
        detokenize=detokenize,
        agent=agent,
        weight_transfer=weight_transfer,
        producers=producers,
    )
    async with rollout:
        timer = _StepTimer(rollout.first_step, rollout.graph.producers.statistics().busy_slot_seconds)
        saving = StepSaver.starting(
            checkpoints, weights_dir, plan.num_steps, rollout.first_step, weight_transfer, replayed
        )
        for step in range(rollout.first_step, plan.num_steps):
            record = await _train_one_step(rollout, trainer, saving, store, timer, step)
            if evaluate is not None:
                started = time.perf_counter()
                evaluated = await evaluate(step)
                if evaluated:
                    # Evaluation is no part of the next step: its time is left out of that step's.
                    seconds = time.perf_counter() - started
                    timer.step_started += seconds
                    record.update(evaluated, **{"time/eval": seconds})
            # Engine faults (evictions, restarts, live engines, time at reduced capacity), when
            # the engines keep such counts (an EngineFleet with --use-fault-tolerance).
            fault_metrics = getattr(engines, "fault_metrics", None)
            if fault_metrics is not None:
                record.update(fault_metrics())
            metrics.write(record)
            if on_step is not None:
                on_step(record)
            log.debug("step", **{k: record[k] for k in ("step", "reward/mean", "staleness/max")})

    return RunSummary(plan.num_steps - rollout.first_step, rollout.clock.version, metrics.records)


@dataclass(slots=True)
class _StepTimer:
    """When the run and the current step started, and the pool's busy slot-time at that point."""

    first_step: int
    busy_before: float
    run_started: float = field(default_factory=time.perf_counter)
    step_started: float = field(default_factory=time.perf_counter)

    def lap(self, busy_now: float) -> tuple[float, float]:
        """(seconds, busy slot-seconds) since the last lap; a step runs from one commit to the next."""
        now = time.perf_counter()
        seconds, busy = now - self.step_started, busy_now - self.busy_before
        self.step_started, self.busy_before = now, busy_now
        return seconds, busy


async def _train_one_step(
    rollout: Rollout, trainer: Trainer, saving: StepSaver, store: AsyncStore, timer: _StepTimer, step: int
) -> dict[str, Any]:
    """Take a batch, train it and save the weights, commit the step with its record, publish."""
    plan, clock, graph = rollout.plan, rollout.clock, rollout.graph
    t_rollout = time.perf_counter()
    batch = await rollout.next_batch()
    # The trainer waited this long for its batch: rollout time in sync mode, idle time in async.
    rollout_seconds = time.perf_counter() - t_rollout
    group_times = graph.times.taken([g.group_id for g in batch.groups])
    loads = await _engine_loads(rollout.engines)

    # Training blocks for seconds; it runs on a worker thread so generation (in async mode) keeps
    # going on the event loop meanwhile.
    record = {
        "step": step,
        "version": clock.version,
        **batch_metrics(batch, version=clock.version, max_staleness=plan.max_staleness),
    }
    t_train = time.perf_counter()
    with _span(rollout.events, "train", step=step):
        train_metrics = await anyio.to_thread.run_sync(trainer.train_step, batch)
        saved = await anyio.to_thread.run_sync(saving.save, trainer, step)
    # Which checkpoint a resume starts from after this commit, and what the step wrote to disk.
    record["checkpoint/step"] = saving.checkpoint_step
    record["checkpoint/bytes_written"] = saved.bytes_written
    train_seconds = time.perf_counter() - t_train
    record.update({f"train/{k}": v for k, v in train_metrics.items()})
    # A step runs from the previous commit to its own, so its time includes the previous publish
    # and the steps' times add up to the run's.
    step_seconds, busy = timer.lap(graph.producers.statistics().busy_slot_seconds)
    times = _StepTimes(step_seconds, busy, rollout_seconds, train_seconds)
    record.update(await _step_record(plan, step, timer, times, graph, store, len(batch.groups)))
    record.update(group_times)
    record.update(loads)
    record.update(throughput_metrics(record))
    record.update(slime_aliases(record))

    # The weights the engines get are on disk (or in the trainer, for a distributed publish), and
    # every `--save-interval` steps a checkpoint too: commit the step, its metrics record in the
    # same transaction (so the store counts a step as trained exactly when it holds its record; a
    # kill before the file append is repaired on resume from there). A crash before this line
    # trains the batch again as a new step; a crash after it resumes from the last checkpoint and
    # trains this stored batch again exactly (`pipeline.checkpoints`), so the restart reaches these
    # weights again before it serves them. Committing before the publish matters in async mode:
    # tokens stamped with the new version must never outlive a restart that cannot rebuild it.
    # The publish's times are thus the record's only fields measured after the commit.
    await rollout.commit(batch, record)
    report = await rollout.publish(saved.folder)
    saving.published(saved, step)
    record["time/publish_gate_closed"] = report.gate_closed_seconds
    record["time/publish_update"] = report.update_seconds
    return record


@dataclass(frozen=True, slots=True)
class _StepTimes:
    step: float  # from the previous commit to this one
    busy: float  # slot-seconds the pool spent generating in that time
    rollout: float  # the trainer's wait for its batch
    train: float  # training and saving the weights


@dataclass(frozen=True, slots=True, eq=False)
class _Graph:
    """The stages of one run and the bookkeeping they share, wired but not yet started."""

    admission: Admission
    times: GroupTimes
    dispenser: Dispenser
    producers: Producers  # generator pool, reward and filter: in process, or on Ray actors
    collector: Collector

    @classmethod
    def build(
        cls,
        plan: RolloutPlan,
        *,
        engines: Engines,
        store: AsyncStore,
        dataset: Sequence[PromptTask],
        reward_fn: RewardFn,
        filter_fn: Callable[..., Any] | None,
        clock: VersionClock,
        events: EventLog | None,
        detokenize: Detokenize | None = None,
        agent: Agent | None = None,
        producers: ProducersFactory | None = None,
    ) -> _Graph:
        admission = Admission(failing_limit=failing_limit(plan))
        prefetch = plan.prefetch if plan.prefetch is not None else plan.batch_size
        # In sync mode admission alone bounds the ready set (a round grants exactly the groups its
        # batch lacks, plus bounded refills); the collector's own bound matters only in async mode.
        capacity = plan.batch_size + prefetch if plan.mode is RolloutMode.ASYNC else math.inf
        times = GroupTimes()
        return cls(
            admission=admission,
            times=times,
            dispenser=Dispenser(
                store,
                dataset,
                n_samples=plan.n_samples,
                clock=clock,
                admission=admission,
                on_admit=times.admitted,
                batch=plan.store_batch,
            ),
            producers=producers(admission)
            if producers is not None
            else LocalProducers(
                GeneratorPool(
                    engines,
                    slots=plan.slots,
                    sampling_params=plan.sampling_params,
                    max_response_len=plan.max_response_len,
                    clock=clock,
                    store=store,
                    admission=admission,
                    seed=plan.seed,
                    events=events,
                    detokenize=detokenize,
                    agent=agent,
                    agent_max_retries=plan.agent_max_retries,
                    payloads=plan.payloads,
                ),
                RewardStage(
                    reward_fn,
                    timeout=plan.reward_timeout,
                    store=store,
                    admission=admission,
                    max_retries=plan.reward_max_retries,
                ),
                FilterStage(filter_fn, store=store, admission=admission, batch=plan.store_batch),
                buffer=plan.batch_size,
            ),
            collector=Collector(
                store=store, admission=admission, capacity=capacity, on_ready=times.ready, batch=plan.store_batch
            ),
        )

    @asynccontextmanager
    async def running(self, plan: RolloutPlan) -> AsyncIterator[_Training]:
        """The stages started in one task group; on a normal exit, stopped with nothing left behind.

        Yields the training tracker that the step loop updates. An error in the block or in a
        stage cancels the task group; what was in flight stays in the store for the next run.
        """
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
                training = _Training()
                feeding = None
                if plan.mode is RolloutMode.ASYNC:
                    feeding = await tg.start(_feed_async, plan, self.admission, self.collector, training)
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


def failing_limit(plan: RolloutPlan) -> int:
    """How many groups in a row may fail, none succeeding in between, before the run stops.

    Two rounds' worth, and never fewer than 64: a burst of failures (a reward service down for a
    moment) loses those groups, counted and logged, but only a cause that fails everything (a
    prompt set longer than the engine's context) fails this many in a row, and then the run
    stops with its error instead of turning the dataset into failed groups forever.
    """
    return max(64, 2 * plan.batch_size, 2 * (plan.over_sampling or 0))


async def _step_record(
    plan: RolloutPlan, step: int, timer: _StepTimer, times: _StepTimes, graph: _Graph, store: AsyncStore, groups: int
) -> dict[str, Any]:
    """The step's counters, rates and times, measured just before its commit."""
    seconds = times.step
    return {
        **_step_counters(graph.admission, graph.producers),
        # Slot-time in flight over the whole step: in async mode generation goes on while the
        # trainer trains, and that counts.
        "engine/busy_frac": times.busy / (plan.slots * seconds) if seconds > 0 else 0.0,
        "trainer/idle_frac": times.rollout / seconds if seconds > 0 else 0.0,
        "groups/per_second": groups / seconds if seconds > 0 else 0.0,
        "groups/per_second_run": (step + 1 - timer.first_step)
        * plan.batch_size
        / (time.perf_counter() - timer.run_started),
        "time/step": seconds,
        "time/rollout": times.rollout,
        "time/train": times.train,
        "queue/ready": graph.collector.ready,
        "queue/partial": await store.count(GroupState.PARTIAL),
        "queue/quarantined": await store.count(GroupState.QUARANTINED),  # damaged records, never trained
        "queue/in_flight": graph.admission.outstanding,
    }


async def _engine_loads(engines: Any) -> dict[str, float]:
    """Each engine's running and waiting requests as the batch goes to training (in async mode
    generation goes on meanwhile), for engines that answer `GET /v1/loads`; none otherwise. An
    engine that fails to answer costs this step's load keys, never the step."""
    loads = getattr(engines, "loads", None)
    if loads is None:
        return {}
    try:
        with anyio.fail_after(5):
            return engine_load_metrics(await loads())
    except (EngineError, TimeoutError) as exc:
        log.debug("engine loads unavailable", error=str(exc))
        return {}


def _span(events: EventLog | None, kind: str, **fields: Any) -> AbstractContextManager[Any]:
    return events.span(kind, **fields) if events is not None else nullcontext()


async def _fill_sync(
    plan: RolloutPlan,
    admission: Admission,
    collector: Collector,
    pool: Producers,
    stopping: AbstractContextManager[Any],
) -> None:
    """Run one synchronous rollout round until `batch_size` accepted groups are ready."""
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


class _Training:
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


async def _feed_async(
    plan: RolloutPlan,
    admission: Admission,
    collector: Collector,
    training: _Training,
    *,
    task_status: TaskStatus[anyio.CancelScope],
) -> None:
    """Keep enough groups in flight to fill every slot, across training steps.

    Tickets are granted for the room left in the collector plus twice the groups the slots can run
    at once: a group only starts generating when the pool has a free slot, so spare tickets cost
    nothing, while a group that waits for its last straggler no longer holds back new work. When
    the collector is full the cap is the second term alone, so finished groups held up behind it
    cannot pile up without bound. With `max_staleness = N`, a group admitted at
    version v is only granted while at most `(N + 1) * batch_size` groups, itself included, are in
    training (taken, not yet published), ready or in flight: it then lands at the latest in the N-th
    batch after the one in training, trained at version v + N. (This assumes groups finish in the
    order they were admitted; one that is overtaken by later groups can end up staler.)
    """
    in_flight_cap = 2 * max(1, -(-plan.slots // plan.n_samples))
    capacity = plan.batch_size + (plan.prefetch if plan.prefetch is not None else plan.batch_size)
    with anyio.CancelScope() as scope:
        task_status.started(scope)
        while True:
            limit = in_flight_cap + max(0, capacity - collector.ready - training.groups)
            if plan.max_staleness is not None:
                ahead = collector.ready + training.groups
                limit = min(limit, (plan.max_staleness + 1) * plan.batch_size - ahead)
            if admission.outstanding < limit:
                admission.grant(limit - admission.outstanding)
            await _first_of(admission.wait_change, training.changed.wait)


async def _first_of(*waits: Callable[[], Any]) -> None:
    """Return as soon as one of `waits` returns."""
    async with anyio.create_task_group() as tg:

        async def one(wait: Callable[[], Any]) -> None:
            await wait()
            tg.cancel_scope.cancel()

        for wait in waits:
            tg.start_soon(one, wait)


def _step_counters(admission: Admission, producers: Producers) -> dict[str, float]:
    g = producers.statistics()
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
        **{f"filter/rejected/{reason}": n for reason, n in producers.filter_statistics().rejected.items()},
        **producers.metrics(),
    }

"""The controller: one run, read top to bottom, one training step at a time.

    run_pipeline(plan, engines=..., store=..., trainer=..., dataset=..., reward_fn=..., ...)
      replay the stored batches trained after the checkpoint the run resumes from (if any)
      open the Rollout (start the stage graph), then per step:
        take a batch      Rollout.next_batch: the plan's rollout mode fills it
        train it          trainer.train_step, off the event loop
        checkpoint        save the weights (a full checkpoint when due), off the event loop
        commit            the step and its metrics record, in one store transaction
        publish           the engines load the new weights; the version moves on
        evaluate          between steps, when due (sync mode)
      leave: running requests are aborted and every unfinished group is stored

Where each part lives:
- `pipeline.plan`: the plan, the run's parts and the seams (`RolloutPlan`, `RolloutParts`,
  `Engines`, `Trainer`, `RunSummary`); every module of the story imports them from there;
- `pipeline.session`: `Rollout`, the rollout side as one object (take a batch, commit, publish),
  which this loop drives and which a user's own training loop can drive instead;
- `pipeline.graph`: the stages wired, started and stopped (dispenser, generator pool, reward,
  filter, collector), and `pipeline.rollout_modes`: how each mode admits groups;
- `pipeline.checkpoints`: what a step saves, what is kept, the replay on resume;
- `pipeline.step_record`: the rollout side's keys in each step's metrics record.

Components take plain parameters; only `pipeline.run` knows the config tree and builds them.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Unpack

import anyio
import structlog

from core.clock import VersionClock
from core.errors import ConfigError
from core.types import RolloutMode
from pipeline.checkpoints import CheckpointPolicy, StepSaver, replay_then_publish
from pipeline.events import span
from pipeline.metric_names import throughput_metrics, trainer_record
from pipeline.metrics import MetricsSink, batch_metrics
from pipeline.plan import ReportsFaults, RolloutFields, RolloutParts, RolloutPlan, RunSummary, Trainer
from pipeline.session import Rollout
from pipeline.step_record import StepTimer, StepTimes, engine_loads, rollout_record

__all__ = ["run_pipeline"]

log = structlog.get_logger("pipeline")


async def run_pipeline(
    plan: RolloutPlan,
    *,
    trainer: Trainer,
    weights_dir: Path,
    metrics: MetricsSink,
    clock: VersionClock | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    evaluate: Callable[[int], Awaitable[dict[str, float]]] | None = None,
    checkpoints: CheckpointPolicy | None = None,
    resume_from: int | None = None,
    **fields: Unpack[RolloutFields],
) -> RunSummary:
    """Train `plan.num_steps` steps (those the store has not trained yet), then stop cleanly.

    The story: build the stage graph, start it, then per step wait for a batch, train it, commit
    it, publish the weights; at the end stop generating and store whatever is unfinished.

    The rollout side's parts are the keywords `Rollout` takes (`pipeline.plan.RolloutFields`:
    `engines`, `store`, `dataset`, `reward_fn`, `filter_fn`, `events`, `detokenize`, `agent`,
    `weight_transfer`, `producers`, `engine_memory`).

    `evaluate(step)` (sync mode: `pipeline.evaluation`) runs after each step's publish, when the
    engines serve that step's weights and nothing else is in flight; what it returns (nothing on
    a step that is not due) joins the step's record after the commit, as the publish times do.

    `engine_memory` (colocated, sync): the engines release their GPU memory after each round and
    the publish (`weight_transfer`) takes it back (`stages.sglang_client.publish_tensor`).

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
    # The rollout side's parts, gathered once: `Rollout` and the stage graph take them whole.
    parts = RolloutParts(**fields)
    engines, weight_transfer = parts.engines, parts.weight_transfer
    replayed = None
    if resume_from is not None and checkpoints is not None:
        assert clock is not None, "a replay needs the clock the engines were loaded at"
        replayed = await replay_then_publish(
            plan,
            trainer,
            parts.store,
            engines,
            clock,
            checkpoints,
            resume_from=resume_from,
            transfer=weight_transfer,
            memory=parts.engine_memory,
        )
    # The rollout side is the embedding object itself; this function adds the built-in trainer
    # loop and the metrics record.
    async with Rollout(plan, parts, clock=clock) as rollout:
        timer = StepTimer(rollout.first_step, rollout.graph.producers.statistics().busy_slot_seconds)
        saving = StepSaver.starting(
            checkpoints, weights_dir, plan.num_steps, rollout.first_step, weight_transfer, replayed
        )
        for step in range(rollout.first_step, plan.num_steps):
            record = await _train_one_step(rollout, trainer, saving, timer, step)
            if evaluate is not None:
                record.update(await _evaluate(evaluate, step, timer))
            # Engine faults (evictions, restarts, live engines, time at reduced capacity), when
            # the engines keep such counts (an EngineFleet with --use-fault-tolerance).
            if isinstance(engines, ReportsFaults):
                record.update(engines.fault_metrics())
            metrics.write(record)
            if on_step is not None:
                on_step(record)
            log.debug("step", **{k: record[k] for k in ("step", "rollout/raw_reward", "staleness/max")})

    return RunSummary(plan.num_steps - rollout.first_step, rollout.clock.version, metrics.records)


async def _train_one_step(
    rollout: Rollout, trainer: Trainer, saving: StepSaver, timer: StepTimer, step: int
) -> dict[str, Any]:
    """Take a batch, train it and save the weights, commit the step with its record, publish."""
    plan, clock, graph = rollout.plan, rollout.clock, rollout.graph
    t_rollout = time.perf_counter()
    batch = await rollout.next_batch()
    # The trainer waited this long for its batch: rollout time in sync mode, idle time in async.
    rollout_seconds = time.perf_counter() - t_rollout
    group_times = graph.times.taken([g.group_id for g in batch.groups])
    loads = await engine_loads(rollout.engines)

    # Training blocks for seconds; it runs on a worker thread so generation (in async mode) keeps
    # going on the event loop meanwhile.
    record = {
        "step": step,
        "version": clock.version,
        **batch_metrics(batch, version=clock.version, max_staleness=plan.max_staleness),
    }
    t_train = time.perf_counter()
    with span(rollout.parts.events, "train", step=step):
        train_metrics = await anyio.to_thread.run_sync(trainer.train_step, batch)
        t_save = time.perf_counter()
        # What a checkpoint covers, recorded in it: a resume whose store is lost reconciles from it.
        coverage = await rollout.store.coverage(step) if saving.due(step) else None
        saved = await anyio.to_thread.run_sync(saving.save, trainer, step, coverage)
        # Part of perf/train_time: the weights the engines load next (a checkpoint every --save-interval).
        record["perf/save_model_time"] = time.perf_counter() - t_save
    # Which checkpoint a resume starts from after this commit, and what the step wrote to disk.
    record["checkpoint/step"] = saving.checkpoint_step
    record["checkpoint/bytes_written"] = saved.bytes_written
    train_seconds = time.perf_counter() - t_train
    record.update(trainer_record(train_metrics))
    # A step runs from the previous commit to its own, so its time includes the previous publish
    # and the steps' times add up to the run's.
    step_seconds, busy = timer.lap(graph.producers.statistics().busy_slot_seconds)
    times = StepTimes(step_seconds, busy, rollout_seconds, train_seconds)
    record.update(await rollout_record(graph, rollout.store, timer, times, step, len(batch.groups)))
    record.update(group_times)
    record.update(loads)
    record.update(throughput_metrics(record))

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


async def _evaluate(
    evaluate: Callable[[int], Awaitable[dict[str, float]]], step: int, timer: StepTimer
) -> dict[str, float]:
    """Step `step`'s evaluation, if due, with its time; the engines serve that step's weights."""
    started = time.perf_counter()
    evaluated = await evaluate(step)
    if not evaluated:
        return {}
    # Evaluation is no part of the next step: its time is left out of that step's.
    seconds = time.perf_counter() - started
    timer.leave_out(seconds)
    return {**evaluated, "time/eval": seconds}

"""The pipeline inside a user's own program (issue 9): `Rollout`, the object a user who owns the
training loop opens over engines, store and dataset.

    async with Rollout(plan, engines=fleet, store=store, dataset=tasks, reward_fn=reward) as rollout:
        for _ in range(steps):
            batch = await rollout.next_batch()          # a full batch of ready groups
            metrics = my_trainer.train(batch)            # the user's own trainer
            folder = my_trainer.save("weights/v%d" % (rollout.version + 1))
            await rollout.commit(batch, metrics)         # the store counts the step as trained
            await rollout.publish(folder)                # the engines serve the new weights
        print(rollout.statistics())
    # leaving: running requests are aborted and every unfinished group is stored, with its prefixes

It is the same machinery `run_pipeline` and `python -m pipeline.launch` use, not a copy:
`run_pipeline` is this object plus the built-in trainer loop and the metrics record. Commit before
publish, as `run_pipeline` does: in async mode, tokens stamped with the new version must never
outlive a restart that falls back to the old checkpoint.

The stages it opens are `pipeline.graph`'s; how a batch fills in each mode is
`pipeline.rollout_modes`'s; what it is built from (`RolloutPlan`, `RolloutParts`) is `pipeline.plan`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType
from typing import Any, Self, Unpack, overload

from core.clock import VersionClock
from core.errors import ConfigError, EngineError, PipelineError, PublishError
from core.types import Batch, RolloutMode
from pipeline.events import span
from pipeline.graph import StageGraph
from pipeline.plan import Engines, HasWeightVersions, RolloutFields, RolloutParts, RolloutPlan
from pipeline.rollout_modes import Training, fill_batch
from stages.continuation import sampling_problems
from stages.publisher import PublishReport, publish_weights

__all__ = ["Rollout"]

_RELEASED_HINT = (
    "colocated, the engines had released their GPU memory for training (an engine that is gone died "
    "meanwhile); the trained step is committed, the store and the checkpoints are intact"
)


class Rollout:
    """Rollout as a service for a loop the user owns: ask for batches, hand back weights.

    Open it with `async with`; it starts the stage graph (dispenser, generator pool, reward, filter,
    collector) in one task group. `next_batch()` runs the plan's rollout mode (sync, sync with
    partial rollout, async) until a batch is ready; `commit()` records the step as trained;
    `publish()` loads a weights folder into the engines (pausing them per `plan.pause_mode`) and
    bumps the version; leaving stores everything unfinished for the next run.

    Entering recovers the store (groups left RUNNING by an unclean stop go back to PARTIAL, an
    uncommitted batch back to READY) and, unless a `clock` is given, starts the version at the step
    after the store's last trained one: the engines must already serve that step's weights.
    """

    @overload
    def __init__(
        self, plan: RolloutPlan, *, clock: VersionClock | None = None, **fields: Unpack[RolloutFields]
    ) -> None:
        """The parts as keywords: `engines=`, `store=`, `dataset=`, `reward_fn=`, and the optional
        ones of `pipeline.plan.RolloutFields`."""

    @overload
    def __init__(self, plan: RolloutPlan, parts: RolloutParts, *, clock: VersionClock | None = None) -> None:
        """The parts gathered already in one `RolloutParts` (as `run_pipeline` has them)."""

    def __init__(
        self, plan: RolloutPlan, parts: RolloutParts | None = None, *, clock: VersionClock | None = None, **fields: Any
    ) -> None:
        if parts is None:
            parts = RolloutParts(**fields)
        elif fields:
            raise TypeError(f"Rollout: parts given twice, in a RolloutParts and as keywords {sorted(fields)}")
        # Sampling parameters that a continued request would apply wrongly are refused up front.
        continues = plan.mode is RolloutMode.ASYNC or plan.partial
        if problems := sampling_problems(
            plan.sampling_params, continues=continues, can_detokenize=parts.detokenize is not None
        ):
            raise ConfigError(problems)
        self.plan = plan
        self.parts = parts
        self.engines = parts.engines
        self.store = parts.store
        # A clock of our own starts, on entry, at the version the store's last trained step published.
        self._own_clock = clock is None
        self.clock = clock or VersionClock()
        self.graph = StageGraph.build(plan, parts, self.clock)
        self._stack: AsyncExitStack | None = None
        self._training: Training | None = None
        self._next_step = 0
        self.first_step = 0  # the first step this session trains: the store's trained step + 1, on entry
        self._taken: int | None = None  # the step of the batch handed out and not yet committed

    async def __aenter__(self) -> Self:
        # After an unclean stop (a kill, an error out of the block): groups left RUNNING go back to
        # PARTIAL with their prefixes, and a batch taken but never committed back to READY. Nothing
        # else runs on this store now, so whatever is RUNNING was left behind.
        await self.store.recover()
        self.first_step = self._next_step = await self.store.trained_step() + 1
        if self._own_clock:
            # Step N's weights are version N + 1 (commit, then publish): a resumed run's engines serve
            # them, and its next weights must not overwrite an earlier version's folder.
            self.clock.start_at(self.first_step)
        await _check_engine_versions(self.engines, self.clock.version)
        stack = AsyncExitStack()
        self._training = await stack.enter_async_context(self.graph.running())
        self._stack = stack
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        stack, self._stack = self._stack, None
        assert stack is not None
        return await stack.__aexit__(kind, exc, tb)

    @property
    def version(self) -> int:
        """The policy version the engines serve."""
        return self.clock.version

    @property
    def next_step(self) -> int:
        """The step the next batch is for (steps already trained in the store are skipped)."""
        return self._next_step

    async def next_batch(self) -> Batch:
        """Wait for `plan.batch_size` ready groups and take them as the next step's batch."""
        training, graph = self._open(), self.graph
        if self._taken is not None:
            raise PipelineError(f"step {self._taken}'s batch is not committed yet: commit() it before the next batch")
        step = self._next_step
        # What the trainer finds as it asks: async pacing learns from it (`Pace.asked`).
        ready, in_flight = graph.collector.ready, graph.admission.outstanding
        if self.plan.mode is RolloutMode.SYNC:
            stopping = span(self.parts.events, "stop", step=step)
            await fill_batch(self.plan, graph.admission, graph.collector, graph.producers, stopping)
        else:
            await graph.collector.wait_ready(self.plan.batch_size)
        batch = await self.store.take_batch(step, self.plan.batch_size)
        assert batch is not None, "the collector counted more ready groups than the store holds"
        batch = dataclasses.replace(batch, train_version=self.clock.version)  # for --mask-stale-tokens
        if graph.pace is not None:
            graph.pace.asked(ready=ready, in_flight=in_flight)
        graph.collector.taken(len(batch.groups))
        training.start(len(batch.groups))
        self._taken = step
        if self.parts.engine_memory is not None and self.plan.mode is RolloutMode.SYNC:
            # Colocated: the round is over and the engines idle; their GPU memory goes to the
            # trainer until the publish takes it back (`publish_tensor.ColocatedWeights`).
            with span(self.parts.events, "release", step=step):
                await self.parts.engine_memory.release()
        return batch

    async def commit(self, batch: Batch, metrics: Mapping[str, Any] | None = None) -> None:
        """Record `batch`'s step as trained (with its metrics, in the same transaction). Call it once
        the weights trained on it are durable: a crash after this resumes from them."""
        if self._taken != batch.step:
            raise PipelineError(f"commit of step {batch.step}: the batch handed out is step {self._taken}")
        await self.store.finish_batch(batch.step, metrics)
        self._taken = None
        self._next_step = batch.step + 1

    async def publish(self, weights: str | Path) -> PublishReport:
        """Load the weights folder `weights` into every engine (the same publisher as the launcher)."""
        training = self._open()
        with span(self.parts.events, "publish", version=self.clock.version + 1):
            try:
                report = await publish_weights(
                    self.clock,
                    self.engines,
                    Path(weights),
                    pause_mode=self.plan.pause_mode,
                    transfer=self.parts.weight_transfer,
                    overlap=self.plan.overlap_publish,
                    gates=self.graph.producers.gates,
                )
            except PublishError as exc:
                if self.parts.engine_memory is None or self.plan.mode is not RolloutMode.SYNC:
                    raise
                # Colocated, the engines were released while the trainer trained: an engine that
                # cannot be reached now died in between. Say so, and what was kept.
                raise PublishError(exc.version, f"{exc.reason}; {_RELEASED_HINT}") from exc
        training.done()
        return report

    def statistics(self) -> dict[str, float]:
        """Counters so far: groups ready/rejected/failed/partial, resumed samples, aborted requests,
        generated tokens, plus the version and the ready and in-flight queues."""
        graph = self.graph
        return {
            **graph.counters(),
            "version": self.clock.version,
            "queue/ready": graph.collector.ready,
            "queue/in_flight": graph.admission.outstanding,
            **({"queue/window": graph.pace.window} if graph.pace is not None else {}),
        }

    def _open(self) -> Training:
        if self._training is None or self._stack is None:
            raise PipelineError("the Rollout is not open: use it as `async with Rollout(...) as rollout`")
        return self._training


async def _check_engine_versions(engines: Engines, version: int) -> None:
    """Every engine must report `version` before the first request: an answer from a version the
    clock did not publish is refused, so an engine that reports another one (a fresh SGLang says
    "default"; a resumed loop's engines may still serve the base model; an engine reused from
    another run says that run's last version) would have every request refused, round after round
    through the whole dataset. Engines that cannot say (a seam of the user's own, not
    `HasWeightVersions`) are trusted.

    The fix named is always a load of the weights this rollout starts from, never a new label
    (`update_weight_version`): a label says nothing about which weights an engine holds, and an
    engine relabelled over another run's weights would have step 0 train on samples of weights
    nobody trained from. The Rollout does not know those weights' folder, so it names the fix and
    stops; `python -m pipeline.launch` loads them itself (`pipeline.run.run_engines`)."""
    if not isinstance(engines, HasWeightVersions):
        return
    reported = await engines.weight_versions()
    for url, found in reported.items():
        if found == str(version):
            continue
        if version == 0:
            fix = (
                "load the weights the rollout starts from (your base model's folder) before opening it, "
                "`await engines.update_weights_from_disk(base_model_folder, weight_version='0')`, or start a "
                "fresh engine on them with --weight-version 0. Do not relabel it with update_weight_version: "
                "the version would then name weights it may not hold"
            )
        else:
            fix = (
                f"load version {version}'s weights first (what step {version - 1} saved), "
                f"`await engines.update_weights_from_disk(folder, weight_version='{version}')`, or start "
                f"SGLang with --weight-version {version} on them"
            )
        raise EngineError(url, f"reports weight_version {found!r}, but the rollout starts at version {version}: {fix}")

"""What a step's metrics record says about the rollout side: counters, rates, queue depths, times.

The controller (`pipeline.controller`) builds each step's record from the batch, the trainer's
metrics and these; the record is committed with the step, in the same store transaction. A step
runs from the previous commit to its own, so its time includes the previous publish and the
steps' times add up to the run's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from core.errors import EngineError
from pipeline.graph import StageGraph
from pipeline.metric_names import engine_load_metrics
from pipeline.plan import Engines, ReportsLoads
from storage import AsyncStore, GroupState

__all__ = ["StepTimer", "StepTimes", "engine_loads", "rollout_record"]

log = structlog.get_logger("pipeline")


@dataclass(slots=True)
class StepTimer:
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

    def leave_out(self, seconds: float) -> None:
        """Leave `seconds` (an evaluation between steps) out of the next step's time."""
        self.step_started += seconds


@dataclass(frozen=True, slots=True)
class StepTimes:
    step: float  # from the previous commit to this one
    busy: float  # slot-seconds the pool spent generating in that time
    rollout: float  # the trainer's wait for its batch
    train: float  # training and saving the weights


async def rollout_record(
    graph: StageGraph, store: AsyncStore, timer: StepTimer, times: StepTimes, step: int, groups: int
) -> dict[str, Any]:
    """The step's counters, rates and times, measured just before its commit."""
    plan, seconds = graph.plan, times.step
    return {
        **graph.counters(),
        # Slot-time in flight over the whole step: in async mode generation goes on while the
        # trainer trains, and that counts.
        "engine/busy_frac": times.busy / (plan.slots * seconds) if seconds > 0 else 0.0,
        "trainer/idle_frac": times.rollout / seconds if seconds > 0 else 0.0,
        "groups/per_second": groups / seconds if seconds > 0 else 0.0,
        "groups/per_second_run": (step + 1 - timer.first_step)
        * plan.batch_size
        / (time.perf_counter() - timer.run_started),
        "perf/step_time": seconds,
        "perf/train_wait_time": times.rollout,  # the trainer's wait for its batch
        "perf/train_time": times.train,
        "queue/ready": graph.collector.ready,
        "queue/partial": await store.count(GroupState.PARTIAL),
        "queue/quarantined": await store.count(GroupState.QUARANTINED),  # damaged records, never trained
        "queue/in_flight": graph.admission.outstanding,
        # async pacing's window: the groups it lets be ready or in flight at once
        **({"queue/window": graph.pace.window} if graph.pace is not None else {}),
    }


async def engine_loads(engines: Engines) -> dict[str, float]:
    """Each engine's running and waiting requests as the batch goes to training (in async mode
    generation goes on meanwhile), for engines that answer `GET /v1/loads` (`ReportsLoads`); none
    otherwise. An engine that fails to answer costs this step's load keys, never the step."""
    if not isinstance(engines, ReportsLoads):
        return {}
    try:
        with anyio.fail_after(5):
            return engine_load_metrics(await engines.loads())
    except (EngineError, TimeoutError) as exc:
        log.debug("engine loads unavailable", error=str(exc))
        return {}

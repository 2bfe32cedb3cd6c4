"""What one run is made of: the plan (its decisions, as plain values), the parts it runs on, and
the seams it talks through. Definitions only, nothing runs here.

    RolloutPlan   the rollout decisions: mode, batch size, slots, bounds, retries
    RolloutParts  the rollout side's parts (engines, store, dataset, reward, ...), as one object
    Engines       what the pipeline needs from its engines (generate, abort, load weights)
    Trainer       what it needs from a training backend (train a batch, save the weights)
    RunSummary    what `run_pipeline` returns

Every module of the story imports these from here (`pipeline.controller`: the step loop,
`pipeline.session`: `Rollout`, `pipeline.graph`: the stages wired, `pipeline.checkpoints`), so
none of them needs another's names and no import runs in a circle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from core.types import Batch, PauseMode, PromptTask, RolloutMode
from pipeline.events import EventLog
from stages.agent import Agent
from stages.continuation import Detokenize
from stages.generator import GenerateEngine
from stages.producers import ProducersFactory
from stages.publisher import EngineMemory, WeightTarget, WeightTransfer
from stages.reward import RewardFn
from stages.selection import LENGTH_AWARE_RULE
from stages.sglang.payloads import TokenPayloads
from storage import AsyncStore

__all__ = ["Engines", "RolloutParts", "RolloutPlan", "RunSummary", "Trainer"]


class Trainer(Protocol):
    """A training backend. Both methods block; the controller runs them off the event loop.

    A trainer that also has `step_settings` and `use_settings(settings)` (`trainers.step_settings`;
    both built-in backends do) trains each stored step a resume replays with the settings it first
    ran with (`pipeline.checkpoints`); without them, those steps run with today's."""

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
    prefetch: int | None = None  # the most ready groups kept ahead of the trainer (async)
    max_staleness: int | None = None
    pace_async: bool = True  # async: admit only as far ahead as keeps the trainer fed (`Pace`)
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
    # The prompts' stored histories (`stages.selection`): skip a prompt on a zero-reward-variance
    # streak before generating it (at least `skip_explore_floor` of them still come back), and
    # hand a sync round's new prompts to the pool longest predicted first.
    skip_zero_std: bool = False
    skip_explore_floor: float = 0.1
    length_aware_admission: bool = False

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
        if self.length_aware_admission and self.mode is RolloutMode.ASYNC:
            raise ValueError(f"RolloutPlan length_aware_admission with mode=async: {LENGTH_AWARE_RULE}")

    @property
    def ahead(self) -> int:
        """Ready groups kept ahead of the trainer in async mode: `prefetch`, or one batch's worth."""
        return self.prefetch if self.prefetch is not None else self.batch_size


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutParts:
    """The parts the rollout side of a run is built from, gathered once and handed down whole
    (`run_pipeline` -> `Rollout` -> `StageGraph.build`) rather than as the same keyword list at
    every level. The version clock is not among them: a `Rollout` may own its clock.
    """

    engines: Engines
    store: AsyncStore
    dataset: Sequence[PromptTask]
    reward_fn: RewardFn
    filter_fn: Callable[..., Any] | None = None
    events: EventLog | None = None  # the run's event log (spans of stops, trains, publishes)
    detokenize: Detokenize | None = None  # token ids to text, for sampling params that need text
    agent: Agent | None = None  # multi-turn samples; None: one request per sample
    weight_transfer: WeightTransfer | None = None  # None: engines load each published folder from disk
    producers: ProducersFactory | None = None  # None: generator pool, reward and filter in process
    # Colocated (sync): what the engines give back after each round while the trainer trains.
    engine_memory: EngineMemory | None = None


@dataclass(frozen=True, slots=True)
class RunSummary:
    """What `run_pipeline` returns: steps trained by this call, the final version, every metrics record."""

    steps: int
    final_version: int
    metrics: list[dict[str, Any]]

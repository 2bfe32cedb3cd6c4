"""What one run is made of: the plan (its decisions, as plain values), the parts it runs on, and
the seams it talks through. Definitions only, nothing runs here.

    RolloutPlan   the rollout decisions: mode, batch size, slots, bounds, retries
    RolloutParts  the rollout side's parts (engines, store, dataset, reward, ...), as one object
    RolloutFields the same parts as keywords (`Rollout(plan, engines=..., ...)`, `run_pipeline`)
    Engines       what the pipeline needs from its engines (generate, abort, load weights)
    Trainer       what it needs from a training backend (train a batch, save the weights)
    BuiltInTrainer  what the launcher needs of the trainers it builds (weights for the engines, close)
    the capabilities a seam may have, declared and checked with `isinstance` (never probed by name):
      SavesModel, ReplaysSettings, Closable        of a trainer
      ReportsFaults, HasWeightVersions, ReportsLoads  of engines
    RunSummary    what `run_pipeline` returns

Every module of the story imports these from here (`pipeline.controller`: the step loop,
`pipeline.session`: `Rollout`, `pipeline.graph`: the stages wired, `pipeline.checkpoints`), so
none of them needs another's names and no import runs in a circle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, Protocol, TypedDict, runtime_checkable

from core.types import Batch, PauseMode, PromptTask, RolloutMode
from pipeline.events import EventLog
from stages.agent import Agent
from stages.continuation import Detokenize
from stages.generator import GenerateEngine
from stages.producers import ProducersFactory
from stages.publisher import EngineMemory, WeightTarget, WeightTransfer
from stages.reward import RewardFn
from stages.selection import LENGTH_AWARE_RULE
from stages.sglang_client.payloads import TokenPayloads
from stages.sglang_client.wire import EngineLoad
from storage import AsyncStore

if TYPE_CHECKING:
    import torch

    from trainers.step_settings import StepSettings

__all__ = [
    "BuiltInTrainer",
    "Closable",
    "Engines",
    "HasWeightVersions",
    "ReplaysSettings",
    "ReportsFaults",
    "ReportsLoads",
    "RolloutFields",
    "RolloutParts",
    "RolloutPlan",
    "RunSummary",
    "SavesModel",
    "Trainer",
]


class Trainer(Protocol):
    """A training backend. Both methods block; the controller runs them off the event loop.

    What else a trainer can do is a capability it may have, each its own protocol below and
    checked with `isinstance`: `SavesModel`, `ReplaysSettings`, `Closable`. Both built-in
    backends have them all (`BuiltInTrainer`); a trainer of the user's needs none."""

    def train_step(self, batch: Batch) -> Mapping[str, float]: ...

    def save_weights(self, path: Path) -> Path:
        """The full checkpoint (weights, optimizer, random state, step count)."""
        ...


@runtime_checkable
class SavesModel(Protocol):
    """A trainer that saves the weights alone: the folders published between checkpoints are that
    (`pipeline.checkpoints`); a trainer without it saves a full checkpoint for them too."""

    def save_model(self, path: Path) -> Path: ...


@runtime_checkable
class ReplaysSettings(Protocol):
    """A trainer whose per-step settings can be changed (`trainers.step_settings`): each stored step
    a resume replays trains with the settings it first ran with (`pipeline.checkpoints`); without
    it, those steps run with today's."""

    @property
    def step_settings(self) -> StepSettings: ...

    def use_settings(self, settings: StepSettings) -> None: ...


@runtime_checkable
class Closable(Protocol):
    """A trainer with something to release at the end of a run (the megatron backend's ranks)."""

    def close(self) -> None: ...


class BuiltInTrainer(Trainer, SavesModel, ReplaysSettings, Closable, Protocol):
    """What the launcher (`pipeline.run`) needs of the trainers it builds, `trainers.grpo.GRPOTrainer`
    and `trainers.megatron.MegatronTrainer`: every capability above, and the weights for the engines
    when they travel without a folder (`--colocate`, `--update-weight-transport distributed`)."""

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def autocast(self) -> bool:
        """Trains under bf16 autocast: the engines are sent bf16 weights, as a saved folder holds."""
        ...

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The whole model under Hugging Face names and shapes (what a distributed publish sends)."""
        ...


class Engines(GenerateEngine, WeightTarget, Protocol):
    """What the pipeline needs from its engines: generate and abort (`stages.generator.GenerateEngine`)
    and pause, load weights, continue (`stages.publisher.WeightTarget`). `stages.sglang_client.EngineFleet`
    is the production one; anything speaking these methods over the SGLang protocol will do.

    What else engines can report is a capability they may have, each its own protocol below and
    checked with `isinstance`: `ReportsFaults`, `HasWeightVersions`, `ReportsLoads` (the fleet has
    them all)."""


@runtime_checkable
class ReportsFaults(Protocol):
    """Engines that count their faults (evictions, restarts, live engines, time at reduced capacity):
    each step's record gets them (`EngineFleet`; empty without a fault policy)."""

    def fault_metrics(self) -> dict[str, float]: ...


@runtime_checkable
class HasWeightVersions(Protocol):
    """Engines that say which weight version each serves: a `Rollout` checks it before the first
    request (`pipeline.session`); engines without it are trusted."""

    async def weight_versions(self) -> dict[str, str]: ...


@runtime_checkable
class ReportsLoads(Protocol):
    """Engines that say each one's running and waiting requests (`GET /v1/loads`): each step's
    record gets them (`pipeline.step_record`)."""

    async def loads(self) -> dict[str, EngineLoad]: ...


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


class RolloutFields(TypedDict):
    """The parts as keywords: what `Rollout(plan, engines=..., ...)` and `run_pipeline` take, written
    once here and checked by mypy at every call. `RolloutParts` holds the same names, the same
    types (`tests/test_seams.py` holds the two together)."""

    engines: Engines
    store: AsyncStore
    dataset: Sequence[PromptTask]
    reward_fn: RewardFn
    filter_fn: NotRequired[Callable[..., Any] | None]
    events: NotRequired[EventLog | None]
    detokenize: NotRequired[Detokenize | None]
    agent: NotRequired[Agent | None]
    weight_transfer: NotRequired[WeightTransfer | None]
    producers: NotRequired[ProducersFactory | None]
    engine_memory: NotRequired[EngineMemory | None]


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutParts:
    """The parts the rollout side of a run is built from, gathered once and handed down whole
    (`run_pipeline` -> `Rollout` -> `StageGraph.build`) rather than as the same keyword list at
    every level; built from `RolloutFields` (`RolloutParts(**fields)`). The version clock is not
    among them: a `Rollout` may own its clock.
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

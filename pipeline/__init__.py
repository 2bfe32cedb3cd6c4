"""An asyncio rollout pipeline for LLM reinforcement learning.

The public surface, importable from `pipeline` directly: the vocabulary (samples, groups, spans,
the version clock, the errors; their home is `core`), running it (`run_pipeline`, or `Rollout`
inside your own loop), agents (`Agent`, `AgentContext`), the engine seam (`Engines`,
`GenerateEngine`, `WeightTarget`, `GenerateResult`, `EngineFleet`) and the stores.
Everything else is reached by its module; `tests/test_public_api.py` holds this list.
"""

from __future__ import annotations

from core.clock import VersionClock
from core.errors import (
    AgentError,
    AgentInterrupted,
    AgentStateError,
    ConfigError,
    EngineError,
    EngineUnavailableError,
    GroupsFailingError,
    PipelineError,
    PluginError,
    PublishError,
    StoreError,
    VersionMismatchError,
)
from core.types import (
    Batch,
    FinishReason,
    Group,
    PauseMode,
    PromptTask,
    RolloutMode,
    Sample,
    SampleStatus,
    Segment,
    StoreTransport,
    VersionSpan,
)
from pipeline.config import Config, load_config
from pipeline.controller import run_pipeline
from pipeline.plan import Engines, RolloutPlan, RunSummary, Trainer
from pipeline.session import Rollout
from stages.agent import Agent, AgentContext, Turn
from stages.generator import GenerateEngine
from stages.publisher import PublishReport, WeightTarget
from stages.sglang_client import EngineFleet, GenerateResult
from storage import AsyncStore, LmdbStore, MemoryStore

__all__ = [
    "Agent",
    "AgentContext",
    "AgentError",
    "AgentInterrupted",
    "AgentStateError",
    "AsyncStore",
    "Batch",
    "Config",
    "ConfigError",
    "EngineError",
    "EngineFleet",
    "EngineUnavailableError",
    "Engines",
    "FinishReason",
    "GenerateEngine",
    "GenerateResult",
    "Group",
    "GroupsFailingError",
    "LmdbStore",
    "MemoryStore",
    "PauseMode",
    "PipelineError",
    "PluginError",
    "PromptTask",
    "PublishError",
    "PublishReport",
    "Rollout",
    "RolloutMode",
    "RolloutPlan",
    "RunSummary",
    "Sample",
    "SampleStatus",
    "Segment",
    "StoreError",
    "StoreTransport",
    "Trainer",
    "Turn",
    "VersionClock",
    "VersionMismatchError",
    "VersionSpan",
    "WeightTarget",
    "load_config",
    "run_pipeline",
]

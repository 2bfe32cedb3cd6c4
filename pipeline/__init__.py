"""An asyncio rollout pipeline for LLM reinforcement learning.

The public surface, importable from `pipeline` directly: the vocabulary (samples, groups, spans),
running it (`run_pipeline`, or `Rollout` inside your own loop), agents (`Agent`, `AgentContext`),
the engine seam (`Engines`, `GenerateEngine`, `WeightTarget`, `GenerateResult`, `EngineFleet`),
stores, and the errors. Names load on first use, so that `storage` and `stages` can import
`pipeline.types` without pulling in the controller.
"""

from __future__ import annotations

import importlib
from typing import Any

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

_HOME = {
    "Batch": "pipeline.types",
    "FinishReason": "pipeline.types",
    "Group": "pipeline.types",
    "PromptTask": "pipeline.types",
    "Sample": "pipeline.types",
    "SampleStatus": "pipeline.types",
    "Segment": "pipeline.types",
    "VersionSpan": "pipeline.types",
    "PauseMode": "pipeline.types",
    "RolloutMode": "pipeline.types",
    "StoreTransport": "pipeline.types",
    "VersionClock": "pipeline.clock",
    "Config": "pipeline.config",
    "load_config": "pipeline.config",
    "RolloutPlan": "pipeline.controller",
    "RunSummary": "pipeline.controller",
    "Trainer": "pipeline.controller",
    "run_pipeline": "pipeline.controller",
    # issue 9: agents, embedding, the engine seam, stores and errors
    "Agent": "stages.agent",
    "AgentContext": "stages.agent",
    "Turn": "stages.agent",
    "Rollout": "pipeline.session",
    "Engines": "pipeline.controller",
    "GenerateEngine": "stages.generator",
    "WeightTarget": "stages.publisher",
    "PublishReport": "stages.publisher",
    "GenerateResult": "stages.sglang",
    "EngineFleet": "stages.sglang",
    "AsyncStore": "storage",
    "MemoryStore": "storage",
    "LmdbStore": "storage",
    "PipelineError": "pipeline.errors",
    "ConfigError": "pipeline.errors",
    "PluginError": "pipeline.errors",
    "StoreError": "pipeline.errors",
    "EngineError": "pipeline.errors",
    "EngineUnavailableError": "pipeline.errors",
    "VersionMismatchError": "pipeline.errors",
    "PublishError": "pipeline.errors",
    "GroupsFailingError": "pipeline.errors",
    "AgentError": "pipeline.errors",
    "AgentStateError": "pipeline.errors",
    "AgentInterrupted": "pipeline.errors",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)

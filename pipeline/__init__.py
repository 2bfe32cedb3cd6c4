"""An asyncio rollout pipeline for LLM reinforcement learning.

The public surface, importable from `pipeline` directly. Names load on first use, so that
`storage` and `stages` can import `pipeline.types` without pulling in the controller.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Batch",
    "Config",
    "FinishReason",
    "Group",
    "PauseMode",
    "PromptTask",
    "RolloutMode",
    "RolloutPlan",
    "RunSummary",
    "Sample",
    "SampleStatus",
    "Segment",
    "StoreTransport",
    "Trainer",
    "VersionClock",
    "VersionSpan",
    "load_config",
    "run_pipeline",
]

_HOME = {
    "Batch": "pipeline.types", "FinishReason": "pipeline.types", "Group": "pipeline.types",
    "PromptTask": "pipeline.types", "Sample": "pipeline.types", "SampleStatus": "pipeline.types",
    "Segment": "pipeline.types", "VersionSpan": "pipeline.types",
    "PauseMode": "pipeline.types", "RolloutMode": "pipeline.types", "StoreTransport": "pipeline.types",
    "VersionClock": "pipeline.clock",
    "Config": "pipeline.config", "load_config": "pipeline.config",
    "RolloutPlan": "pipeline.controller", "RunSummary": "pipeline.controller",
    "Trainer": "pipeline.controller", "run_pipeline": "pipeline.controller",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)

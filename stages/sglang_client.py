"""Deprecated: the SGLang client moved to the package `stages.sglang` (wire, engine, fleet).

This module re-exports the public names so existing imports keep working, and warns once per import.
"""

from __future__ import annotations

import warnings

from stages.sglang import (
    CONTROL_HEADROOM,
    PAUSE_MODES,
    EngineClient,
    EngineFleet,
    EngineLoad,
    EngineStatistics,
    GenerateResult,
)

__all__ = [
    "CONTROL_HEADROOM",
    "PAUSE_MODES",
    "EngineClient",
    "EngineFleet",
    "EngineLoad",
    "EngineStatistics",
    "GenerateResult",
]

warnings.warn(
    "stages.sglang_client is deprecated; import from stages.sglang instead",
    DeprecationWarning,
    stacklevel=2,
)

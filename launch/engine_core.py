"""Deprecated: moved to `launch.engines.scheduler and launch.engines.request`.

This module re-exports its public names.
"""

from __future__ import annotations

import warnings

from launch.engines.request import (
    EngineClosedError,
    Finish,
    FinishKind,
    InvalidRequestError,
    PauseMode,
    Request,
)
from launch.engines.scheduler import CoreStatistics, EngineCore

__all__ = [
    "CoreStatistics",
    "EngineClosedError",
    "EngineCore",
    "Finish",
    "FinishKind",
    "InvalidRequestError",
    "PauseMode",
    "Request",
]

warnings.warn(
    "launch.engine_core is deprecated; import launch.engines.scheduler and launch.engines.request instead",
    DeprecationWarning,
    stacklevel=2,
)

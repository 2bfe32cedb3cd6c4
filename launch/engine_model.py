"""Deprecated: moved to `launch.engines.torch_model`; this module re-exports its public names."""

from __future__ import annotations

import warnings

from launch.engines.torch_model import (
    Draw,
    ModelRunner,
    Row,
    SamplingParams,
    WeightLoadError,
    uniform_draw,
)

__all__ = ["Draw", "ModelRunner", "Row", "SamplingParams", "WeightLoadError", "uniform_draw"]

warnings.warn(
    "launch.engine_model is deprecated; import launch.engines.torch_model instead",
    DeprecationWarning,
    stacklevel=2,
)

"""Deprecated: moved to `launch.engines.sim_model`; this module re-exports its public names."""

from __future__ import annotations

import warnings

from launch.engines.sim_model import (
    EOS_ID,
    FIRST_TEXT_ID,
    DecodeTimeModel,
    LengthModel,
    SimTokenizer,
    sim_logprob,
    sim_token,
    strip_generated,
)

__all__ = [
    "EOS_ID",
    "FIRST_TEXT_ID",
    "DecodeTimeModel",
    "LengthModel",
    "SimTokenizer",
    "sim_logprob",
    "sim_token",
    "strip_generated",
]

warnings.warn(
    "launch.sim_model is deprecated; import launch.engines.sim_model instead",
    DeprecationWarning,
    stacklevel=2,
)

"""Deprecated: moved to `launch.engines.protocol`; this module re-exports its public names."""

from __future__ import annotations

import warnings

from launch.engines.protocol import (
    GenerateCall,
    parse_generate,
    parse_sampling_params,
    render_output,
)

__all__ = ["GenerateCall", "parse_generate", "parse_sampling_params", "render_output"]

warnings.warn(
    "launch.engine_protocol is deprecated; import launch.engines.protocol instead",
    DeprecationWarning,
    stacklevel=2,
)

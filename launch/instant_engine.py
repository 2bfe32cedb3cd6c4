"""Deprecated: moved to `launch.engines.instant`; this module re-exports its public names."""

from __future__ import annotations

import sys
import warnings

from launch.engines.instant import InstantEngine, main

__all__ = ["InstantEngine", "main"]

warnings.warn(
    "launch.instant_engine is deprecated; import launch.engines.instant instead",
    DeprecationWarning,
    stacklevel=2,
)

if __name__ == "__main__":  # `python -m launch.instant_engine` keeps working
    sys.exit(main())

"""Deprecated: moved to `launch.engines.sim`; this module re-exports its public names."""

from __future__ import annotations

import sys
import warnings

from launch.engines.sim import (
    SimClock,
    SimModel,
    SimServer,
    SimStatistics,
    main,
    open_sim_server,
    options_from_args,
    serve,
)

__all__ = [
    "SimClock",
    "SimModel",
    "SimServer",
    "SimStatistics",
    "main",
    "open_sim_server",
    "options_from_args",
    "serve",
]

warnings.warn(
    "launch.sim_engine is deprecated; import launch.engines.sim instead",
    DeprecationWarning,
    stacklevel=2,
)

if __name__ == "__main__":  # `python -m launch.sim_engine` keeps working
    sys.exit(main())

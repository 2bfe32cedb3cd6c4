"""Deprecated: moved to `launch.engines.builtin`; this module re-exports its public names."""

from __future__ import annotations

import sys
import warnings

from launch.engines.builtin import EngineServer, main, open_server, serve

__all__ = ["EngineServer", "main", "open_server", "serve"]

warnings.warn(
    "launch.engine_server is deprecated; import launch.engines.builtin instead",
    DeprecationWarning,
    stacklevel=2,
)

if __name__ == "__main__":  # `python -m launch.engine_server` keeps working
    sys.exit(main())

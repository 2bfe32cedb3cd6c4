"""Deprecated: this module moved to `stages.tasks.jsonl`."""

from __future__ import annotations

import warnings

from stages.tasks.jsonl import *  # noqa: F403
from stages.tasks.jsonl import __all__ as __all__

warnings.warn(
    "stages.jsonl_task is deprecated; import from stages.tasks.jsonl instead", DeprecationWarning, stacklevel=2
)

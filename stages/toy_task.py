"""Deprecated: this module moved to `stages.tasks.toy`."""

from __future__ import annotations

import warnings

from stages.tasks.toy import *  # noqa: F403
from stages.tasks.toy import __all__ as __all__

warnings.warn("stages.toy_task is deprecated; import from stages.tasks.toy instead", DeprecationWarning, stacklevel=2)

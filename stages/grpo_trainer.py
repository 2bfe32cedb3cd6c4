"""Deprecated: the trainer moved to `stages.trainer` (`stages.trainer.grpo`)."""

from __future__ import annotations

import warnings

from stages.trainer.checkpoint import OPTIMIZER_DIR
from stages.trainer.grpo import GRPOTrainer, group_advantages

__all__ = ["OPTIMIZER_DIR", "GRPOTrainer", "group_advantages"]

warnings.warn("stages.grpo_trainer is deprecated; import from stages.trainer instead", DeprecationWarning, stacklevel=2)

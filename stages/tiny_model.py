"""Deprecated: this module moved to `stages.tasks.tiny_model`."""

from __future__ import annotations

import warnings

from stages.tasks.tiny_model import (
    BOS_ID,
    CHARS,
    EOS_ID,
    PAD_ID,
    SPECIALS,
    VOCAB_SIZE,
    build_tokenizer,
    make_model_folder,
)

__all__ = ["BOS_ID", "CHARS", "EOS_ID", "PAD_ID", "SPECIALS", "VOCAB_SIZE", "build_tokenizer", "make_model_folder"]

warnings.warn(
    "stages.tiny_model is deprecated; import from stages.tasks.tiny_model instead", DeprecationWarning, stacklevel=2
)

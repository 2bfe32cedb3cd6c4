"""A sample's per-token columns (`core.columns`) as tensors: one copy, no Python object per token.

`torch.tensor(column)` reads an array item by item, slower than it reads a tuple; `torch.frombuffer`
reads the array's memory as it is. The copy is what keeps the sample read-only: a tensor that
shared the column's memory would change the sample when written to.
"""

from __future__ import annotations

import torch

from core.columns import LogProbs, LossMask, TokenIds

__all__ = ["column_tensor"]

_DTYPES = {TokenIds.code: torch.int32, LogProbs.code: torch.float64, LossMask.code: torch.uint8}


def column_tensor(column: TokenIds | LogProbs | LossMask, dtype: torch.dtype) -> torch.Tensor:
    """`column` as a new 1-D CPU tensor of `dtype`."""
    if len(column) == 0:
        return torch.empty(0, dtype=dtype)  # frombuffer refuses an empty buffer
    return torch.frombuffer(column, dtype=_DTYPES[column.code]).to(dtype, copy=True)

"""SC's sampler heads (`Sample.heads`: the engine's top-k log-probs at each token) as tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from core.types import Sample

__all__ = ["Heads", "sampler_heads"]


@dataclass(frozen=True, slots=True)
class Heads:
    """The sampler heads of a minibatch (SC), laid out [sample, response position, k]."""

    ids: torch.Tensor  # long; 0 where there is no head (see `valid`)
    logprobs: torch.Tensor  # float, the sampler's log-probs at `ids`
    valid: torch.Tensor  # [B, R] bool: the token has a head from a sampler


def sampler_heads(samples: Sequence[Sample], width: int, device: torch.device) -> Heads:
    """`Sample.heads` of `samples` as tensors; a sample without heads, or a row of id -1
    (environment tokens), has none there."""
    k = next((s.heads.k for s in samples if s.heads is not None), 1)
    ids = torch.zeros((len(samples), width, k), dtype=torch.long)
    logprobs = torch.zeros((len(samples), width, k), dtype=torch.float32)
    valid = torch.zeros((len(samples), width), dtype=torch.bool)
    for i, s in enumerate(samples):
        h = s.heads
        if h is None or not len(h):
            continue
        if h.k != k:
            raise ValueError(f"sample {s.index}: sampler heads of top-{h.k}, the batch's are top-{k}")
        n = len(h)
        got = torch.from_numpy(np.frombuffer(h.token_ids_data, dtype="<i4").astype(np.int64)).reshape(n, k)
        lps = torch.from_numpy(np.frombuffer(h.logprobs_data, dtype="<f8").astype(np.float32)).reshape(n, k)
        has = (got >= 0).all(dim=-1)
        ids[i, :n] = got.clamp(min=0)
        logprobs[i, :n] = lps
        valid[i, :n] = has
    return Heads(ids.to(device), logprobs.to(device), valid.to(device))

"""Packed micro-batches: several samples in one sequence, and their log-probs over a split vocabulary.

The sequence is every row's prompt+response back to back (no padding to the longest); a
block-diagonal causal mask keeps each row to itself, and RoPE only sees position differences, so
packing leaves every token's log-prob unchanged. Only the positions that predict a response token
go through the vocab-parallel softmax: each TP rank holds a slice of the logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from stages.trainer.megatron.rows import Row

__all__ = ["packed_logprobs"]


def packed_logprobs(
    model: torch.nn.Module, rows: Sequence[Row], *, temperature: float, device: torch.device, tp_group: Any, tp: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the response tokens of `rows` and the entropy at each, packed: [sum of responses]."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    ids: list[int] = []
    predict: list[int] = []
    blocks: list[int] = []
    targets: list[int] = []
    for r in rows:
        p = len(r.prompt_ids)
        predict += range(len(ids) + p - 1, len(ids) + p - 1 + len(r.response_ids))
        ids += r.prompt_ids + r.response_ids
        targets += r.response_ids
        blocks.append(p + len(r.response_ids))
    owner = torch.repeat_interleave(torch.arange(len(blocks)), torch.tensor(blocks))
    position = torch.arange(len(ids))
    hidden = (owner[:, None] != owner[None, :]) | (position[None, :] > position[:, None])  # True = masked
    tokens = torch.tensor(ids, device=device)[None]
    logits = model(tokens, position.to(device)[None], attention_mask=hidden.to(device)[None, None])
    picked = logits[0, torch.tensor(predict, device=device)].float() / temperature  # [R, V / tp]
    target = torch.tensor(targets, device=device)
    # -log softmax(logits)[target] over the whole vocabulary, each TP rank holding a slice of it.
    logp = -vocab_parallel_cross_entropy(picked[:, None].clone(), target[:, None])[:, 0]
    return logp, _entropy(picked.detach(), tp_group, tp)


@torch.no_grad()
def _entropy(logits: torch.Tensor, tp_group: Any, tp: int) -> torch.Tensor:
    """Entropy of softmax(logits) per row, the vocabulary split over the TP group: [R]."""
    peak = logits.max(dim=-1, keepdim=True).values
    if tp > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - peak
    weights = shifted.exp()
    parts = torch.stack([weights.sum(-1), (weights * shifted).sum(-1)])
    if tp > 1:
        dist.all_reduce(parts, group=tp_group)
    return parts[0].log() - parts[1] / parts[0]  # log Z - E[shifted]

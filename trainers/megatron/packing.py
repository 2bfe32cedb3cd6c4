"""Packed micro-batches: several samples in one sequence, and their log-probs over a split vocabulary.

The sequence is every row's prompt+response back to back (no padding to the longest); a
block-diagonal causal mask keeps each row to itself, and RoPE only sees position differences, so
packing leaves every token's log-prob unchanged. Only the positions that predict a response token
go through the vocab-parallel softmax: each TP rank holds a slice of the logits.

`pack` builds the model's inputs (every pipeline stage builds the same ones from the rows: the
mask on each, the tokens for the first); `head_logprobs` turns the last stage's logits into
log-probs and entropies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainers.megatron.rows import Row

__all__ = ["Packed", "head_logprobs", "pack", "packs", "sampler_head_logprobs"]


@dataclass(frozen=True, slots=True)
class Packed:
    """One packed micro-batch: the model's inputs, and which logits predict which response token."""

    tokens: torch.Tensor  # [1, S]
    position: torch.Tensor  # [1, S]
    mask: torch.Tensor  # [1, 1, S, S], True = masked
    predict: torch.Tensor  # [R]: the positions whose logits predict a response token
    target: torch.Tensor  # [R]: those tokens

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])


def packs(rows: Sequence[Row], *, max_rows: int, max_tokens: int | None) -> list[list[Row]]:
    """`rows` cut in order into micro-batches of at most `max_rows` rows and, with `max_tokens`
    (`--max-tokens-per-gpu`), at most that many packed tokens (a row longer than the budget gets a
    micro-batch of its own). Every rank computes the same cut from the same rows."""
    out: list[list[Row]] = []
    tokens = 0
    for row in rows:
        n = len(row.prompt_ids) + len(row.response_ids)
        if out and len(out[-1]) < max_rows and (max_tokens is None or tokens + n <= max_tokens):
            out[-1].append(row)
            tokens += n
        else:
            out.append([row])
            tokens = n
    return out


def pack(rows: Sequence[Row], device: torch.device, *, length: int | None = None) -> Packed:
    """The rows' prompts and responses as one sequence, each row attending only to itself.

    `length`: pad the sequence to that many tokens with a block of token 0 that attends only to
    itself and predicts nothing (expert parallel: the all-gather dispatcher joins equal lengths)."""
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
    if length is not None and length > len(ids):
        blocks.append(length - len(ids))
        ids += [0] * (length - len(ids))
    owner = torch.repeat_interleave(torch.arange(len(blocks)), torch.tensor(blocks))
    position = torch.arange(len(ids))
    hidden = (owner[:, None] != owner[None, :]) | (position[None, :] > position[:, None])
    return Packed(
        tokens=torch.tensor(ids, device=device)[None],
        position=position.to(device)[None],
        mask=hidden.to(device)[None, None],
        predict=torch.tensor(predict, device=device, dtype=torch.long),
        target=torch.tensor(targets, device=device, dtype=torch.long),
    )


def head_logprobs(
    logits: torch.Tensor, packed: Packed, *, temperature: float, tp_group: Any, tp: int, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the response tokens and the entropy at each, from the logits [1, S, V / tp]: [R] each.

    The entropy carries a gradient only with `entropy_grad` (an `--entropy-coef` term in the loss)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    picked = logits[0, packed.predict].float() / temperature  # [R, V / tp]
    # -log softmax(logits)[target] over the whole vocabulary, each TP rank holding a slice of it.
    logp = -vocab_parallel_cross_entropy(picked[:, None].clone(), packed.target[:, None])[:, 0]
    if entropy_grad:
        return logp, _entropy(picked, tp_group, tp)
    with torch.no_grad():
        return logp, _entropy(picked.detach(), tp_group, tp)


def _entropy(logits: torch.Tensor, tp_group: Any, tp: int) -> torch.Tensor:
    """Entropy of softmax(logits) per row, the vocabulary split over the TP group: [R].

    Differentiable: the sums over the vocabulary slices meet in megatron's all-reduce whose
    backward is the identity (each TP rank computes the same loss from the same totals). The
    peak only shifts the logits for a stable exp; it cancels, so it carries no gradient."""
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    peak = logits.detach().max(dim=-1, keepdim=True).values
    if tp > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - peak
    weights = shifted.exp()
    parts = torch.stack([weights.sum(-1), (weights * shifted).sum(-1)])
    if tp > 1:
        parts = reduce_from_tensor_model_parallel_region(parts)
    return parts[0].log() - parts[1] / parts[0]  # log Z - E[shifted]


def sampler_head_logprobs(
    logits: torch.Tensor, packed: Packed, ids: torch.Tensor, *, temperature: float
) -> torch.Tensor:
    """SC: the trainer's log-probs at the sampler's head ids [R, k] (long, whole-vocabulary ids), with
    gradient, the vocabulary split over the TP group: `logit_v / T - log Z` for each id.

    Each id's logit lives on the one TP rank whose slice holds it; the others add 0, and the sum
    meets in megatron's all-reduce (identity backward: each rank's gradient reaches only its slice).
    log Z is the vocabulary's log-sum-exp, its parts summed the same way."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    picked = logits[0, packed.predict].float() / temperature  # [R, V / tp]
    width = picked.shape[-1]
    local = ids - tp_rank * width
    here = (local >= 0) & (local < width)
    at = picked.gather(-1, local.clamp(0, width - 1)).masked_fill(~here, 0.0)
    peak = picked.detach().max(dim=-1, keepdim=True).values
    if tp > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    total = (picked - peak).exp().sum(-1, keepdim=True)
    if tp > 1:
        at = reduce_from_tensor_model_parallel_region(at)
        total = reduce_from_tensor_model_parallel_region(total)
    return at - peak - total.log()

"""The GRPO token loss on flat rows of numbers, the form megatron ranks exchange.

TODO(merge with a1-trainer): `stages/trainer/loss.py` becomes the one loss module of both
backends; `token_loss` and `grpo_rows` then call it. Until it lands this mirrors, term by term,
`GRPOTrainer.train_step` (PPO clip against the detached current log-probs, per-token TIS weight
against the behaviour log-probs, token mean over the whole batch) and reuses its advantages and
sample rules (`group_advantages`, `_trains`), so the parity test pins the two together.

Rank 0 turns a `Batch` into `RowTokens` (one per sample: tokens, behaviour log-probs, the mask
after every rule, the advantage); followers receive only rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.types import Batch, Sample
from stages.grpo_trainer import _mean, _std, _trains, group_advantages

__all__ = ["LossPart", "PackedTokens", "RowTokens", "TokenLoss", "grpo_rows", "token_loss"]


@dataclass(frozen=True, slots=True)
class TokenLoss:
    eps_clip: float
    eps_clip_high: float
    tis_cap: float | None
    temperature: float


@dataclass(frozen=True, slots=True)
class RowTokens:
    """One sample as the loss sees it. `mask` is 0 everywhere for a sample that does not train."""

    prompt_ids: list[int]
    response_ids: list[int]
    behaviour: list[float]
    mask: list[float]
    advantage: float

    @classmethod
    def from_sample(cls, s: Sample, *, mask: Sequence[int] | None = None, advantage: float = 0.0) -> RowTokens:
        return cls(list(s.prompt_ids), list(s.response_ids), [float(x) for x in s.logprobs],
                   [float(m) for m in (mask if mask is not None else [0] * s.response_len)], advantage)

    def to_json(self) -> list[Any]:
        return [self.prompt_ids, self.response_ids, self.behaviour, self.mask, self.advantage]

    @classmethod
    def from_json(cls, raw: list[Any]) -> RowTokens:
        return cls(*raw)



@dataclass(frozen=True, slots=True)
class PackedTokens:
    """The response tokens of several rows back to back, each with its row's advantage."""

    response_ids: list[int]
    behaviour: list[float]
    mask: list[float]
    advantage: list[float]

    @classmethod
    def of(cls, rows: Sequence[RowTokens]) -> PackedTokens:
        out = cls([], [], [], [])
        for r in rows:
            out.response_ids.extend(r.response_ids)
            out.behaviour.extend(r.behaviour)
            out.mask.extend(r.mask)
            out.advantage.extend([r.advantage] * len(r.response_ids))
        return out


def grpo_rows(batch: Batch, *, mask_offpolicy: bool) -> tuple[list[RowTokens], dict[str, float]]:
    """Rows with advantages and final masks, plus the metrics only the Batch knows (as the torch trainer)."""
    if not batch.samples:
        raise ValueError(f"batch {batch.step} has no samples")
    rows: list[RowTokens] = []
    trained: list[Sample] = []
    trained_adv: list[float] = []
    total_response = 0
    for group in batch.groups:
        rewards = [s.reward if _trains(s) else None for s in group.samples]
        for s, r, adv in zip(group.samples, rewards, group_advantages(rewards), strict=True):
            total_response += s.response_len
            mask = [0] * s.response_len
            if r is not None:
                mask = list(s.loss_mask)
                if mask_offpolicy and s.resumed_at:
                    cut = min(s.resumed_at[0], len(mask))
                    mask[:cut] = [0] * cut
                trained.append(s)
                trained_adv.append(adv)
            rows.append(RowTokens.from_sample(s, mask=mask, advantage=adv))
    n_tokens = sum(sum(r.mask) for r in rows)
    return rows, {
        "reward_mean": _mean([float(s.reward) for s in trained if s.reward is not None]),
        "response_len_mean": _mean([float(s.response_len) for s in trained]),
        "mask_ratio": n_tokens / total_response if total_response else 0.0,
        "advantage_std": _std(trained_adv),
    }


@dataclass(frozen=True, slots=True)
class LossPart:
    loss: torch.Tensor  # this micro-batch's share of the batch loss (divided by the batch's tokens)
    sums: torch.Tensor  # float64 [loss, clipped, tis over cap, tis, |old - behaviour|], masked sums


def token_loss(cfg: TokenLoss, logp: torch.Tensor, rows: PackedTokens, *, n_tokens: float) -> LossPart:
    """PPO-clip x TIS loss of the packed tokens `logp` (aligned with `rows`)."""
    device = logp.device
    behaviour = torch.tensor(rows.behaviour, dtype=torch.float32, device=device)
    mask = torch.tensor(rows.mask, dtype=torch.float32, device=device)
    adv = torch.tensor(rows.advantage, dtype=torch.float32, device=device)
    old = logp.detach()  # one optimizer step per batch: the proximal policy is the current one
    ratio = torch.exp(logp - old)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.eps_clip, 1.0 + cfg.eps_clip_high)
    pg = torch.maximum(unclipped, clipped)
    tis_raw = torch.exp(old - behaviour)
    tis = tis_raw if cfg.tis_cap is None else tis_raw.clamp(max=cfg.tis_cap)
    loss = (pg * tis * mask).sum() / n_tokens
    with torch.no_grad():
        over = (tis_raw > cfg.tis_cap).float() if cfg.tis_cap is not None else torch.zeros_like(mask)
        sums = torch.stack([
            loss.detach(), ((clipped > unclipped).float() * mask).sum(), (over * mask).sum(),
            (tis * mask).sum(), ((old - behaviour).abs() * mask).sum(),
        ]).double().cpu()
    return LossPart(loss, sums)

"""The trainer's per-step metrics, from the totals its minibatches accumulate.

Token averages are over the tokens the masks let train (loss mask and version masks), except where
a name says otherwise; `versions/tokens_vN` counts those tokens per policy version.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence

import torch

from pipeline.types import Sample, SampleStatus

from .loss import ImportanceWeights, approx_kl_k3

__all__ = ["step_metrics", "tally_minibatch"]


@torch.no_grad()
def tally_minibatch(
    totals: defaultdict[str, float],
    *,
    loss: torch.Tensor,
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    train: torch.Tensor,
    weight: torch.Tensor,
    clipped: torch.Tensor,
    entropy: torch.Tensor,
    iw: ImportanceWeights,
) -> None:
    """Add one minibatch's sums to `totals`, which `step_metrics` turns into the step's metrics.

    Every backend calls this with its padded [rows, tokens] tensors, so the torch and megatron
    trainers report the same metric from the same sum. `mask` is the tokens the masks let count,
    `train` those that train after the importance correction and OPSM dropped theirs."""
    kl = approx_kl_k3(proximal, behaviour, mask)
    train_f = train.float()
    totals["loss"] += float(loss)
    totals["trained_tokens"] += float(train.sum())
    totals["masked_tokens"] += float(mask.sum())
    totals["clipped"] += float((clipped & train).sum())
    totals["entropy"] += float((entropy * mask).sum())
    totals["kl_k3"] += float((kl * mask).sum())
    totals["abs_diff"] += float((proximal - behaviour).abs().masked_fill(~mask, 0.0).sum())
    totals["weight_sum"] += float((iw.raw * mask).sum())
    totals["weight_max"] = max(totals["weight_max"], float(iw.raw.masked_fill(~mask, 0.0).max()))
    totals["tis_clipped"] += float((iw.clipped & mask).sum())
    totals["is_dropped"] += float((iw.dropped & mask).sum())
    totals["applied_weight"] += float((weight * train_f).sum())


def step_metrics(
    samples: Sequence[Sample],
    trains: Sequence[bool],
    advantages: Sequence[float],
    valid: torch.Tensor,
    mask: torch.Tensor,
    versions: torch.Tensor,
    totals: defaultdict[str, float],
    n_minibatches: int,
) -> dict[str, float]:
    """The step's metrics (names without the `train/` prefix the controller adds)."""
    masked = max(totals["masked_tokens"], 1.0)
    trained_tokens = totals["trained_tokens"]
    trained = [s for s, tr in zip(samples, trains, strict=True) if tr]
    trained_adv = [a for a, tr in zip(advantages, trains, strict=True) if tr]
    total_response = float(valid.sum())
    out = {
        "loss": totals["loss"] / n_minibatches,
        "pg_clipfrac": totals["clipped"] / max(trained_tokens, 1.0),
        "entropy": totals["entropy"] / masked,
        "approx_kl_k3": totals["kl_k3"] / masked,
        "is_weight_mean": totals["weight_sum"] / masked,
        "is_weight_max": totals["weight_max"],
        "tis_clip_ratio": totals["tis_clipped"] / masked,
        "tis_mean": totals["applied_weight"] / max(trained_tokens, 1.0),
        "is_mask_frac": totals["is_dropped"] / masked,
        "opsm_mask_frac": totals["opsm_dropped"] / masked,
        "train_rollout_logprob_abs_diff": totals["abs_diff"] / masked,
        "reward_mean": _mean([float(s.reward) for s in trained if s.reward is not None]),
        "response_len_mean": _mean([float(s.response_len) for s in trained]),
        "truncated_ratio": _mean([float(s.status is SampleStatus.TRUNCATED) for s in samples]),
        "mask_ratio": trained_tokens / total_response if total_response else 0.0,
        "advantage_std": _std(trained_adv),
        "grad_norm": totals["grad_norm"] / max(totals["optimizer_steps"], 1.0),
        "optimizer_steps": totals["optimizer_steps"],
        "tokens": trained_tokens,  # response tokens that trained this step
    }
    for version, count in sorted(Counter(versions[mask].tolist()).items()):
        out[f"versions/tokens_v{version}"] = float(count)
    return out


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _std(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))

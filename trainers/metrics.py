"""The trainer's per-step metrics, from the totals its minibatches accumulate.

Token averages are over the tokens the masks let train (loss mask and version masks), except where
a name says otherwise. The policy versions of those tokens are summarised in a fixed set of keys
(`versions/oldest`, `versions/newest`, `versions/distinct`, `versions/newest_token_frac`), not one key
per version: a dashboard's key count must not grow with the run.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from core.types import Batch, Sample, SampleStatus

from .loss import PolicyLoss, approx_kl_k3

__all__ = ["step_metrics", "tally_minibatch"]


@torch.no_grad()
def tally_minibatch(
    totals: defaultdict[str, float],
    pl: PolicyLoss,
    *,
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor,
    scale: float = 1.0,
) -> None:
    """Add one minibatch's sums to `totals`, which `step_metrics` turns into the step's metrics.

    Every backend calls this with its padded [rows, tokens] tensors and the `policy_loss` it
    computed, so the torch and megatron trainers report the same metric from the same sum. `mask`
    is the tokens the masks let count. `scale` is the share of its minibatch's loss a megatron
    micro-batch carries (1 for a whole minibatch), applied to the loss terms."""
    kl = approx_kl_k3(proximal, behaviour, mask)
    iw = pl.iw
    train = pl.train
    train_f = train.float()
    totals["loss"] += float(pl.loss.detach()) * scale
    totals["pg_loss"] += float(pl.pg_loss) * scale
    totals["kl_loss"] += float(pl.kl_loss) * scale
    totals["entropy_loss"] += float(pl.entropy_loss) * scale
    totals["trained_tokens"] += float(train.sum())
    totals["masked_tokens"] += float(mask.sum())
    totals["clipped"] += float((pl.clipped & train).sum())
    totals["entropy"] += float((entropy.detach() * mask).sum())
    totals["kl_k3"] += float((kl * mask).sum())
    totals["abs_diff"] += float((proximal - behaviour).abs().masked_fill(~mask, 0.0).sum())
    totals["weight_sum"] += float((iw.raw * mask).sum())
    totals["weight_max"] = max(totals["weight_max"], float(iw.raw.masked_fill(~mask, 0.0).max()))
    totals["tis_clipped"] += float((iw.clipped & mask).sum())
    totals["is_dropped"] += float((iw.dropped & mask).sum())
    totals["opsm_dropped"] += float(pl.opsm_dropped.sum())
    totals["applied_weight"] += float((pl.weight * train_f).sum())


def step_metrics(
    batch: Batch,
    trains: Sequence[bool],
    advantages: Sequence[float],
    valid: torch.Tensor,
    mask: torch.Tensor,
    versions: torch.Tensor,
    totals: defaultdict[str, float],
    n_minibatches: int,
) -> dict[str, float]:
    """The step's metrics, under the trainer's names (`pipeline.metric_names.trainer_record` gives
    the step record's: `train/<name>`, or slime's name where slime has one)."""
    samples = batch.samples
    masked = max(totals["masked_tokens"], 1.0)
    trained_tokens = totals["trained_tokens"]
    trained = [s for s, tr in zip(samples, trains, strict=True) if tr]
    trained_adv = [a for a, tr in zip(advantages, trains, strict=True) if tr]
    rewards = [float(s.reward) for s in trained if s.reward is not None]
    total_response = float(valid.sum())
    out = {
        "loss": totals["loss"] / n_minibatches,
        "pg_loss": totals["pg_loss"] / n_minibatches,
        "kl_loss": totals["kl_loss"] / n_minibatches,
        "entropy_loss": totals["entropy_loss"] / n_minibatches,
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
        "reward_mean": _mean(rewards),
        "reward_std": _std(rewards),
        "reward_min": min(rewards, default=0.0),
        "reward_max": max(rewards, default=0.0),
        "zero_std_groups": float(sum(1 for g in batch.groups if _zero_std(g.samples))),
        "response_len_mean": _mean([float(s.response_len) for s in trained]),
        "truncated_ratio": _mean([float(s.status is SampleStatus.TRUNCATED) for s in samples]),
        "mask_ratio": trained_tokens / total_response if total_response else 0.0,
        "advantage_std": _std(trained_adv),
        "grad_norm": totals["grad_norm"] / max(totals["optimizer_steps"], 1.0),
        "optimizer_steps": totals["optimizer_steps"],
        "lr": totals["lr"],
        "tokens": trained_tokens,  # response tokens that trained this step
    }
    # --max-step-kl: the largest step, as proposed and as taken, and the halvings. Present on every
    # step while the bound is on (a fixed key set): a step with no optimizer step moved the policy
    # by exactly 0, so all four are 0 then (train/optimizer_steps 0 says why).
    if "step_kl_bound" in totals:
        out["step_kl_max"] = totals["step_kl"]
        out["step_kl_proposed_max"] = totals["step_kl_proposed"]
        out["step_kl_halvings"] = totals["step_kl_halvings"]
        out["step_kl_undone"] = totals["step_kl_undone"]
    if "ref_log_probs_time" in totals:  # seconds of the reference model's forwards (--use-kl-loss)
        out["ref_log_probs_time"] = totals["ref_log_probs_time"]
    trained_versions = versions[mask]
    if trained_versions.numel():
        newest = int(trained_versions.max())
        out["versions/oldest"] = float(trained_versions.min())
        out["versions/newest"] = float(newest)
        out["versions/distinct"] = float(len(set(trained_versions.tolist())))
        out["versions/newest_token_frac"] = float((trained_versions == newest).float().mean())
    return out


def _zero_std(samples: Sequence[Sample]) -> bool:
    """A group whose trained rewards are all equal: GRPO gives every sample advantage 0."""
    rewards = [float(s.reward) for s in samples if s.status is not SampleStatus.FAILED and s.reward is not None]
    return len(rewards) > 0 and max(rewards) - min(rewards) <= 1e-6


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _std(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))

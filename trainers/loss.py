"""The GRPO loss as pure functions on tensors, shared by every trainer backend.

The torch trainer (`trainers.grpo`) calls these on [B, R] tensors (B samples, R response
positions, right-padded); a Megatron backend calls the same functions on its micro-batches. Nothing
here touches a model, an optimizer or a `Sample`: inputs are log-probs, masks, versions and rewards.

Three policies take part (the decoupled objective of AReaL; slime's "3-policy PPO"):
    behaviour  mu      the engine's log-probs, token by token (`Sample.logprobs`): a token carries
                       the log-prob of the version that produced it
    proximal   pi_prox the trainer's log-probs recomputed once, before the first optimizer step of a
                       rollout batch
    target     pi      the weights being trained

Per token t of a sample with advantage A (scalars broadcast over the sample's tokens):

    ratio_t = pi_t / pi_prox_t                           (PPO ratio, against the proximal policy)
    pg_t    = max(-A * ratio_t, -A * clip(ratio_t, 1 - eps_clip, 1 + eps_clip_high))
    r_t     = pi_prox_t / mu_t                           (importance weight, detached)
    loss_t  = w(r)_t * pg_t

With one optimizer step per rollout batch, pi_prox = pi at the step, ratio = 1, and the clip never
acts; `--global-batch-size` smaller than the batch gives several steps, and the clip bounds the
later ones. The importance weight `w` (`--use-tis`, `--tis-mode`, bounds `--tis-clip-low` = lo and
`--tis-clip` = hi):

    none       w_t = 1                                      (`--no-use-tis`: no correction at all)
    truncate   w_t = clamp(r_t, lo, hi)                     (TIS; slime's vanilla_tis_function)
    icepop     w_t = r_t if lo <= r_t <= hi else 0          (IcePop: drop tokens the engine and the
                                                             trainer disagree on, keep the rest unbiased)
    seq-mask   g   = exp(mean_t log r_t)  over the sample's trainable tokens (geometric mean)
               w_t = clamp(r_t, lo, hi) if lo <= g <= hi else 0   (the whole sample leaves the loss)

OPSM (`--use-opsm --opsm-delta d`, slime's Off-Policy Sequence Masking) drops a sample whose
advantage is negative and whose mean `log mu_t - log pi_t` over its trainable tokens exceeds `d`:
negative samples the current policy has already moved away from teach nothing but noise. `pi` is
the current policy (slime's), or with `--opsm-against proximal` the proximal one (the log-probs
before the rollout batch's first optimizer step): then only the rollout's staleness counts, not
the batch's own earlier optimizer steps, which PPO's clip bounds in every mode (with the current
policy, a second minibatch's negative samples whose likelihood the first step lowered are dropped
in an on-policy batch too).

Token masks (a token trains only if every one allows it):
    loss mask          `Sample.loss_mask` (1 = the token trains)
    off-policy mask    `--mask-offpolicy-in-partial-rollout`: version_t == max version of the sample
                       (only the last policy's tokens train; from the version spans, so a request that
                       crossed a publish, or a continuation at the same version, is handled right)
    staleness mask     `--mask-stale-tokens K`: version_t >= train_version - K (tokens too old for
                       the trust region get loss 0; the group and its other tokens still train)
    truncated mask     `--mask-truncated-samples`: a truncated sample trains no token, but its reward
                       still counts in its group's mean and std

Advantages (`group_advantages`): `A_i = (R_i - mean(R)) / (std(R) + 1e-6)` over a group's rewards,
or `R_i - mean(R)` with `--disable-grpo-std-normalization` (Dr.GRPO). R is the task reward plus the
DAPO overlong penalty (`--overlong-buffer-len L_buf --overlong-penalty-factor f`, max length L_max):

    penalty(L) = 0                              if L <= L_max - L_buf
                 -f * (L - (L_max - L_buf)) / L_buf   otherwise (reaching -f at L_max)

Reference KL and entropy (`--use-kl-loss --kl-loss-coef beta --kl-loss-type`, `--entropy-coef e`;
slime's names and semantics). pi_ref is a frozen reference model (the run's initial weights, or
`--ref-load`); with d_t = log pi_t - log pi_ref_t (pi_t: the weights being trained, with gradient)

    k1          kl_t = d_t
    k2          kl_t = d_t^2 / 2
    k3          kl_t = exp(-d_t) - 1 + d_t                   (Schulman's non-negative estimator)
    low_var_kl  kl_t = clamp(k3 with d_t clamped to [-20, 20], -10, 10)   (verl's; slime clamps only
                                                              the result, so a large |d| overflows exp)

    per-token objective:  loss_t = w(r)_t * pg_t + beta * kl_t - e * H_t

where H_t is the entropy of pi's next-token distribution at t (with gradient when e != 0). The
three terms share the trained-token mask and the aggregation below, so `pg_loss`, `kl_loss` and
`entropy_loss` (slime's metric names) add up to `loss` = pg_loss + beta kl_loss - e entropy_loss.
The importance weight multiplies only the policy-gradient term, as in slime.

Aggregation of `loss_t` over a (mini)batch of B samples (`--loss-agg-mode`):
    token-mean             sum_{i,t} m_it loss_it / sum_{i,t} m_it      (slime --calculate-per-token-loss)
    seq-mean-token-mean    1/B sum_i (sum_t m_it loss_it / max(sum_t m_it, 1))   (slime's default)
    seq-mean-token-sum-norm sum_{i,t} m_it loss_it / (B * L_max)        (Dr.GRPO's constant normaliser)
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "OPSM_AGAINST",
    "ImportanceCorrection",
    "KLType",
    "LossAggregation",
    "LossSettings",
    "PolicyLoss",
    "aggregate",
    "approx_kl_k3",
    "group_advantages",
    "importance_weights",
    "newest_version_mask",
    "opsm_mask",
    "overlong_penalty",
    "policy_loss",
    "ppo_clip_loss",
    "reference_kl",
    "stale_token_mask",
    "trained_mask",
]


class ImportanceCorrection(enum.Enum):
    """How the per-token weight `pi_prox / mu` corrects for behaviour != proximal (`--tis-mode`)."""

    NONE = "none"
    TRUNCATE = "truncate"
    ICEPOP = "icepop"
    SEQ_MASK = "seq-mask"


class KLType(enum.Enum):
    """The estimator of KL(pi || pi_ref) per token (`--kl-loss-type`; the module docstring)."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"
    LOW_VAR_KL = "low_var_kl"


class LossAggregation(enum.Enum):
    """How per-token losses become one number (`--loss-agg-mode`)."""

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


# What OPSM measures the behaviour policy against (`LossSettings.opsm_against`).
OPSM_AGAINST = ("current", "proximal")


@dataclass(frozen=True, slots=True)
class LossSettings:
    """Every knob of the loss, as plain values; see the module docstring for the formulas."""

    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # None = eps_clip; higher for DAPO's clip-higher
    correction: ImportanceCorrection = ImportanceCorrection.TRUNCATE
    tis_clip: float = 2.0  # upper bound of the importance weight
    tis_clip_low: float = 0.0  # lower bound
    use_opsm: bool = False
    opsm_delta: float = 1e-4
    opsm_against: str = "current"  # OPSM's pi: "current" (slime's) or "proximal" (module docstring)
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
    std_normalization: bool = True
    overlong_buffer_len: int = 0  # 0 = no overlong shaping
    overlong_penalty_factor: float = 1.0
    max_response_len: int | None = None  # L_max: needed by overlong shaping and the constant normaliser
    mask_truncated_samples: bool = False
    mask_offpolicy_in_partial_rollout: bool = False
    mask_stale_tokens: int | None = None  # K; None = no staleness mask
    use_kl_loss: bool = False  # a KL(pi || pi_ref) term; the trainer then keeps a reference model
    kl_loss_coef: float = 0.0  # beta
    kl_loss_type: KLType = KLType.K1
    entropy_coef: float = 0.0  # e: > 0 rewards entropy (slime's --entropy-coef)
    # SC (--use-score-centering): add the score-centering term over the sampler's top-k heads
    # (trainers/score_centering.py); composes with the none/truncate/icepop corrections only.
    score_centering: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.kl_loss_coef < 0:
            problems.append(f"kl_loss_coef={self.kl_loss_coef}: must be >= 0")
        if self.kl_loss_coef > 0 and not self.use_kl_loss:
            problems.append(f"kl_loss_coef={self.kl_loss_coef} without use_kl_loss: the KL term would be off")
        if self.eps_clip <= 0 or (self.eps_clip_high is not None and self.eps_clip_high <= 0):
            problems.append(f"eps_clip={self.eps_clip}, eps_clip_high={self.eps_clip_high}: both must be > 0")
        if not 0 <= self.tis_clip_low < self.tis_clip:
            problems.append(f"tis_clip_low={self.tis_clip_low}, tis_clip={self.tis_clip}: need 0 <= low < high")
        if self.overlong_buffer_len < 0 or self.overlong_penalty_factor < 0:
            problems.append(
                f"overlong_buffer_len={self.overlong_buffer_len}, overlong_penalty_factor="
                f"{self.overlong_penalty_factor}: both must be >= 0"
            )
        needs_len = self.overlong_buffer_len > 0 or self.aggregation is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM
        if needs_len and (self.max_response_len is None or self.max_response_len < self.overlong_buffer_len):
            problems.append(
                f"max_response_len={self.max_response_len}: overlong shaping and "
                f"{LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM.value} need it, >= overlong_buffer_len"
            )
        if self.score_centering and (self.correction is ImportanceCorrection.SEQ_MASK or self.use_opsm):
            problems.append(
                f"score_centering with correction={self.correction.value}, use_opsm={self.use_opsm}: score "
                "centering composes with the token-level corrections none/truncate/icepop only, and not with OPSM"
            )
        if self.opsm_against not in OPSM_AGAINST:
            problems.append(f"opsm_against={self.opsm_against!r}: must be one of {', '.join(OPSM_AGAINST)}")
        if self.mask_stale_tokens is not None and self.mask_stale_tokens < 0:
            problems.append(f"mask_stale_tokens={self.mask_stale_tokens}: must be >= 0")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def needs_reference(self) -> bool:
        """Whether the trainer must compute reference log-probs for each batch."""
        return self.use_kl_loss

    @property
    def regularised(self) -> bool:
        """Whether a term besides the policy gradient has a gradient (then a zero-advantage
        minibatch still has signal)."""
        return (self.use_kl_loss and self.kl_loss_coef > 0) or self.entropy_coef != 0


# ---- advantages and reward shaping ------------------------------------------------------------


def group_advantages(rewards: Sequence[float | None], *, std_normalization: bool = True) -> list[float]:
    """GRPO advantages of one group over the rewards that are not None.

    None marks a sample that does not train (failed); it gets advantage 0 and is left out of the
    statistics. The std is the unbiased one (as slime computes it); with fewer than two rewards
    there is nothing to compare against, so every advantage is 0.
    """
    present = [float(r) for r in rewards if r is not None]
    if len(present) < 2:
        return [0.0] * len(rewards)
    mean = sum(present) / len(present)
    scale = 1.0
    if std_normalization:
        scale = math.sqrt(sum((r - mean) ** 2 for r in present) / (len(present) - 1)) + 1e-6
    return [0.0 if r is None else (float(r) - mean) / scale for r in rewards]


def overlong_penalty(response_len: int, *, max_response_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong penalty (module docstring); 0 when `buffer_len` is 0."""
    if buffer_len <= 0:
        return 0.0
    over = response_len - (max_response_len - buffer_len)
    return -factor * min(max(over, 0), buffer_len) / buffer_len


# ---- token masks ---------------------------------------------------------------------------------


def newest_version_mask(versions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, R] bool: the token's version is the newest version among its sample's tokens."""
    lowest = torch.iinfo(versions.dtype).min
    newest = versions.masked_fill(~valid, lowest).amax(dim=1, keepdim=True)
    return valid & (versions == newest)


def stale_token_mask(versions: torch.Tensor, valid: torch.Tensor, *, train_version: int, max_lag: int) -> torch.Tensor:
    """[B, R] bool: the token is at most `max_lag` versions older than the version being trained."""
    return valid & (versions >= train_version - max_lag)


# ---- importance weights ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ImportanceWeights:
    """Per-token weights and what the correction did, for the loss and the metrics."""

    weight: torch.Tensor  # [B, R] float, the w_t of the module docstring; 0 where dropped
    raw: torch.Tensor  # [B, R] float, r_t = pi_prox / mu (1 where not valid)
    clipped: torch.Tensor  # [B, R] bool, r_t was truncated to a bound
    dropped: torch.Tensor  # [B, R] bool, the correction dropped the token (icepop / seq-mask)


def importance_weights(
    proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, settings: LossSettings
) -> ImportanceWeights:
    """The weights of `settings.correction` over the tokens where `mask` (bool) is set.

    The log-ratio is zeroed outside the mask before `exp`, so a padded or masked position can never
    become `inf` (and `inf * 0` never becomes NaN in the loss).
    """
    log_r = (proximal - behaviour).masked_fill(~mask, 0.0)
    raw = torch.exp(log_r)
    lo, hi = settings.tis_clip_low, settings.tis_clip
    none = torch.zeros_like(mask)
    mode = settings.correction
    if mode is ImportanceCorrection.NONE:
        return ImportanceWeights(torch.ones_like(raw), raw, none, none)
    outside = mask & ((raw < lo) | (raw > hi))
    if mode is ImportanceCorrection.ICEPOP:
        return ImportanceWeights(raw.masked_fill(outside, 0.0), raw, none, outside)
    truncated = raw.clamp(min=lo, max=hi)
    if mode is ImportanceCorrection.TRUNCATE:
        return ImportanceWeights(truncated, raw, outside, none)
    # SEQ_MASK: the geometric mean over a sample's masked tokens decides for the whole sample.
    n = mask.sum(dim=1).clamp(min=1)
    geo = torch.exp(log_r.sum(dim=1) / n)
    keep = (geo >= lo) & (geo <= hi)
    dropped = mask & ~keep[:, None]
    return ImportanceWeights(truncated.masked_fill(dropped, 0.0), raw, outside & ~dropped, dropped)


def opsm_mask(
    current: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, delta: float
) -> torch.Tensor:
    """[B] bool: samples OPSM keeps. `advantages` is [B]; drops A < 0 with mean(mu - pi) > delta."""
    n = mask.sum(dim=1).clamp(min=1)
    divergence = (behaviour - current.detach()).masked_fill(~mask, 0.0).sum(dim=1) / n
    return ~((advantages < 0) & (divergence > delta))


def trained_mask(
    settings: LossSettings,
    *,
    current: torch.Tensor | None,
    proximal: torch.Tensor | None,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
) -> torch.Tensor:
    """[B, R] bool: the tokens `policy_loss` trains once IcePop, seq-mask and OPSM dropped theirs.

    What a micro-batched minibatch needs before its first backward: the token-mean denominator of
    the whole minibatch. The drops read the proximal log-probs (IcePop, seq-mask) and the current
    ones (OPSM, or the proximal ones with `opsm_against="proximal"`); either may be None where the
    settings do not read it (OPSM against a missing proximal reads the current: one optimizer step,
    where the two are the same).
    """
    s = settings
    train = mask
    if proximal is not None:
        train = train & ~importance_weights(proximal, behaviour, mask, s).dropped
    if s.use_opsm:
        against = proximal if s.opsm_against == "proximal" and proximal is not None else current
        if against is None:
            raise ValueError(f"trained_mask with use_opsm needs the {s.opsm_against} log-probs, got None")
        train = train & opsm_mask(against, behaviour, train, advantages, s.opsm_delta)[:, None]
    return train


# ---- the policy-gradient term and aggregation ----------------------------------------------------


def ppo_clip_loss(
    current: torch.Tensor, proximal: torch.Tensor, advantages: torch.Tensor, *, eps_clip: float, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss against the proximal policy, and where the clipped branch won.

    `advantages` is [B, 1] (or [B, R]). The ratio is computed in log space from the difference, so
    a token far off policy saturates the clip instead of overflowing.
    """
    ratio = torch.exp(current - proximal)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: LossAggregation, *, max_response_len: int | None = None
) -> torch.Tensor:
    """One scalar from [B, R] per-token losses under the float `mask` (see the module docstring)."""
    masked = loss * mask
    if mode is LossAggregation.TOKEN_MEAN:
        return masked.sum() / mask.sum().clamp(min=1.0)
    if mode is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()
    if max_response_len is None:
        raise ValueError(f"{mode.value} needs max_response_len, got None")
    return masked.sum() / (loss.shape[0] * max_response_len)


def reference_kl(current: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor, kind: KLType) -> torch.Tensor:
    """[B, R] per-token estimate of KL(pi || pi_ref) (`kind`, module docstring); 0 outside `mask`.

    The difference is zeroed outside the mask before any `exp`, so padding never makes inf or NaN.
    """
    d = (current - reference).masked_fill(~mask, 0.0)
    if kind is KLType.K1:
        return d
    if kind is KLType.K2:
        return d * d / 2
    if kind is KLType.LOW_VAR_KL:
        d = d.clamp(-20.0, 20.0)
        return (torch.expm1(-d) + d).clamp(-10.0, 10.0)
    return torch.expm1(-d) + d


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    """One (micro/mini)batch's loss and what went into it, for the backward and the metrics."""

    loss: torch.Tensor  # scalar: pg_loss + beta * kl_loss - e * entropy_loss
    pg_loss: torch.Tensor  # scalar, each term aggregated like the loss (detached)
    kl_loss: torch.Tensor
    entropy_loss: torch.Tensor
    train: torch.Tensor  # [B, R] bool: the tokens that train (masks, then IS and OPSM drops)
    weight: torch.Tensor  # [B, R] the importance weight applied (0 where not trained)
    clipped: torch.Tensor  # [B, R] bool: the PPO clip's branch won
    iw: ImportanceWeights
    opsm_dropped: torch.Tensor  # [B, R] bool: tokens OPSM took out
    sc_correction: torch.Tensor | None = None  # scalar, the score-centering term aggregated (detached)


def policy_loss(
    settings: LossSettings,
    *,
    current: torch.Tensor,
    entropy: torch.Tensor,
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    reference: torch.Tensor | None = None,
    train_head: torch.Tensor | None = None,
    sampler_head: torch.Tensor | None = None,
    head_valid: torch.Tensor | None = None,
) -> PolicyLoss:
    """The whole objective on [B, R] tensors: every backend's (mini/micro)batch body, in one place.

    `current` (and `entropy`, when `settings.entropy_coef` != 0) carry the gradient; `proximal`,
    `behaviour` and `reference` are constants; `mask` (bool) is the token mask after every rule;
    `advantages` is [B]. `reference` is needed when `settings.use_kl_loss`; with
    `settings.score_centering`, `train_head` (with gradient) and `sampler_head` ([B, R, k] log-probs
    at the sampler's head ids) and `head_valid` ([B, R] bool: the token has a head) are.
    """
    s = settings
    iw = importance_weights(proximal, behaviour, mask, s)
    train = mask & ~iw.dropped  # icepop / seq-mask drop tokens; truncation only bounds them
    opsm_dropped = torch.zeros_like(train)
    if s.use_opsm:
        against = proximal if s.opsm_against == "proximal" else current
        kept = opsm_mask(against, behaviour, train, advantages, s.opsm_delta)
        opsm_dropped = train & ~kept[:, None]
        train = train & kept[:, None]
    pg, clipped = ppo_clip_loss(current, proximal, advantages[:, None], eps_clip=s.eps_clip, eps_clip_high=s.clip_high)
    weight = iw.weight.masked_fill(~train, 0.0)
    train_f = train.float()

    def agg(x: torch.Tensor) -> torch.Tensor:
        return aggregate(x, train_f, s.aggregation, max_response_len=s.max_response_len)

    pg_token = pg * weight
    sc_loss: torch.Tensor | None = None
    if s.score_centering:
        if train_head is None or sampler_head is None or head_valid is None:
            raise ValueError("score_centering needs train_head, sampler_head and head_valid, got None")
        from trainers.score_centering import head_weight_fn, score_centering_correction

        f = head_weight_fn(s.correction.value, low=s.tis_clip_low, high=s.tis_clip)
        correction, _, _ = score_centering_correction(train_head, sampler_head, f)
        sc_token = (advantages[:, None] * correction).masked_fill(~(train & head_valid), 0.0)
        sc_loss = agg(sc_token).detach()
        pg_token = pg_token + sc_token
    pg_loss = agg(pg_token)
    total = pg_loss
    kl_loss = torch.zeros((), device=current.device)
    if s.use_kl_loss:
        if reference is None:
            raise ValueError("use_kl_loss needs the reference log-probs, got None")
        kl_loss = agg(reference_kl(current, reference, train, s.kl_loss_type))
        total = total + s.kl_loss_coef * kl_loss
    entropy_loss = agg(entropy.masked_fill(~train, 0.0))
    if s.entropy_coef != 0:
        total = total - s.entropy_coef * entropy_loss
    return PolicyLoss(
        total,
        pg_loss.detach(),
        kl_loss.detach(),
        entropy_loss.detach(),
        train,
        weight,
        clipped,
        iw,
        opsm_dropped,
        sc_loss,
    )


# ---- diagnostics -----------------------------------------------------------------------------------


def approx_kl_k3(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(mu || pi_prox) per token over `mask`: (r - 1) - log r, r = pi/mu.

    Non-negative token by token, unbiased under tokens sampled from mu (the engine): it measures
    how far the trainer's policy is from the one that generated the batch.
    """
    log_r = (proximal - behaviour).masked_fill(~mask, 0.0)
    return torch.expm1(log_r) - log_r

"""The shared loss (`trainers.loss`) on hand-computed tensors: each formula of its docstring."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.loss import (
    ImportanceCorrection,
    LossAggregation,
    LossSettings,
    aggregate,
    approx_kl_k3,
    group_advantages,
    importance_weights,
    newest_version_mask,
    opsm_mask,
    overlong_penalty,
    policy_loss,
    ppo_clip_loss,
    stale_token_mask,
    trained_mask,
)

LN = math.log


def _iw(ratios: list[list[float]], mode: ImportanceCorrection, lo: float = 0.8, hi: float = 2.0, mask=None):
    proximal = torch.tensor([[LN(r) for r in row] for row in ratios])
    behaviour = torch.zeros_like(proximal)
    mask = torch.ones_like(proximal, dtype=torch.bool) if mask is None else torch.tensor(mask)
    return importance_weights(proximal, behaviour, mask, LossSettings(correction=mode, tis_clip=hi, tis_clip_low=lo))


def test_no_correction_is_weight_one():
    w = _iw([[0.5, 1.0, 3.0]], ImportanceCorrection.NONE)
    assert w.weight.tolist() == [[1.0, 1.0, 1.0]]
    assert not w.clipped.any() and not w.dropped.any()


def test_tis_truncates_to_the_bounds():
    w = _iw([[0.5, 1.0, 3.0]], ImportanceCorrection.TRUNCATE)
    assert w.weight[0].tolist() == pytest.approx([0.8, 1.0, 2.0])
    assert w.clipped.tolist() == [[True, False, True]] and not w.dropped.any()
    assert w.raw[0].tolist() == pytest.approx([0.5, 1.0, 3.0])


def test_icepop_drops_tokens_outside_the_bounds_and_keeps_the_rest_unbiased():
    w = _iw([[0.5, 1.5, 3.0]], ImportanceCorrection.ICEPOP)
    assert w.weight[0].tolist() == pytest.approx([0.0, 1.5, 0.0])
    assert w.dropped.tolist() == [[True, False, True]]


def test_sequence_mask_uses_the_geometric_mean_of_each_sample():
    # sample 0: geometric mean of (4, 1) = 2 > 1.5: dropped whole; sample 1: (0.9, 1.1) -> 0.995 kept.
    w = _iw([[4.0, 1.0], [0.9, 1.1]], ImportanceCorrection.SEQ_MASK, lo=0.5, hi=1.5)
    assert w.dropped.tolist() == [[True, True], [False, False]]
    assert w.weight[0].tolist() == [0.0, 0.0]
    assert w.weight[1].tolist() == pytest.approx([0.9, 1.1])
    # A masked token does not count in the mean: sample 0 without its first token has g = 1.
    w = _iw([[4.0, 1.0]], ImportanceCorrection.SEQ_MASK, lo=0.5, hi=1.5, mask=[[False, True]])
    assert w.dropped.tolist() == [[False, False]]


def test_weights_are_never_nan_or_inf_at_masked_positions():
    proximal = torch.tensor([[0.0, -1.0]])
    behaviour = torch.tensor([[-float("inf"), -1.0]])  # exp(0 - -inf) = inf where not masked
    mask = torch.tensor([[False, True]])
    for mode in ImportanceCorrection:
        w = importance_weights(proximal, behaviour, mask, LossSettings(correction=mode))
        assert torch.isfinite(w.weight).all() and torch.isfinite(w.raw).all(), mode
        assert torch.isfinite(w.weight * torch.tensor([[0.0, 1.0]])).all()


def test_opsm_drops_negative_samples_the_policy_moved_away_from():
    current = torch.tensor([[-2.0, -2.0], [-2.0, -2.0], [-1.0, -1.0]])
    behaviour = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])  # mean log(mu/pi) = 1, 1, 0
    mask = torch.ones_like(current, dtype=torch.bool)
    keep = opsm_mask(current, behaviour, mask, torch.tensor([-1.0, 1.0, -1.0]), delta=0.5)
    assert keep.tolist() == [False, True, True]  # only A < 0 and divergence > delta


def test_opsm_against_the_proximal_policy_reads_the_rollouts_staleness_alone():
    """Three samples of one batch, the trainer at its second optimizer step: sample 0 on-policy
    (behaviour = proximal) whose likelihood the first step lowered, sample 1 stale (the policy
    had moved away before the step), sample 2 stale with a positive advantage."""
    behaviour = torch.full((3, 2), -1.0)
    proximal = torch.tensor([[-1.0, -1.0], [-2.0, -2.0], [-2.0, -2.0]])
    current = torch.full((3, 2), -2.0)
    mask = torch.ones_like(current, dtype=torch.bool)
    advantages = torch.tensor([-1.0, -1.0, 1.0])
    expected = {"current": [False, False, True], "proximal": [True, False, True]}
    for against, kept in expected.items():
        s = LossSettings(use_opsm=True, opsm_delta=0.5, opsm_against=against)
        train = trained_mask(
            s, current=current, proximal=proximal, behaviour=behaviour, mask=mask, advantages=advantages
        )
        assert train.all(dim=1).tolist() == kept, against
        pl = policy_loss(
            s,
            current=current,
            entropy=torch.zeros_like(current),
            proximal=proximal,
            behaviour=behaviour,
            mask=mask,
            advantages=advantages,
        )
        assert pl.train.all(dim=1).tolist() == kept, against  # the loss and the token count agree
    # One optimizer step a batch: no proximal log-probs, and both read the current ones.
    s = LossSettings(use_opsm=True, opsm_delta=0.5, opsm_against="proximal")
    train = trained_mask(s, current=current, proximal=None, behaviour=behaviour, mask=mask, advantages=advantages)
    assert train.all(dim=1).tolist() == [False, False, True]
    with pytest.raises(ValueError, match="opsm_against='behaviour'"):
        LossSettings(opsm_against="behaviour")


def test_ppo_clip_acts_on_both_sides_against_the_proximal_policy():
    proximal = torch.zeros(1, 4)
    current = torch.tensor([[LN(1.5), LN(1.5), LN(0.5), LN(1.1)]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    loss, clipped = ppo_clip_loss(current, proximal, adv, eps_clip=0.2, eps_clip_high=0.28)
    # A>0, r=1.5: min(1.5, 1.28) -> -1.28 (clipped); A<0, r=1.5: max(1.5, 1.28) -> 1.5 (not);
    # A<0, r=0.5: max(0.5, 0.8) -> 0.8 (clipped); r=1.1 inside the region -> -1.1.
    assert loss[0].tolist() == pytest.approx([-1.28, 1.5, 0.8, -1.1])
    assert clipped.tolist() == [[True, False, True, False]]


def test_aggregation_modes():
    loss = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(aggregate(loss, mask, LossAggregation.TOKEN_MEAN)) == pytest.approx(6 / 3)
    assert float(aggregate(loss, mask, LossAggregation.SEQ_MEAN_TOKEN_MEAN)) == pytest.approx((2 + 2) / 2)
    const = aggregate(loss, mask, LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM, max_response_len=4)
    assert float(const) == pytest.approx(6 / (2 * 4))
    empty = torch.zeros_like(mask)
    assert float(aggregate(loss, empty, LossAggregation.TOKEN_MEAN)) == 0.0


def test_advantages_without_std_normalisation_are_centred_rewards():
    assert group_advantages([0.0, 1.0, 2.0, None], std_normalization=False) == pytest.approx([-1.0, 0.0, 1.0, 0.0])
    assert group_advantages([0.0, 1.0, 2.0]) == pytest.approx([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6)])


def test_overlong_penalty_is_dapos_linear_ramp():
    kw = {"max_response_len": 64, "buffer_len": 16, "factor": 1.0}
    assert [overlong_penalty(n, **kw) for n in (10, 48, 52, 56, 64, 70)] == pytest.approx(
        [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    )
    assert overlong_penalty(64, max_response_len=64, buffer_len=0, factor=1.0) == 0.0


def test_version_masks():
    versions = torch.tensor([[0, 0, 1, 2, 0], [3, 3, 3, 0, 0]])
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])
    assert newest_version_mask(versions, valid).int().tolist() == [[0, 0, 0, 1, 0], [1, 1, 1, 0, 0]]
    assert stale_token_mask(versions, valid, train_version=3, max_lag=1).int().tolist() == [
        [0, 0, 0, 1, 0],
        [1, 1, 1, 0, 0],
    ]
    assert stale_token_mask(versions, valid, train_version=3, max_lag=3).int().tolist() == valid.int().tolist()


def test_k3_kl_estimate():
    proximal, behaviour = torch.tensor([[LN(2.0), 0.0]]), torch.zeros(1, 2)
    kl = approx_kl_k3(proximal, behaviour, torch.tensor([[True, False]]))
    assert kl.tolist()[0] == pytest.approx([1.0 - LN(2.0), 0.0])


def test_settings_name_the_bad_value():
    with pytest.raises(ValueError, match="tis_clip_low=3"):
        LossSettings(tis_clip_low=3.0)
    with pytest.raises(ValueError, match="max_response_len=None"):
        LossSettings(overlong_buffer_len=8)

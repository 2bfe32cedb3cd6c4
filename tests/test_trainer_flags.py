"""The trainer's flags: from the command line to `LossSettings` and the trainer, and their errors."""

from __future__ import annotations

import pytest

from core.errors import ConfigError
from pipeline.config import config_to_dict, load_config
from pipeline.trainer_settings import loss_settings
from trainers.loss import ImportanceCorrection, LossAggregation


def test_flags_reach_the_loss_settings():
    config = load_config(
        [
            "--tis-mode",
            "icepop",
            "--tis-clip-low",
            "0.5",
            "--tis-clip",
            "3",
            "--use-opsm",
            "--opsm-delta",
            "0.01",
            "--opsm-against",
            "proximal",
            "--loss-agg-mode",
            "seq-mean-token-sum-norm",
            "--disable-grpo-std-normalization",
            "--overlong-buffer-len",
            "16",
            "--overlong-penalty-factor",
            "0.5",
            "--mask-truncated-samples",
            "--mask-stale-tokens",
            "2",
            "--global-batch-size",
            "16",
            "--eps-clip-high",
            "0.28",
        ]
    )
    s = loss_settings(config_to_dict(config))
    assert (s.correction, s.tis_clip_low, s.tis_clip) == (ImportanceCorrection.ICEPOP, 0.5, 3.0)
    assert (s.use_opsm, s.opsm_delta, s.aggregation) == (True, 0.01, LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM)
    assert s.opsm_against == "proximal"
    assert (s.std_normalization, s.overlong_buffer_len, s.overlong_penalty_factor) == (False, 16, 0.5)
    assert (s.mask_truncated_samples, s.mask_stale_tokens, s.max_response_len) == (True, 2, 64)
    assert (s.eps_clip, s.clip_high) == (0.2, 0.28)
    assert config.trainer.global_batch_size == 16


def test_no_use_tis_turns_the_correction_off_whatever_the_mode():
    s = loss_settings(config_to_dict(load_config(["--no-use-tis", "--tis-mode", "icepop"])))
    assert s.correction is ImportanceCorrection.NONE


def test_an_old_run_without_the_new_keys_gets_todays_defaults():
    s = loss_settings({"trainer": {"use_tis": True, "tis_clip": 2.0}, "rollout": {}})
    assert s.correction is ImportanceCorrection.TRUNCATE and s.mask_stale_tokens is None
    assert s.opsm_against == "current"  # as every run before the flag measured it


def test_bad_trainer_flags_are_listed_together_with_flag_value_and_rule():
    with pytest.raises(ConfigError) as err:
        load_config(
            [
                "--tis-clip-low",
                "3",
                "--overlong-buffer-len",
                "100",
                "--global-batch-size",
                "1000",
                "--mask-stale-tokens",
                "-1",
                "--tis-mode",
                "sometimes",
            ]
        )
    text = str(err.value)
    assert "--tis-clip-low=3.0: must be below --tis-clip=2.0" in text
    assert "--overlong-buffer-len=100: must be <= --rollout-max-response-len=64" in text
    assert "--global-batch-size=1000: must be <= the samples of one rollout batch (64" in text
    assert "--mask-stale-tokens=-1: must be >= 0" in text
    assert "--tis-mode='sometimes': must be one of truncate, icepop, seq-mask" in text


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], False),  # plain sync: mu == pi up to rounding, nothing for OPSM to act on
        (["--rollout-mode", "async"], True),
        (["--partial-rollout"], True),
        (["--rollout-mode", "async", "--no-use-opsm"], False),  # an explicit choice wins
        (["--use-opsm"], True),
    ],
)
def test_opsm_defaults_on_where_tokens_can_be_off_policy(argv: list[str], expected: bool) -> None:
    config = load_config(argv)
    assert config.trainer.use_opsm is expected
    assert loss_settings(config_to_dict(config)).use_opsm is expected

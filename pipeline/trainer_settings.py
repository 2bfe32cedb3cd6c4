"""From the config's `trainer` and `rollout` sections to a built-in trainer: one place, used by the
launcher and by replay, so the two never disagree on a default.

It reads the JSON form of the config (`config_to_dict`), because replay has only the copy stored
in the run's metadata; keys a run recorded before a flag existed take today's defaults
(`section_from_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import RolloutConfig, TrainerConfig, section_from_dict

if TYPE_CHECKING:
    from stages.trainer import GRPOTrainer
    from stages.trainer.loss import LossSettings

__all__ = ["build_trainer", "loss_settings"]


def _sections(config: Mapping[str, Mapping[str, Any]]) -> tuple[TrainerConfig, RolloutConfig]:
    return (
        section_from_dict(TrainerConfig, config.get("trainer", {})),
        section_from_dict(RolloutConfig, config.get("rollout", {})),
    )


def loss_settings(config: Mapping[str, Mapping[str, Any]]) -> LossSettings:
    """The `LossSettings` the config asks for (see `stages.trainer.loss`)."""
    from stages.trainer.loss import ImportanceCorrection, KLType, LossAggregation, LossSettings

    t, r = _sections(config)
    return LossSettings(
        eps_clip=t.eps_clip,
        eps_clip_high=t.eps_clip_high,
        correction=ImportanceCorrection(t.tis_mode) if t.use_tis else ImportanceCorrection.NONE,
        tis_clip=t.tis_clip,
        tis_clip_low=t.tis_clip_low,
        use_opsm=t.use_opsm is True,  # None: a config from before the derived default, which had it off
        opsm_delta=t.opsm_delta,
        aggregation=LossAggregation(t.loss_agg_mode),
        std_normalization=not t.disable_grpo_std_normalization,
        overlong_buffer_len=t.overlong_buffer_len,
        overlong_penalty_factor=t.overlong_penalty_factor,
        max_response_len=r.max_response_len,
        mask_truncated_samples=t.mask_truncated_samples,
        mask_offpolicy_in_partial_rollout=r.mask_offpolicy_in_partial_rollout,
        mask_stale_tokens=t.mask_stale_tokens,
        use_kl_loss=t.use_kl_loss,
        kl_loss_coef=t.kl_loss_coef,
        kl_loss_type=KLType(t.kl_loss_type),
        entropy_coef=t.entropy_coef,
    )


def build_trainer(
    model_dir: Path,
    config: Mapping[str, Mapping[str, Any]],
    *,
    seed: int | None = None,
    device: str | None = None,
    num_threads: int | None = 1,
    initial_model: Path | None = None,
) -> GRPOTrainer:
    """A `GRPOTrainer` on `model_dir` with the config's settings; `seed`/`device` override it.

    `initial_model`: the run's starting weights, the KL term's reference unless `--ref-load` names
    another (None: `model_dir`, right for a trainer that starts from the initial weights)."""
    from stages.trainer import GRPOTrainer

    t, r = _sections(config)
    return GRPOTrainer(
        model_dir,
        loss=loss_settings(config),
        global_batch_size=t.global_batch_size,
        lr=t.lr,
        temperature=r.temperature,
        max_grad_norm=t.max_grad_norm,
        seed=r.seed if seed is None else seed,
        device=t.device if device is None else device,
        dtype=t.dtype,
        num_threads=num_threads,
        ref_path=t.ref_load or initial_model or model_dir,
    )

"""From the config's `trainer` and `rollout` sections to a built-in trainer: one place, used by the
launcher and by replay, so the two never disagree on a default.

It reads the JSON form of the config (`config_to_dict`), because replay has only the copy stored
in the run's metadata; keys a run recorded before a flag existed take today's defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from pipeline.config import RolloutConfig, TrainerConfig

__all__ = ["build_trainer", "loss_settings"]


def _section(cls: type, given: Mapping[str, Any]) -> dict[str, Any]:
    defaults = {f.name: f.default for f in fields(cls)}
    return {**defaults, **{k: v for k, v in given.items() if k in defaults}}


def loss_settings(config: Mapping[str, Mapping[str, Any]]) -> Any:
    """The `LossSettings` the config asks for (see `stages.trainer.loss`)."""
    from stages.trainer.loss import ImportanceCorrection, LossAggregation, LossSettings

    t = _section(TrainerConfig, config.get("trainer", {}))
    r = _section(RolloutConfig, config.get("rollout", {}))
    return LossSettings(
        eps_clip=t["eps_clip"], eps_clip_high=t["eps_clip_high"],
        correction=ImportanceCorrection(t["tis_mode"]) if t["use_tis"] else ImportanceCorrection.NONE,
        tis_clip=t["tis_clip"], tis_clip_low=t["tis_clip_low"],
        use_opsm=t["use_opsm"], opsm_delta=t["opsm_delta"],
        aggregation=LossAggregation(t["loss_agg_mode"]),
        std_normalization=not t["disable_grpo_std_normalization"],
        overlong_buffer_len=t["overlong_buffer_len"], overlong_penalty_factor=t["overlong_penalty_factor"],
        max_response_len=r["max_response_len"], mask_truncated_samples=t["mask_truncated_samples"],
        mask_offpolicy_in_partial_rollout=r["mask_offpolicy_in_partial_rollout"],
        mask_stale_tokens=t["mask_stale_tokens"],
    )


def build_trainer(
    model_dir: Path, config: Mapping[str, Mapping[str, Any]], *, seed: int | None = None,
    device: str | None = None, num_threads: int | None = 1,
) -> Any:
    """A `GRPOTrainer` on `model_dir` with the config's settings; `seed`/`device` override it."""
    from stages.trainer import GRPOTrainer

    t = _section(TrainerConfig, config.get("trainer", {}))
    r = _section(RolloutConfig, config.get("rollout", {}))
    return GRPOTrainer(
        model_dir, loss=loss_settings(config), global_batch_size=t["global_batch_size"], lr=t["lr"],
        temperature=r["temperature"], max_grad_norm=t["max_grad_norm"],
        seed=r["seed"] if seed is None else seed, device=t["device"] if device is None else device,
        num_threads=num_threads,
    )

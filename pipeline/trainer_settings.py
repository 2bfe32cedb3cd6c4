"""From the config's `trainer` and `rollout` sections to a built-in trainer: one place, used by the
launcher and by replay, so the two never disagree on a default.

It reads the JSON form of the config (`config_to_dict`), because replay has only the copy stored
in the run's metadata; keys a run recorded before a flag existed take today's defaults
(`section_from_dict`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import Config, RolloutConfig, TrainerConfig, config_to_dict, section_from_dict
from pipeline.config.derived import derived

if TYPE_CHECKING:
    from trainers import GRPOTrainer
    from trainers.loss import LossSettings
    from trainers.step_settings import StepSettings

__all__ = [
    "FIXED_WHEN_BUILT",
    "build_trainer",
    "loss_settings",
    "megatron_settings",
    "replayed_settings",
    "step_settings",
]

# Settings that shape how a step trains but are fixed when the trainer is built (its device and
# precision, its layout over ranks, the reference weights, R3's router hooks): a replayed step that
# first ran with another value runs with today's (`pipeline.checkpoints` says so).
FIXED_WHEN_BUILT = (
    "trainer.device",
    "trainer.dtype",
    "trainer.ref_load",
    "rollout.use_rollout_routing_replay",
    "trainer.num_ranks",
    "trainer.num_nodes",
    "trainer.tensor_model_parallel_size",
    "trainer.pipeline_model_parallel_size",
    "trainer.expert_model_parallel_size",
    "trainer.use_distributed_optimizer",
)


def _sections(config: Mapping[str, Mapping[str, Any]]) -> tuple[TrainerConfig, RolloutConfig]:
    return (
        section_from_dict(TrainerConfig, config.get("trainer", {})),
        section_from_dict(RolloutConfig, config.get("rollout", {})),
    )


def loss_settings(config: Mapping[str, Mapping[str, Any]]) -> LossSettings:
    """The `LossSettings` the config asks for (see `trainers.loss`)."""
    from trainers.loss import ImportanceCorrection, KLType, LossAggregation, LossSettings

    t, r = _sections(config)
    return LossSettings(
        eps_clip=t.eps_clip,
        eps_clip_high=t.eps_clip_high,
        correction=ImportanceCorrection(t.tis_mode) if t.use_tis else ImportanceCorrection.NONE,
        tis_clip=t.tis_clip,
        tis_clip_low=t.tis_clip_low,
        use_opsm=t.use_opsm is True,  # None: a config from before the derived default, which had it off
        opsm_delta=t.opsm_delta,
        opsm_against=t.opsm_against,
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
        score_centering=bool(r.use_score_centering),
    )


def step_settings(config: Mapping[str, Mapping[str, Any]]) -> StepSettings:
    """The `StepSettings` the config asks for: what a built-in trainer can change between steps."""
    from trainers.step_settings import StepSettings

    t, r = _sections(config)
    return StepSettings(
        lr=t.lr,
        loss=loss_settings(config),
        temperature=r.temperature,
        max_grad_norm=t.max_grad_norm,
        max_step_kl=t.max_step_kl or None,
        micro_batch_size=t.micro_batch_size,
        max_tokens_per_gpu=t.max_tokens_per_gpu,
    )


def replayed_settings(
    own: StepSettings, then: Mapping[str, Mapping[str, Any]], now: Mapping[str, Mapping[str, Any]]
) -> StepSettings:
    """What a trainer running with `own` (built from the settings `now`) runs a step with that first
    ran under the settings `then`: its own, but each value `then` and `now` set differently as
    `then` set it. A trainer built with values of its own (not the config's) keeps those that no
    recorded change touched."""
    was, were = step_settings(then), step_settings(now)
    loss = dataclasses.replace(own.loss, **_differing(was.loss, were.loss))
    return dataclasses.replace(own, **{**_differing(was, were), "loss": loss})


def _differing(then: Any, now: Any) -> dict[str, Any]:
    return {
        f.name: getattr(then, f.name)
        for f in dataclasses.fields(then)
        if f.name != "loss" and getattr(then, f.name) != getattr(now, f.name)
    }


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
    from trainers import GRPOTrainer

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
        max_step_kl=t.max_step_kl or None,
        routing_replay=bool(r.use_rollout_routing_replay),
        micro_batch_size=t.micro_batch_size,
        max_tokens_per_gpu=t.max_tokens_per_gpu,
        compile_layers=t.trainer_compile,
    )


def megatron_settings(config: Config) -> dict[str, Any]:
    """`start_megatron_trainer`'s arguments from the config (all but the model folder and log folder).

    The controller and every `--node-rank` command call this on the same config, so their specs
    agree; the handshake checks that they do."""
    t = config.trainer
    return {
        "world_size": t.num_nodes * t.num_ranks,
        "nodes": t.num_nodes,
        "tp": t.tensor_model_parallel_size,
        "pp": t.pipeline_model_parallel_size,
        "ep": t.expert_model_parallel_size,
        "device": t.device,
        "seed": config.rollout.seed,
        "master_addr": t.master_addr,
        "master_port": t.master_port,
        "join_timeout": t.join_timeout,
        "dtype": t.dtype,
        "loss": loss_settings(config_to_dict(config)),
        "global_batch_size": t.global_batch_size,
        "lr": t.lr,
        "temperature": config.rollout.temperature,
        "max_grad_norm": t.max_grad_norm,
        "micro_batch_size": t.micro_batch_size,
        "max_tokens_per_gpu": t.max_tokens_per_gpu,
        "distributed_optimizer": t.use_distributed_optimizer,
        "routing_replay": bool(config.rollout.use_rollout_routing_replay),
        # The KL term's reference: --ref-load, else the run's initial weights (never a resumed
        # checkpoint's), as a string so the spec travels as JSON.
        "ref_path": str(
            t.ref_load or config.engine.hf_checkpoint or derived(config.output.dir, "output.dir") / "model"
        ),
    }

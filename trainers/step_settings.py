"""The settings a trainer may change between two steps (`StepSettings`), and their JSON form.

A resumed run trains the stored batches of the steps after its checkpoint again before new work
(`pipeline.checkpoints`); a setting changed on resume takes effect from the first new step (the
store records the step), so the trainer must run each replayed step with the settings it first ran
with, then with today's. Both backends take them between steps (`use_settings`): the learning
rate goes into the optimizer's param groups (its moments are untouched), the loss settings,
temperature, gradient clip and micro-batch limits replace the trainer's, and a reference model is
loaded when a step's loss needs one the trainer was built without.

What shapes the trainer itself (device, dtype, parallel layout, the reference weights `--ref-load`,
R3's router hooks) is not a step setting: it is fixed when the trainer is built.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from trainers.loss import ImportanceCorrection, KLType, LossAggregation, LossSettings

__all__ = ["StepSettings", "loss_from_json"]


@dataclass(frozen=True, slots=True)
class StepSettings:
    """What one training step is run with, beyond its batch (see the module docstring)."""

    lr: float
    loss: LossSettings
    temperature: float = 1.0
    max_grad_norm: float = 1.0
    max_step_kl: float | None = None  # the torch trainer's step-KL bound (None = no bound)
    micro_batch_size: int | None = None  # None = the whole minibatch (torch), the trainer's own (megatron)
    max_tokens_per_gpu: int | None = None

    def __post_init__(self) -> None:
        problems = []
        for name in ("lr", "temperature", "max_grad_norm"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)!r}: must be > 0")
        if self.max_step_kl is not None and not self.max_step_kl > 0:
            problems.append(f"max_step_kl={self.max_step_kl!r}: must be > 0 nats, or None for no bound")
        for name in ("micro_batch_size", "max_tokens_per_gpu"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name}={value!r}: must be >= 1, or None for no limit")
        if problems:
            raise ValueError("step settings: " + "; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (enums by value): what rank 0 sends the megatron followers."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        loss = {f.name: getattr(self.loss, f.name) for f in dataclasses.fields(self.loss)}
        fields["loss"] = {k: v.value if isinstance(v, enum.Enum) else v for k, v in loss.items()}
        return fields

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> StepSettings:
        return cls(**{**raw, "loss": loss_from_json(raw["loss"])})


def loss_from_json(raw: dict[str, Any]) -> LossSettings:
    """A `LossSettings` from its fields as JSON (enums by value)."""
    return LossSettings(
        **{
            **raw,
            "correction": ImportanceCorrection(raw["correction"]),
            "aggregation": LossAggregation(raw["aggregation"]),
            "kl_loss_type": KLType(raw.get("kl_loss_type", KLType.K1.value)),
        }
    )

"""The trainers: the shared loss (`loss`), the built-in torch GRPO trainer (`grpo`) and its
checkpoint format, and the megatron-core backend (`megatron/`, imported only when chosen), which
reuses `loss`."""

from trainers.grpo import GRPOTrainer, group_advantages

__all__ = ["GRPOTrainer", "group_advantages"]

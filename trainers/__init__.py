"""The built-in trainer's room: the shared loss (`loss`), the torch GRPO trainer (`grpo`), and its
checkpoint format. A Megatron backend added later lives here too and reuses `loss`."""

from trainers.grpo import GRPOTrainer, group_advantages

__all__ = ["GRPOTrainer", "group_advantages"]

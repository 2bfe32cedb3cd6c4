"""Master weights: what the optimizer steps when the model computes in bf16 (`--trainer-dtype bfloat16`).

megatron's recipe, in a few lines that also run on CPU: the model holds bf16 copies of its matrix
weights (megatron-core keeps its norms in fp32 when the model is not wrapped in `Float16Module`,
and so do we); each has an fp32 master here, which the gradients are accumulated into, in fp32,
after every micro-batch (megatron's `main_grad`), which AdamW steps, and which is copied back into
the model, rounded, after each step. An fp32 parameter is its own master. Checkpoints and publishes
read the masters, so a published model and a resumed run carry the full-precision weights.

(megatron-core's own mixed-precision optimizer and its DDP grad buffers allocate on CUDA in 0.16.1,
so they cannot serve the CPU ranks CI runs.)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["MasterWeights"]


class MasterWeights:
    """The fp32 parameters the optimizer owns, one per model parameter, by megatron name."""

    def __init__(self, model: torch.nn.Module, fp32: Mapping[str, torch.Tensor]) -> None:
        self._pairs: list[tuple[str, torch.nn.Parameter, torch.nn.Parameter]] = []
        for name, param in model.named_parameters():
            if param.dtype == torch.float32:
                master = param
            else:
                master = torch.nn.Parameter(fp32[name].detach().to(param.device, torch.float32).clone())
            self._pairs.append((name, param, master))

    @property
    def low_precision(self) -> bool:
        return any(m is not p for _, p, m in self._pairs)

    def named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(megatron name, master) for every parameter, in the model's order."""
        return [(name, master) for name, _, master in self._pairs]

    def accumulate_grads(self) -> None:
        """Add the model's bf16 gradients into the masters' fp32 ones, and free them."""
        for _, param, master in self._pairs:
            if master is param or param.grad is None:
                continue
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.add_(param.grad)
            param.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the masters into the model's bf16 parameters (after an optimizer step)."""
        for _, param, master in self._pairs:
            if master is not param:
                param.copy_(master)

"""Where a Hugging Face MoE model keeps its routers: what the built-in engine records R3 routes
from and what the torch trainer replays them through. One definition here, so the trainer finds
the same routers as the engine without importing the engine (reached over HTTP only).

A Hugging Face MoE model (Qwen3-MoE, and the other transformers 5 MoE blocks built the same way)
routes through one router module per sparse layer, `<layer>.mlp.gate`.
"""

from __future__ import annotations

import torch

__all__ = ["router_modules"]


def router_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k router of every sparse MoE layer of `model`, in layer order (empty for a dense model).

    A router is a module named `gate` with `top_k` and `num_experts` attributes (transformers 5's
    `*TopKRouter`); a dense layer's `mlp.gate_proj` is a Linear, not one of them."""
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "gate" and hasattr(module, "top_k") and hasattr(module, "num_experts"):
            found.append(module)
    return found

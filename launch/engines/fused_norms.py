"""One kernel per RMSNorm instead of eight: `torch.compile` of the norm alone, put on the engine's model.

A transformers RMSNorm (Llama, Qwen2/3, Mistral, ...) is eight elementwise launches: upcast, square,
mean, add, rsqrt, multiply, downcast, scale. A Qwen3 layer has four of them (input, post-attention,
q and k norms), so at batch 1 a 28-layer decode step spends some 900 of its ~1,800 launches on norms,
and in a CUDA graph each launch still costs one to two microseconds of the replay. Compiled, each
norm is one generated kernel (Triton on CUDA and ROCm, C++ on a CPU), with the same arithmetic in
the same order.

Only the norm is compiled, with dynamic shapes: one compile (seconds) serves every batch, layer and
model instance, and nothing else of the model goes through the compiler (the whole decoder
compiled took 41 s a shape on the H200 and recompiled per shape). Off by default; the benchmark
and the engine turn it on with `--fuse-norms`. If the compile fails, the norms stay eager.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["fuse_norms"]

log = logging.getLogger(__name__)

_compiled: Callable[..., torch.Tensor] | None = None


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm, operation for operation."""
    dtype = hidden.dtype
    x = hidden.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _norm_forward(module: Any, compiled: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    weight, eps = module.weight, float(module.variance_epsilon)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        # Flattened to [tokens, features]: one rank for every norm (the q/k norms see [B, q, H, D]),
        # so the compile's guards hold for all of them (else recompiles run into dynamo's limit).
        return compiled(hidden.reshape(-1, hidden.shape[-1]), weight, eps).reshape(hidden.shape)

    return forward


def fuse_norms(model: torch.nn.Module) -> int:
    """Give every RMSNorm of `model` (a class named *RMSNorm with `weight` and `variance_epsilon`) the
    compiled norm as its forward; the number of norms changed."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_rms_norm, dynamic=True)
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = _norm_forward(module, _compiled)
            count += 1
    return count


def unfuse_norms(model: torch.nn.Module) -> None:
    """Back to the modules' own forward (a compile that failed)."""
    for module in model.modules():
        if "forward" in vars(module):
            del module.forward

"""Fewer launches per decode step: the RMSNorms and the rotary embedding compiled into one kernel each.

At batch 1 a decode step is bound by launches, not bytes: a CUDA graph replays each kernel for one
to three microseconds even when it moves next to nothing. A transformers RMSNorm (Llama, Qwen2/3,
Mistral, ...) is eight elementwise launches (upcast, square, mean, add, rsqrt, multiply, downcast,
scale), and a Qwen3 layer has four of them; `apply_rotary_pos_emb` is ten more (two multiplies, a
negation, a concatenation and an add, for q and for k). Compiled, each is one generated kernel
(Triton on CUDA and ROCm, C++ on a CPU) doing the same arithmetic in the same order.

Only these two small functions go through the compiler, with dynamic shapes: one compile (seconds)
serves every batch, layer and model instance (the whole decoder compiled took 41 s a shape on the
H200 and recompiled per shape). The norms are replaced on the model's own modules; the rotary
function is looked up by the attention modules in their modeling module's globals, so it is
replaced there, for every model of that architecture in this process (the built-in engine owns its
process; the function computes the same values, gradients included). Off by default; the engine
and the benchmark turn it on with `--fuse-ops`, which also fuses the q/k/v and gate/up projections
(`fused_projections.py`, plain torch). If the compile fails, everything goes back to eager.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

__all__ = ["fuse_ops", "unfuse_ops"]

_compiled_norm: Callable[..., torch.Tensor] | None = None
_rotary_originals: dict[str, Callable[..., Any]] = {}  # modeling module name -> its own apply_rotary_pos_emb


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


def fuse_ops(model: torch.nn.Module) -> int:
    """Compile `model`'s RMSNorms (modules of a class named *RMSNorm with `weight` and
    `variance_epsilon`) and its architecture's `apply_rotary_pos_emb`; the number of ops replaced."""
    global _compiled_norm
    if _compiled_norm is None:
        _compiled_norm = torch.compile(_rms_norm, dynamic=True)
    count = 0
    modeling: dict[str, ModuleType] = {}
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = _norm_forward(module, _compiled_norm)
            count += 1
        source = sys.modules.get(type(module).__module__)
        if source is not None and callable(getattr(source, "apply_rotary_pos_emb", None)):
            modeling[source.__name__] = source
    for name, source in modeling.items():
        if name not in _rotary_originals:
            _rotary_originals[name] = source.apply_rotary_pos_emb
            source.apply_rotary_pos_emb = torch.compile(source.apply_rotary_pos_emb, dynamic=True)  # type: ignore[attr-defined]
            count += 1
    return count


def unfuse_ops(model: torch.nn.Module) -> None:
    """Back to eager (a compile that failed): the modules' own forward, the original rotary functions."""
    for module in model.modules():
        if "forward" in vars(module):
            del module.forward
    for name, original in _rotary_originals.items():
        source = sys.modules.get(name)
        if source is not None:
            source.apply_rotary_pos_emb = original  # type: ignore[attr-defined]
    _rotary_originals.clear()

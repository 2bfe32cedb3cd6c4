"""Gradients across megatron ranks: summed over data parallel, the q/k norms over tensor parallel,
and clipped by the norm of the whole model.

The trainer keeps one fp32 gradient per parameter shard (on the master weights, `master.py`; torch
AdamW on each rank's shard: megatron's DDP wrapper, which keeps them in a flat fp32 buffer, needs
CUDA under megatron-core 0.16.1), so these are the few collectives megatron's
`finalize_model_grads` and `clip_grad_norm` would run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from stages.trainer.megatron.qwen3 import is_sharded

__all__ = ["clip_gradients", "reduce_gradients"]


Named = Sequence[tuple[str, torch.nn.Parameter]]  # megatron name, the parameter the optimizer steps


def reduce_gradients(named: Named, *, tp: int, dp: int, tp_group: Any, dp_group: Any) -> None:
    """Sum gradients over data-parallel replicas (each loss was already divided by the global count).

    Also over the TP group for the q/k norms: they are replicated, but each TP rank applies
    them to its own heads only, so each rank holds a part of their gradient (megatron's
    finalize_model_grads does the same for such parameters).
    """
    if tp > 1:
        for name, p in named:
            if p.grad is not None and name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
                dist.all_reduce(p.grad, group=tp_group)
    if dp == 1:
        return
    for _, p in named:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=dp_group)


def clip_gradients(named: Named, max_norm: float, *, tp: int, tp_rank: int, tp_group: Any) -> float:
    """Clip to `max_norm` by the norm over the whole model; return that norm (before clipping).

    A tensor-parallel shard counts on its rank; a replicated parameter (norms) counts once, on TP
    rank 0, so the sum over the TP group is the full model's.
    """
    square = torch.zeros((), dtype=torch.float64, device=named[0][1].device)
    for name, p in named:
        if p.grad is None:
            continue
        # By name, not megatron's `tensor_model_parallel` attribute: it is not set on CPU-initialised
        # parameters when `perform_initialization` is off.
        if is_sharded(name) or tp_rank == 0:
            square += p.grad.double().pow(2).sum()
    if tp > 1:
        dist.all_reduce(square, group=tp_group)
    norm = float(square.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for _, p in named:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm

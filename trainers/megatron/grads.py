"""Gradients across megatron ranks: summed over data parallel, the q/k norms over tensor parallel,
a tied embedding's two copies over the pipeline's first and last stage, and clipped by the norm
of the whole model (every TP shard and every pipeline stage).

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

from trainers.megatron.qwen3 import is_sharded

__all__ = ["clip_gradients", "reduce_gradients"]


Named = Sequence[tuple[str, torch.nn.Parameter]]  # megatron name, the parameter the optimizer steps


TIED = ("embedding.word_embeddings.weight", "output_layer.weight")  # a tied embedding's copies under PP > 1


def reduce_gradients(
    named: Named, *, tp: int, dp: int, tp_group: Any, dp_group: Any, embedding_group: Any = None
) -> None:
    """Sum gradients over data-parallel replicas (each loss was already divided by the global count).

    Also over the TP group for the q/k norms: they are replicated, but each TP rank applies
    them to its own heads only, so each rank holds a part of their gradient (megatron's
    finalize_model_grads does the same for such parameters). With `embedding_group` (tied
    embeddings under PP > 1, on the first and last stage only): the embedding's gradient on the
    first stage and its copy's (the output layer) on the last are summed, so both copies take
    the same step and stay equal, as in megatron's `_allreduce_embedding_grads`.
    """
    if tp > 1:
        for name, p in named:
            if p.grad is not None and name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
                dist.all_reduce(p.grad, group=tp_group)
    if embedding_group is not None:
        for name, p in named:
            if p.grad is not None and name in TIED:
                dist.all_reduce(p.grad, group=embedding_group)
    if dp == 1:
        return
    for _, p in named:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=dp_group)


def clip_gradients(
    named: Named,
    max_norm: float,
    *,
    tp: int,
    tp_rank: int,
    tp_group: Any,
    pp: int = 1,
    pp_group: Any = None,
    not_counted: frozenset[str] = frozenset(),
) -> float:
    """Clip to `max_norm` by the norm over the whole model; return that norm (before clipping).

    A tensor-parallel shard counts on its rank; a replicated parameter (norms) counts once, on TP
    rank 0, so the sum over the TP group is the stage's; the sum over the pipeline group is the
    full model's. `not_counted`: names held twice, counted on their other stage (the last
    stage's copy of a tied embedding).
    """
    square = torch.zeros((), dtype=torch.float64, device=named[0][1].device)
    for name, p in named:
        if p.grad is None:
            continue
        # By name, not megatron's `tensor_model_parallel` attribute: it is not set on CPU-initialised
        # parameters when `perform_initialization` is off.
        if name in not_counted:
            continue
        if is_sharded(name) or tp_rank == 0:
            square += p.grad.double().pow(2).sum()
    if tp > 1:
        dist.all_reduce(square, group=tp_group)
    if pp > 1:
        dist.all_reduce(square, group=pp_group)
    norm = float(square.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for _, p in named:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm

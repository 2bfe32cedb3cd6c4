"""Gradients across megatron ranks: summed over data parallel (an expert's over its
expert-data-parallel replicas), the q/k norms over tensor parallel, a tied embedding's two copies
over the pipeline's first and last stage, and clipped by the norm of the whole model (every TP
shard, every EP rank's experts and every pipeline stage).

Expert parallel: EP rank r holds its experts only, and their gradients already sum every token
the EP group routed to them (the token dispatcher's backward brings them back); the other copies
of those experts are on the expert-data-parallel ranks (world / (TP x PP x EP)), which saw the
other EP groups' tokens. So an expert's gradient is summed over that group, a shared parameter's
(attention, norms, routers: each rank's own tokens) over the data-parallel group as before.

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

from trainers.megatron.qwen3 import is_expert, is_sharded

__all__ = ["clip_gradients", "reduce_gradients"]


Named = Sequence[tuple[str, torch.nn.Parameter]]  # megatron name, the parameter the optimizer steps


TIED = ("embedding.word_embeddings.weight", "output_layer.weight")  # a tied embedding's copies under PP > 1


def reduce_gradients(
    named: Named,
    *,
    tp: int,
    dp: int,
    tp_group: Any,
    dp_group: Any,
    embedding_group: Any = None,
    expert_dp: int | None = None,
    expert_dp_group: Any = None,
    sequence_parallel: bool = False,
) -> None:
    """Sum gradients over data-parallel replicas (each loss was already divided by the global count):
    an expert's over the `expert_dp` ranks of `expert_dp_group` (module docstring; None: the
    data-parallel group, as without expert parallel), every other parameter's over `dp_group`.

    Also over the TP group for the q/k norms: they are replicated, but each TP rank applies
    them to its own heads only, so each rank holds a part of their gradient (megatron's
    finalize_model_grads does the same for such parameters). With `embedding_group` (tied
    embeddings under PP > 1, on the first and last stage only): the embedding's gradient on the
    first stage and its copy's (the output layer) on the last are summed, so both copies take
    the same step and stay equal, as in megatron's `_allreduce_embedding_grads`. Under
    `sequence_parallel` every replicated parameter (the norms, the routers) saw 1 / TP of the
    positions on each TP rank, so all their gradients are summed over TP (megatron's
    `_allreduce_layernorm_grads` does it for the parameters it marks `sequence_parallel`).
    """
    if tp > 1:
        for name, p in named:
            if p.grad is None or is_sharded(name):
                continue
            if sequence_parallel or name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
                dist.all_reduce(p.grad, group=tp_group)
    if embedding_group is not None:
        for name, p in named:
            if p.grad is not None and name in TIED:
                dist.all_reduce(p.grad, group=embedding_group)
    for name, p in named:
        if p.grad is None:
            continue
        if expert_dp is not None and is_expert(name):
            if expert_dp > 1:
                dist.all_reduce(p.grad, group=expert_dp_group)
        elif dp > 1:
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
    ep: int = 1,
    ep_group: Any = None,
    not_counted: frozenset[str] = frozenset(),
) -> float:
    """Clip to `max_norm` by the norm over the whole model; return that norm (before clipping).

    A tensor-parallel shard counts on its rank; a replicated parameter (norms) counts once, on TP
    rank 0, so the sum over the TP group is the stage's; the sum over the pipeline group is the
    full model's. Under expert parallel (`ep` > 1) each EP rank holds other experts: their
    squares are summed over the EP group first, so each expert counts once and a shared
    parameter, which every EP rank holds, once. `not_counted`: names held twice, counted on their
    other stage (the last stage's copy of a tied embedding).
    """
    square = torch.zeros((), dtype=torch.float64, device=named[0][1].device)
    if ep > 1:
        experts = torch.zeros_like(square)
        for name, p in named:
            if p.grad is not None and is_expert(name) and (is_sharded(name) or tp_rank == 0):
                experts += p.grad.double().pow(2).sum()
        dist.all_reduce(experts, group=ep_group)
        square += experts
    for name, p in named:
        if p.grad is None or name in not_counted or (ep > 1 and is_expert(name)):
            continue
        # By name, not megatron's `tensor_model_parallel` attribute: it is not set on CPU-initialised
        # parameters when `perform_initialization` is off.
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

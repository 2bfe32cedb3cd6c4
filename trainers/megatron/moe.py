"""Qwen3-MoE on megatron-core: the MoE layers' settings, and their weights to and from Hugging Face.

A Qwen3-MoE layer (transformers' `Qwen3MoeSparseMoeBlock`) routes each token with a linear
router: softmax over all experts, the top k, renormalised to sum to 1 (`norm_topk_prob`, on in
Qwen3-30B-A3B and the tiny model) or not. megatron-core's `TopKRouter` with the softmax score
function computes the same weights: without `moe_router_pre_softmax` it takes the top k of the
logits and softmaxes over those k, which is the renormalised softmax (the logits order the
experts as their probabilities do); with it, the softmax over all experts, then the top k,
which is the un-normalised one. No load-balancing or z-loss term: the trainer's loss is the
policy's, as the torch trainer's is (the tiny model is saved with `output_router_logits=False`).
The experts are megatron's `SequentialMLP` (one SwiGLU MLP per expert, no grouped GEMM: that is
a CUDA kernel) behind the all-gather token dispatcher.

Expert parallel (`expert_model_parallel_size` = EP > 1): each rank builds only its
`num_experts / EP` experts of each layer (megatron's `local_expert_indices`, consecutive; their
full-model names carry the global index, `qwen3.global_names`). The router runs on every rank, on
its own tokens, and picks global expert ids (so R3's routes replay unchanged); the dispatcher then
all-gathers the EP group's tokens, each rank runs its experts on those routed to them, and a
reduce-scatter brings the outputs home. Why the all-gather dispatcher and not all-to-all:
megatron-core 0.16.1's all-to-all dispatcher opens a CUDA stream when it is built and syncs
device-to-host on it, so it cannot run on the CPU (gloo) ranks CI uses, while the all-gather one
needs only all-gather and reduce-scatter, which gloo has (its CPU allocation is patched,
`cpu_patches.py`). Its price: the gathered sequences must be equally long, so the trainer pads
each micro-batch to the longest of the EP group's and gives a rank with fewer rows padding-only
micro-batches (`trainer._micro_batches`, `_forward`); and every rank sees EP x its tokens, which
is fine at these sizes, and what all-to-all would save at scale. The gradients of the experts are
summed over their expert-data-parallel replicas (`grads.py`); a save gathers every expert over
the EP group (`checkpoint.gather_experts`).

Tensor parallel: megatron-core's MoE layers refuse TP without sequence parallel, so an MoE model
under TP runs it (`qwen3.sequence_parallel`; each TP rank routes its 1 / TP of the positions, and
the dispatcher's all-gather spans the TP x EP group). The experts are split over TP as a dense MLP
is (expert TP = TP, megatron's default), so the same `qwen3.shard` serves them.

Names and layouts (HF -> megatron, per layer i, per expert e):

    mlp.gate.weight [E, H]                     -> mlp.router.weight
    mlp.experts.e.gate_proj, up_proj [I, H]    -> mlp.experts.local_experts.e.linear_fc1 (gate rows, then up)
    mlp.experts.e.down_proj [H, I]             -> mlp.experts.local_experts.e.linear_fc2

A saved HF folder holds the per-expert tensors (what `save_pretrained` writes, and what SGLang
and the built-in engine read); a transformers 5 model in memory holds them fused
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); both convert. The
conversion is a pure reshuffle, exact both ways.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["hf_moe_to_megatron", "megatron_moe_to_hf", "moe_config"]


def moe_config(num_experts: int, top_k: int, ffn_hidden_size: int, *, norm_topk_prob: bool) -> dict[str, Any]:
    """megatron `TransformerConfig` fields for Qwen3-MoE layers (module docstring)."""
    return {
        "num_moe_experts": num_experts,
        "moe_router_topk": top_k,
        "moe_ffn_hidden_size": ffn_hidden_size,
        "moe_router_score_function": "softmax",
        # Top k of the logits, softmax over those: the renormalised weights (module docstring).
        "moe_router_pre_softmax": not norm_topk_prob,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": "fp32",  # transformers routes in fp32 too (softmax with dtype=float)
        # Under expert parallel too: the all-to-all dispatcher needs CUDA streams (module docstring).
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
    }


def hf_moe_to_megatron(
    hf: Mapping[str, torch.Tensor], hf_prefix: str, mg_prefix: str, num_experts: int
) -> dict[str, torch.Tensor]:
    """One layer's router and experts as megatron tensors (`hf_prefix` = "model.layers.i.")."""
    m = hf_prefix + "mlp."
    out = {mg_prefix + "mlp.router.weight": hf[m + "gate.weight"]}
    fused = m + "experts.gate_up_proj"
    for e in range(num_experts):
        if fused in hf:  # a transformers 5 state dict: each expert's gate rows, then its up rows
            fc1, fc2 = hf[fused][e], hf[m + "experts.down_proj"][e]
        else:
            x = f"{m}experts.{e}."
            fc1 = torch.cat([hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]])
            fc2 = hf[x + "down_proj.weight"]
        out[f"{mg_prefix}mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1
        out[f"{mg_prefix}mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2
    return out


def megatron_moe_to_hf(
    mg: Mapping[str, torch.Tensor], hf_prefix: str, mg_prefix: str, num_experts: int
) -> dict[str, torch.Tensor]:
    """One layer's router and experts under the per-expert HF names a saved folder holds."""
    m = hf_prefix + "mlp."
    out = {m + "gate.weight": mg[mg_prefix + "mlp.router.weight"]}
    for e in range(num_experts):
        local = f"{mg_prefix}mlp.experts.local_experts.{e}."
        gate, up = mg[local + "linear_fc1.weight"].chunk(2)
        out[f"{m}experts.{e}.gate_proj.weight"] = gate
        out[f"{m}experts.{e}.up_proj.weight"] = up
        out[f"{m}experts.{e}.down_proj.weight"] = mg[local + "linear_fc2.weight"]
    return out

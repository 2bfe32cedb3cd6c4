"""The runtime patches megatron-core 0.16.1 needs to run a forward pass on CPU.

megatron-core assumes CUDA in places that the local (non-TransformerEngine) path reaches. The
first two are in environment.md section 1b; the third appears only with RoPE, which that probe
did not use (it ran learned absolute positions):

1. `GlobalMemoryBuffer.get_tensor` allocates the attention score scratch buffer on
   `torch.cuda.current_device()`, which raises on a CPU build of torch. The patch allocates it on CPU.
2. Attention dropout forks the CUDA RNG tracker, which is empty on CPU (`model_parallel_cuda_manual_seed`
   itself needs CUDA). The patch installs the inference RNG tracker, whose `fork()` is a no-op context;
   dropout is 0 in the Qwen3 spec, so no random numbers are drawn there anyway.
3. `RotaryEmbedding.get_emb` moves its `inv_freq` to `torch.cuda.current_device()` on first use.
   The patch computes the same embedding where `inv_freq` already is.
4. An MoE router's `gating` moves its weight to `torch.cuda.current_device()` when it finds it on
   the CPU, and its `router_gating_linear` reads a TransformerEngine name that is undefined
   without TransformerEngine. The patch computes the same logits, a plain linear in the
   configured router dtype, where the weight is.
5. The all-gather and reduce-scatter along the sequence dimension (`tensor_parallel.mappings`),
   which the MoE all-gather token dispatcher runs over the expert-parallel group, allocate their
   outputs on `torch.cuda.current_device()` (or in the global buffer). The patch runs the same
   collectives (gloo has both) into fresh tensors where the input is.
6. Under sequence parallel (MoE layers under TP), the backward of megatron's linear layers
   (`LinearWithGradAccumulationAndAsyncCommunication`) allocates the reduce-scattered input
   gradient on `torch.cuda.current_device()`. The patch computes the same backward (all-gather
   the input, the input and weight gradients, the reduce-scatter or all-reduce of the input
   gradient) with its tensors where the input is, without the CUDA-only gradient fusion and
   deferral, which this backend turns off.

`apply_cpu_patches()` is called only when the trainer runs on CPU; on a GPU megatron-core runs
unpatched (0.19.x on the H200 machine). The patches are idempotent.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["apply_cpu_patches", "cpu_patches_applied"]

_applied = False


def cpu_patches_applied() -> bool:
    return _applied


def _get_tensor_on_cpu(
    self: Any, shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None
) -> torch.Tensor:
    """`GlobalMemoryBuffer.get_tensor`, allocating on CPU instead of the current CUDA device."""
    n = math.prod(shape)
    key = (name, dtype)
    if self.buffer.get(key) is None or self.buffer[key].numel() < n:
        self.buffer[key] = torch.empty(n, dtype=dtype)
    buffer: torch.Tensor = self.buffer[key]
    return buffer[:n].view(*shape)


def _rope_emb_in_place(self: Any, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """`RotaryEmbedding.get_emb` without the move to CUDA: [seq, 1, 1, dim] angles."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def _gating_in_place(self: Any, input: torch.Tensor) -> torch.Tensor:
    """`Router.gating` without the move to CUDA: the router logits, in the configured router dtype."""
    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
    bias = None if self.bias is None else self.bias.to(dtype)
    return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)


def _gather_first_dim_in_place(
    input_: torch.Tensor, group: Any, output_split_sizes: list[int] | None = None, use_global_buffer: bool = False
) -> torch.Tensor:
    """`mappings._gather_along_first_dim`, its output beside the input (a fresh tensor, no global buffer)."""
    import torch.distributed as dist

    size = group.size()
    if size == 1:
        return input_
    input_ = input_.contiguous()
    if output_split_sizes is None:
        output = input_.new_empty((input_.shape[0] * size, *input_.shape[1:]))
        dist.all_gather_into_tensor(output, input_, group=group)
        return output
    output = input_.new_empty((sum(output_split_sizes), *input_.shape[1:]))
    dist.all_gather(list(output.split(output_split_sizes)), input_, group=group)
    return output


def _reduce_scatter_first_dim_in_place(
    input_: torch.Tensor, group: Any, input_split_sizes: list[int] | None = None, use_global_buffer: bool = False
) -> torch.Tensor:
    """`mappings._reduce_scatter_along_first_dim`, its output beside the input (no global buffer)."""
    import torch.distributed as dist

    size = group.size()
    if size == 1:
        return input_
    input_ = input_.contiguous()
    if input_split_sizes is None:
        if input_.shape[0] % size:
            raise ValueError(f"reduce-scatter of {input_.shape[0]} rows over {size} ranks: not divisible")
        output = input_.new_empty((input_.shape[0] // size, *input_.shape[1:]))
        dist.reduce_scatter_tensor(output, input_, group=group)
        return output
    parts = list(input_.split(input_split_sizes))
    output = torch.empty_like(parts[group.rank()])
    dist.reduce_scatter(output, parts, group=group)
    return output


def _linear_backward_in_place(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """`LinearWithGradAccumulationAndAsyncCommunication.backward` without CUDA (item 6 above)."""
    import torch.distributed as dist

    if ctx.gradient_accumulation_fusion or ctx.grad_output_buffer is not None:
        raise RuntimeError("the megatron CPU patches run linear layers without gradient fusion or deferral")
    input_, weight = ctx.saved_tensors
    group = ctx.tp_group
    total_input = input_
    if ctx.sequence_parallel:  # the forward's input was this rank's positions: gather them all
        total_input = input_.new_empty((input_.shape[0] * group.size(), *input_.shape[1:]))
        dist.all_gather_into_tensor(total_input, input_.contiguous(), group=group)
    grad_input = grad_output.matmul(weight)
    flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
    grad_weight = flat_grad.t().matmul(total_input.reshape(-1, total_input.shape[-1]))
    grad_bias = flat_grad.sum(dim=0) if ctx.use_bias else None
    if ctx.sequence_parallel:  # back to this rank's positions, summed over the TP ranks
        mine = input_.new_empty(input_.shape)
        dist.reduce_scatter_tensor(mine, grad_input.contiguous(), group=group)
        grad_input = mine
    elif ctx.allreduce_dgrad:
        dist.all_reduce(grad_input, group=group)
    return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def apply_cpu_patches(seed: int) -> None:
    """Patch megatron-core for CPU and seed torch. Call after `initialize_model_parallel`."""
    global _applied
    import megatron.core.tensor_parallel.mappings as mappings
    import megatron.core.utils as mcu
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication as Linear
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.moe.router import Router

    if torch.cuda.is_available():
        raise RuntimeError("the megatron CPU patches are for CPU-only hosts; on a GPU megatron-core runs unpatched")
    mcu.GlobalMemoryBuffer.get_tensor = _get_tensor_on_cpu
    RotaryEmbedding.get_emb = _rope_emb_in_place
    Router.gating = _gating_in_place
    mappings._gather_along_first_dim = _gather_first_dim_in_place
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_first_dim_in_place
    Linear.backward = staticmethod(_linear_backward_in_place)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(seed)
    _applied = True

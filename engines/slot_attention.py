"""The KV forward's cache and attention: K/V kept per slot, read in place, no copies per step.

A decode step runs over the slots in order: row j of the step IS slot j (slots are kept dense by
`KVCacheForward`, which moves a request down into a hole when one opens), so the attention reads
the cache tensor itself, `keys[:width, :, :kv]` (a view), instead of gathering each row's K/V into a
new tensor. A slot whose request is not decoding this step (just prefilled, or padding up to a CUDA
graph's batch) is an idle row: it writes its K/V into a spare slot past the real ones and its output
is dropped.

For a one-token decode the query heads that share a KV head are folded into the query-length axis:
a [B, Hkv, G, D] query against [B, Hkv, kv, D] keys, one mask per row shared by every head. That is
grouped-query attention with no `repeat_kv` copy (transformers' SDPA path repeats K/V G times when
a mask is given, since SDPA's `enable_gqa` is not taken with a mask by every backend) and each K/V
byte is read once. The mask is additive, built once per step from the positions (not per layer).

A prefill recomputes whole sequences (prompt + tokens so far), right-padded, so its rows attend only
to their own new K/V: causal SDPA with `enable_gqa`, no mask (padding sits after every real token,
where causality already hides it); what the padding writes into the slot lies past the row's length
and is overwritten before any decode reads it.

All of it is torch's SDPA on tensors: the same code runs on CPUs, CUDA and ROCm builds. It is
reached through transformers' attention interface (`ATTENTION_NAME`, registered once per process);
a forward without a plan (the recompute path on the same model) falls through to transformers'
own SDPA attention, so the model serves both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

__all__ = ["ATTENTION_NAME", "SlotCache", "SlotPlan", "use_slot_attention"]

ATTENTION_NAME = "rollout_slots"  # the name the engine's model runs its attention under


@dataclass(slots=True)
class SlotPlan:
    """What one model call does with the cache.

    decode: `write_slots[j]` is where row j's new K/V go (slot j, or the spare slot for an idle
    row), `positions[j, 0]` the position, `bias` [B, 1, 1, kv] the additive mask (0 where a row may
    look, -inf elsewhere), `kv` how many positions the attention reads.
    prefill: `write_slots[j]` the slot of row j, `positions` [B, width] = 0..width-1."""

    write_slots: torch.Tensor
    positions: torch.Tensor
    kv: int
    decode: bool
    bias: torch.Tensor | None = None

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention output [B, q, H, D] (transformers' layout) for query [B, H, q, D]."""
        batch, heads, _, dim = query.shape
        kv_heads = key.shape[1]
        if self.decode:
            # [B, H, 1, D] -> [B, Hkv, G, D]: head h reads KV head h // G, as repeat_kv orders them.
            folded = query.reshape(batch, kv_heads, heads // kv_heads, dim)
            out = torch.nn.functional.scaled_dot_product_attention(
                folded, key, value, attn_mask=self.bias, scale=scaling
            )
            return out.reshape(batch, 1, heads, dim)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=kv_heads != heads
        )
        return out.transpose(1, 2)


def _slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    slot_plan: SlotPlan | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if slot_plan is None:  # the same model used without the cache (recompute, training)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if getattr(module, "sliding_window", None):
        raise NotImplementedError("the slot cache does not implement sliding-window attention")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return slot_plan.attend(query, key, value, scale), None


def use_slot_attention(model: torch.nn.Module) -> None:
    """Run `model`'s attention through `_slot_attention` (registered with transformers once)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _slot_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)  # masks as SDPA's, for the recompute path
    config: Any = model.config
    config._attn_implementation = ATTENTION_NAME
    text = getattr(config, "get_text_config", lambda: config)()
    if text is not config:
        text._attn_implementation = ATTENTION_NAME
    if getattr(text, "_attn_implementation", None) != ATTENTION_NAME:
        raise RuntimeError(f"could not set the attention of {type(model).__name__} to {ATTENTION_NAME!r}")


class SlotCache(Cache):
    """Keys and values for `slots` sequences of up to `context` tokens, plus one spare slot (the last)
    that idle rows write into; one tensor each for K and V, [layers, slots + 1, Hkv, context, D],
    allocated once for the whole run.

    `plan` says what the next model call does; `update` (called by every attention layer) writes
    the new K/V and returns what the attention reads: the new K/V themselves for a prefill, the
    first `width` slots in place (a view) for a decode."""

    def __init__(
        self,
        *,
        layers: int,
        slots: int,
        kv_heads: int,
        context: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(layers=[])
        shape = (layers, slots + 1, kv_heads, context, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.spare = slots
        self.nbytes = 2 * self.keys.numel() * self.keys.element_size()
        self._plan: SlotPlan | None = None

    def plan(self, plan: SlotPlan) -> None:
        self._plan = plan

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._plan
        assert plan is not None, "SlotCache.update before plan()"
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        rows = plan.write_slots[:, None].expand_as(plan.positions)
        # [B, Hkv, q, D] -> [B, q, Hkv, D], the layout indexing on (slot, position) expects.
        keys[rows, :, plan.positions] = key_states.transpose(1, 2).to(keys.dtype)
        values[rows, :, plan.positions] = value_states.transpose(1, 2).to(values.dtype)
        if not plan.decode:
            return key_states, value_states
        width = key_states.shape[0]
        return keys[:width, :, : plan.kv], values[:width, :, : plan.kv]

    def move(self, source: int, target: int, length: int) -> None:
        """Copy the first `length` positions of slot `source` into slot `target` (every layer)."""
        self.keys[:, target, :, :length].copy_(self.keys[:, source, :, :length])
        self.values[:, target, :, :length].copy_(self.values[:, source, :, :length])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self._plan is None else self._plan.kv

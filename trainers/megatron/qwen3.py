"""A Qwen3-shaped megatron-core `GPTModel`, and its weights converted to and from Hugging Face.

The model is megatron-core's `GPTModel` with the local (no TransformerEngine) layer spec: RMSNorm,
SwiGLU, grouped-query attention, q/k RMSNorm, RoPE with the config's base, tied or untied
embeddings. It is built from a Hugging Face `Qwen3Config`, so the folder the engines serve is the
one description of the model.

Names and layouts (HF -> megatron, full tensors):

    model.embed_tokens.weight                  -> embedding.word_embeddings.weight
    model.layers.i.input_layernorm.weight      -> decoder.layers.i.input_layernorm.weight
    q_proj, k_proj, v_proj                     -> decoder.layers.i.self_attention.linear_qkv.weight
        (one block per query group: that group's query heads, then its key head, then its value head)
    self_attn.q_norm / k_norm                  -> self_attention.q_layernorm / k_layernorm
    self_attn.o_proj                           -> self_attention.linear_proj
    post_attention_layernorm                   -> decoder.layers.i.pre_mlp_layernorm
    mlp.gate_proj, mlp.up_proj                 -> mlp.linear_fc1 (gate rows first, then up)
    mlp.down_proj                              -> mlp.linear_fc2
    model.norm.weight                          -> decoder.final_layernorm.weight
    lm_head.weight (untied only)               -> output_layer.weight

The embedding row of `pad_token_id` gets no gradient from the input lookup, as transformers'
`nn.Embedding(padding_idx=...)` gives it none (a tied output layer still trains it). It matters
when a sampled response holds the pad token: the tiny model starts that row at zero, and the
RMSNorm of a zero vector has a gradient of 1/sqrt(eps), which swamped the step.

Qwen3-MoE (`model_type` qwen3_moe, every layer sparse): each layer's MLP is megatron's MoE layer,
its router and experts converted by `moe.py`, which says how the routing matches transformers'.

Tensor parallelism splits a full megatron tensor into per-rank shards (`shard`) and joins them
back (`unshard`): vocab rows of the embedding and output layer, query groups of `linear_qkv`, the
gate and the up half of `linear_fc1` each, and the input columns of `linear_proj` and `linear_fc2`.
Norms are replicated. Every conversion is a pure reshuffle of the same numbers, so a round trip
is exact.

Pipeline parallelism gives each stage `num_layers / pp` consecutive layers (megatron's own
offset logic: a layer's `layer_number` is global), the embedding to the first stage and the final
norm and output layer to the last. A stage's parameters are named locally (`decoder.layers.0` is
its first layer); `global_names` maps them to the full model's names that the conversion uses.
Tied embeddings under PP > 1: the last stage holds its own copy of the embedding as
`output_layer.weight` (megatron's recipe: both copies start equal and their gradients are summed
over the embedding group, `grads.py`, so they stay equal); it is built untied so that megatron
does not move it to CUDA to synchronise it at construction, and a save reads the first stage's.

Expert parallel: a rank builds `num_experts / EP` experts per MoE layer, named `local_experts.i`
locally; `global_names` gives them their global index, so loading and saving convert them as
without EP (`is_expert` says which parameters are one expert's, held by one EP rank).

Sequence parallel (an MoE model under TP, `sequence_parallel`): megatron's own recipe, with the
local spec's torch norms swapped for `SequenceParallelRMSNorm` (the same norm; megatron's wrapper
refuses sequence parallel only because megatron's gradient reduction would miss its weight).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from core.errors import ConfigError
from trainers.megatron.moe import hf_moe_to_megatron, megatron_moe_to_hf, moe_config

__all__ = [
    "Qwen3Shape",
    "build_gpt_model",
    "global_names",
    "hf_to_megatron",
    "is_expert",
    "is_sharded",
    "megatron_to_hf",
    "sequence_parallel",
    "shard",
    "unshard",
]


@dataclass(frozen=True, slots=True)
class Qwen3Shape:
    """The numbers of a Hugging Face Qwen3 config that the megatron model and the conversion need."""

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_positions: int
    tied: bool
    # Qwen3-MoE: experts per layer (0: a dense model), experts per token, each expert's FFN width.
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True
    # transformers builds the embedding with `padding_idx=pad_token_id`: that row gets no gradient
    # from the input lookup (`build_gpt_model` does the same).
    pad_token_id: int | None = None

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf(cls, config: Any) -> Qwen3Shape:
        kind = getattr(config, "model_type", None)
        if kind not in ("qwen3", "qwen2", "qwen3_moe"):
            raise ConfigError(
                [
                    f"--train-backend=megatron: model type {kind!r} is not Qwen3-shaped "
                    "(the megatron backend converts qwen3 and qwen3_moe checkpoints)"
                ]
            )
        moe: dict[str, Any] = {}
        if kind == "qwen3_moe":
            if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
                raise ConfigError(
                    [
                        "--train-backend=megatron: this qwen3_moe checkpoint mixes dense and sparse layers "
                        f"(mlp_only_layers={config.mlp_only_layers}, "
                        f"decoder_sparse_step={config.decoder_sparse_step}); "
                        "the megatron backend converts models whose every layer is MoE"
                    ]
                )
            moe = dict(
                num_experts=int(config.num_experts),
                moe_top_k=int(config.num_experts_per_tok),
                moe_ffn_hidden_size=int(config.moe_intermediate_size),
                norm_topk_prob=bool(config.norm_topk_prob),
            )
        rope = getattr(config, "rope_theta", None)
        if rope is None:  # transformers v5 keeps it in rope_parameters
            rope = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rope_theta=float(rope),
            rms_norm_eps=config.rms_norm_eps,
            max_positions=config.max_position_embeddings,
            tied=bool(config.tie_word_embeddings),
            pad_token_id=getattr(config, "pad_token_id", None),
            **moe,
        )

    def check_tensor_parallel(self, tp: int) -> None:
        """Every split must be even: heads, key/value heads, vocab rows and FFN columns per rank."""
        problems = [
            f"--tensor-model-parallel-size={tp}: {what} ({n}) is not divisible by it"
            for what, n in (
                ("attention heads", self.num_heads),
                ("key/value heads", self.num_kv_heads),
                ("vocab size", self.vocab_size),
                ("FFN size", self.moe_ffn_hidden_size if self.moe else self.ffn_hidden_size),
            )
            if n % tp
        ]
        if problems:
            raise ConfigError(problems)

    def check_expert_parallel(self, ep: int) -> None:
        """EP splits each MoE layer's experts evenly; a dense model has none to split."""
        if ep == 1:
            return
        if not self.moe:
            raise ConfigError(
                [f"--expert-model-parallel-size={ep}: the model is dense (no MoE layers, no experts to split)"]
            )
        if self.num_experts % ep:
            raise ConfigError(
                [
                    f"--expert-model-parallel-size={ep}: the model's {self.num_experts} experts per layer are "
                    "not divisible by it (each EP rank holds the same number of experts)"
                ]
            )

    def check_pipeline_parallel(self, pp: int) -> None:
        """Every stage gets the same number of layers."""
        if self.num_layers % pp:
            raise ConfigError(
                [
                    f"--pipeline-model-parallel-size={pp}: the model's {self.num_layers} layers are not "
                    "divisible by it (each pipeline stage takes the same number of layers)"
                ]
            )


def build_gpt_model(
    shape: Qwen3Shape, *, tp: int, pp: int = 1, ep: int = 1, dtype: torch.dtype, on_cpu: bool
) -> torch.nn.Module:
    """The megatron `GPTModel` for `shape` on this rank: its pipeline stage's share of it, and
    under expert parallel its `num_experts / ep` experts of each MoE layer.

    `initialize_model_parallel` must have run (it says which stage and which experts are this rank's)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    moe = (
        moe_config(shape.num_experts, shape.moe_top_k, shape.moe_ffn_hidden_size, norm_topk_prob=shape.norm_topk_prob)
        if shape.moe
        else {}
    )
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=sequence_parallel(shape, tp),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False,  # weights come from the HF folder
        # The fused kernels are CUDA-only; the unfused paths are exact in fp32.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        **moe,
    )
    rotary_base = int(shape.rope_theta) if shape.rope_theta.is_integer() else shape.rope_theta
    spec: Any = get_gpt_layer_local_spec(
        num_experts=shape.num_experts or None, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )
    if config.sequence_parallel:
        spec = _sequence_parallel_block(spec, shape.num_layers // pp)
    model: torch.nn.Module = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_positions,
        position_embedding_type="rope",
        rotary_base=rotary_base,
        # Tied under PP > 1: the last stage's copy is our own to keep equal (module docstring).
        share_embeddings_and_output_weights=shape.tied and pp == 1,
        parallel_output=True,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    if shape.pad_token_id is not None and ps.is_pipeline_first_stage():
        model.embedding.word_embeddings.register_forward_hook(_pad_row_frozen(shape.pad_token_id))  # type: ignore[union-attr]
    return model if on_cpu else model.cuda()


def sequence_parallel(shape: Qwen3Shape, tp: int) -> bool:
    """Whether the model runs megatron's sequence parallel: MoE layers under TP need it (megatron-core
    refuses them without), so an MoE model under TP runs it; a dense model does not."""
    return shape.moe and tp > 1


class SequenceParallelRMSNorm:
    """torch's RMSNorm, as megatron's `WrappedTorchNorm` builds it (the local spec's norm without
    Apex or TransformerEngine), also under sequence parallel. `WrappedTorchNorm` refuses sequence
    parallel because megatron's own gradient reduction would not know that the norm's weight
    gradient is partial on each TP rank; this backend's does (`grads.reduce_gradients` sums every
    replicated parameter's over TP then). The norm itself is per position, the same either way."""

    # A class (megatron builds a spec's module by calling it) whose instances are torch RMSNorms.
    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:  # type: ignore[misc]
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        # What megatron's finalize_model_grads (the distributed optimizer's path) sums over TP.
        norm.weight.sequence_parallel = True  # type: ignore[attr-defined]
        return norm


def _sequence_parallel_block(layer: Any, layers: int) -> Any:
    """The transformer block spec of `layers` copies of the `layer` spec, every torch norm in it (and
    the final norm) a `SequenceParallelRMSNorm`."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    def swap(node: Any) -> Any:
        if node is WrappedTorchNorm:
            return SequenceParallelRMSNorm
        if isinstance(node, ModuleSpec):
            return dataclasses.replace(node, submodules=swap(node.submodules))
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            return dataclasses.replace(node, **{f.name: swap(getattr(node, f.name)) for f in dataclasses.fields(node)})
        return node

    return TransformerBlockSubmodules(layer_specs=[swap(layer)] * layers, layer_norm=SequenceParallelRMSNorm)


def _pad_row_frozen(pad: int) -> Any:
    """A forward hook on the word embeddings: the pad token's positions carry no gradient to its row.

    The output is [B, S, H], or under sequence parallel this TP rank's [S / TP, B, H] slice (the
    embedding reduce-scatters it), whose tokens are the rank's rows of the transposed ids."""

    def hook(module: Any, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        is_pad = args[0] == pad  # [B, S]
        if out.shape[:2] != is_pad.shape:
            from megatron.core import parallel_state as ps

            tp = ps.get_tensor_model_parallel_world_size()
            is_pad = is_pad.t().chunk(tp)[ps.get_tensor_model_parallel_rank()]
        return torch.where(is_pad[..., None], out.detach(), out)

    return hook


def global_names(model: torch.nn.Module, shape: Qwen3Shape) -> dict[str, str]:
    """This stage's parameter names -> the full model's: layers renumbered by their global
    `layer_number`, experts by their global index (under expert parallel a rank's
    `local_experts.i` is expert `local_expert_indices[i]`); the last stage's copy of a tied
    embedding is the embedding."""
    layers: Any = model.decoder.layers  # type: ignore[union-attr]
    out: dict[str, str] = {}
    for name, _ in model.named_parameters():
        full = name
        if name.startswith("decoder.layers."):
            local, rest = name.removeprefix("decoder.layers.").split(".", 1)
            layer = layers[int(local)]
            if rest.startswith(_EXPERTS):
                index, tail = rest.removeprefix(_EXPERTS).split(".", 1)
                rest = f"{_EXPERTS}{layer.mlp.local_expert_indices[int(index)]}.{tail}"
            full = f"decoder.layers.{layer.layer_number - 1}.{rest}"
        elif name == "output_layer.weight" and shape.tied:
            full = "embedding.word_embeddings.weight"
        out[name] = full
    return out


_EXPERTS = "mlp.experts.local_experts."


def is_expert(name: str) -> bool:
    """Whether megatron parameter `name` belongs to one expert (held by one EP rank), not shared."""
    return ".mlp.experts." in name


# ---- names and layouts -----------------------------------------------------------------------

_LAYER_SAME = {  # megatron suffix -> HF suffix, same layout
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}


def hf_to_megatron(hf: Mapping[str, torch.Tensor], shape: Qwen3Shape) -> dict[str, torch.Tensor]:
    """Full megatron tensors from a Hugging Face Qwen3 state dict."""
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not shape.tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    group = shape.num_heads // shape.num_kv_heads
    d = shape.head_dim
    for i in range(shape.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for m, h in _LAYER_SAME.items():
            out[mp + m] = hf[hp + h]
        q = hf[hp + "self_attn.q_proj.weight"].view(shape.num_kv_heads, group * d, -1)
        k = hf[hp + "self_attn.k_proj.weight"].view(shape.num_kv_heads, d, -1)
        v = hf[hp + "self_attn.v_proj.weight"].view(shape.num_kv_heads, d, -1)
        out[mp + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, shape.hidden_size)
        if shape.moe:
            out.update(hf_moe_to_megatron(hf, hp, mp, shape.num_experts))
            continue
        out[mp + "mlp.linear_fc1.weight"] = torch.cat([hf[hp + "mlp.gate_proj.weight"], hf[hp + "mlp.up_proj.weight"]])
        out[mp + "mlp.linear_fc2.weight"] = hf[hp + "mlp.down_proj.weight"]
    return out


def megatron_to_hf(mg: Mapping[str, torch.Tensor], shape: Qwen3Shape) -> dict[str, torch.Tensor]:
    """A Hugging Face Qwen3 state dict from full megatron tensors (tied: no `lm_head.weight`, as HF saves it)."""
    out = {
        "model.embed_tokens.weight": mg["embedding.word_embeddings.weight"],
        "model.norm.weight": mg["decoder.final_layernorm.weight"],
    }
    if not shape.tied:
        out["lm_head.weight"] = mg["output_layer.weight"]
    group = shape.num_heads // shape.num_kv_heads
    d = shape.head_dim
    for i in range(shape.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for m, h in _LAYER_SAME.items():
            out[hp + h] = mg[mp + m]
        qkv = mg[mp + "self_attention.linear_qkv.weight"].view(shape.num_kv_heads, (group + 2) * d, -1)
        q, k, v = qkv.split([group * d, d, d], dim=1)
        out[hp + "self_attn.q_proj.weight"] = q.reshape(-1, shape.hidden_size)
        out[hp + "self_attn.k_proj.weight"] = k.reshape(-1, shape.hidden_size)
        out[hp + "self_attn.v_proj.weight"] = v.reshape(-1, shape.hidden_size)
        if shape.moe:
            out.update(megatron_moe_to_hf(mg, hp, mp, shape.num_experts))
            continue
        gate, up = mg[mp + "mlp.linear_fc1.weight"].chunk(2)
        out[hp + "mlp.gate_proj.weight"], out[hp + "mlp.up_proj.weight"] = gate, up
        out[hp + "mlp.down_proj.weight"] = mg[mp + "mlp.linear_fc2.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _split_kind(name: str) -> str:
    """How a megatron parameter is split over tensor-parallel ranks: rows, cols, glu or none."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight")):
        return "rows"
    if name.endswith("linear_fc1.weight"):
        return "glu"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "cols"
    return "none"


def is_sharded(name: str) -> bool:
    """Whether megatron parameter `name` is split over tensor-parallel ranks (else replicated)."""
    return _split_kind(name) != "none"


def shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s part of the full megatron tensor `name` under tensor parallelism of `size`."""
    kind = _split_kind(name)
    if size == 1 or kind == "none":
        return full
    if kind == "rows":
        return full.chunk(size, dim=0)[rank]
    if kind == "cols":
        return full.chunk(size, dim=1)[rank]
    gate, up = full.chunk(2, dim=0)  # each half is split on its own: a rank holds [gate_r; up_r]
    return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])


def unshard(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full megatron tensor `name` from every tensor-parallel rank's part, in rank order."""
    kind = _split_kind(name)
    if len(parts) == 1 or kind == "none":
        return parts[0]
    if kind == "rows":
        return torch.cat(parts, dim=0)
    if kind == "cols":
        return torch.cat(parts, dim=1)
    halves = [p.chunk(2, dim=0) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])

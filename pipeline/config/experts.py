"""The rules for expert parallel (`--expert-model-parallel-size`, megatron/slime's flag), checked
when the config loads, each refusal naming the value and its rule.

EP splits each MoE layer's experts over EP of the data-parallel ranks, so it must divide the
data-parallel size (ranks / (TP x PP)) and the experts per layer, and a dense model has no experts
to split. The experts per layer are known here for the tiny model (`--num-experts`; without it the
tiny model is dense); a `--hf-checkpoint` folder's are read by the load step (`experts_in_folder`),
and the trainer checks again when it builds the model (a Hub id's config is only read there).
"""

from __future__ import annotations

from typing import Any

from pipeline.config.draft import Draft

__all__ = ["check_experts", "expert_parallel_rules", "experts_in_folder", "routed_expert_count"]


def expert_parallel_rules(draft: Draft) -> None:
    get, show = draft.get, draft.show
    ep = get("trainer", "expert_model_parallel_size")
    if ep is None or ep == 1 or get("trainer", "backend") != "megatron":
        return  # the torch backend's refusal of every parallel size is in rules._megatron_rules
    per_node, nodes = get("trainer", "num_ranks"), get("trainer", "num_nodes")
    tp, pp = get("trainer", "tensor_model_parallel_size"), get("trainer", "pipeline_model_parallel_size")
    if per_node and nodes and tp and pp and (per_node * nodes) % (tp * pp) == 0:
        dp = per_node * nodes // (tp * pp)
        if dp % ep:
            draft.problems.append(
                f"{show('trainer', 'expert_model_parallel_size')}: must divide the data-parallel size {dp} "
                f"(= {per_node * nodes} ranks / (TP={tp} x PP={pp}))"
            )
    if get("engine", "hf_checkpoint"):
        return  # the load step reads the folder's experts
    if draft.ok("engine", "num_experts"):
        experts = get("engine", "num_experts")
        check_experts(draft, experts or 0, "the tiny model (no --num-experts)" if experts is None else "the tiny model")


def check_experts(draft: Draft, experts: int, model: str) -> None:
    """`--expert-model-parallel-size` against the model's `experts` per layer (0: a dense model)."""
    ep = draft.get("trainer", "expert_model_parallel_size")
    shown = draft.show("trainer", "expert_model_parallel_size")
    if not experts:
        draft.problems.append(f"{shown}: {model} is dense (no MoE layers, no experts to split over EP ranks)")
    elif experts % ep:
        draft.problems.append(
            f"{shown}: {model} has {experts} experts per layer, not divisible by it "
            "(each EP rank holds the same number of experts)"
        )


def experts_in_folder(config: dict[str, Any]) -> int:
    """Experts per layer of a Hugging Face config.json (0: dense). transformers names the field
    `num_experts` for Qwen3-MoE and `num_local_experts` for some other MoE families."""
    if config.get("model_type") != "qwen3_moe":
        return 0
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def routed_expert_count(config: dict[str, Any]) -> int | None:
    """Experts per MoE layer of any Hugging Face config.json that names them (Qwen-MoE's
    `num_experts`, Mixtral's `num_local_experts`, DeepSeek's `n_routed_experts`), for packing R3's
    routes (`core.columns.route_code`); None when it names none."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None

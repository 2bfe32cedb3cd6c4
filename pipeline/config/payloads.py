"""The rules for per-token payloads: R3 routes (`--use-rollout-routing-replay`) and SC sampler
heads (`--use-score-centering`), checked when the config loads, each refusal naming its rule.

SC's sampling rules are slime's (`score_centering_request`): the sampler heads are read as the
distribution the token was drawn from, which holds only for plain temperature sampling, so
anything that reshapes that distribution after the logits (nucleus, top-k, penalties) is refused.
The loss-side combinations belong with the loss (`trainers/loss.py`).
"""

from __future__ import annotations

from collections.abc import Callable

from pipeline.config.draft import Draft

__all__ = ["payload_rules"]

SC_SAMPLING_RULE = (
    "score centering reads the sampler's top-k as the distribution each token was drawn from, which holds "
    "only for plain temperature sampling (slime's rule)"
)


def payload_rules(draft: Draft) -> None:
    get, show, problem = draft.get, draft.show, draft.problems.append
    if get("rollout", "use_rollout_routing_replay") is True and get("rollout", "moe_router_topk") is None:
        problem(
            f"{show('rollout', 'use_rollout_routing_replay')} needs --moe-router-topk (the model's experts per "
            "token per layer) to read the engine's routed-experts rows"
        )
    experts, top_k = get("engine", "num_experts"), get("rollout", "moe_router_topk")
    if experts is not None and get("engine", "hf_checkpoint"):
        problem(
            f"{show('engine', 'num_experts')}: shapes the tiny model built without --hf-checkpoint; "
            "a checkpoint has its own experts"
        )
    elif experts is not None and top_k is not None and draft.ok("engine", "num_experts") and top_k > experts:
        problem(f"{show('rollout', 'moe_router_topk')}: cannot route to more experts than --num-experts={experts}")
    if get("rollout", "use_score_centering") is not True:
        if get("rollout", "score_centering_top_k") is not None:
            problem(f"{show('rollout', 'score_centering_top_k')}: has no effect without --use-score-centering")
        return
    if get("rollout", "score_centering_top_k") is None:
        problem(f"{show('rollout', 'use_score_centering')} needs --score-centering-top-k (candidates per token)")
    # The loss side (slime's validate_score_centering_args; trainers/score_centering.py says why).
    if get("trainer", "use_opsm") is True:
        problem(
            f"--use-score-centering with {show('trainer', 'use_opsm')}: OPSM drops whole samples, which the "
            "centering term cannot follow (slime's rule)"
        )
    if get("trainer", "use_tis") is True and get("trainer", "tis_mode") == "seq-mask":
        problem(
            f"--use-score-centering with {show('trainer', 'tis_mode')}: the centering term composes with "
            "token-level corrections only (truncate, icepop, or --no-use-tis)"
        )
    for name, fine, rule in _SC_SAMPLING:
        if draft.ok("rollout", name) and not fine(float(get("rollout", name))):
            problem(f"{show('rollout', name)} with --use-score-centering: {rule}; {SC_SAMPLING_RULE}")


_SC_SAMPLING: tuple[tuple[str, Callable[[float], bool], str], ...] = (
    ("temperature", lambda v: v > 0, "must be > 0"),
    ("top_p", lambda v: v == 1, "must be 1"),
    ("top_k", lambda v: v == -1, "must be -1 (off)"),
    ("frequency_penalty", lambda v: v == 0, "must be 0"),
    ("presence_penalty", lambda v: v == 0, "must be 0"),
    ("repetition_penalty", lambda v: v == 1, "must be 1"),
)

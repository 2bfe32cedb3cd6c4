"""The rules for the switches that read the prompts' stored histories (`stages.selection`):
`--skip-zero-std-prompts` with its `--skip-explore-floor`, and `--length-aware-admission`.
Both work with either store and with local or Ray producers; each refusal names its rule.
"""

from __future__ import annotations

from core.types import RolloutMode
from pipeline.config.draft import Draft
from stages.selection import LENGTH_AWARE_RULE

__all__ = ["history_rules", "history_warnings"]

_DEFAULT_FLOOR = 0.1


def history_rules(draft: Draft) -> None:
    get, show, problem = draft.get, draft.show, draft.problems.append
    skip = get_skip(draft)
    if get("rollout", "length_aware_admission") is True and get("rollout", "mode") == RolloutMode.ASYNC:
        problem(f"{show('rollout', 'length_aware_admission')} with --rollout-mode=async: {LENGTH_AWARE_RULE}")
    floor = get("rollout", "skip_explore_floor")
    if draft.ok("rollout", "skip_explore_floor") and floor is not None and floor > 1:
        problem(
            f"{show('rollout', 'skip_explore_floor')}: must be in (0, 1]; it is the least probability "
            "that a prompt on a zero-variance streak is generated again (1: never skip)"
        )
    if skip and get("rollout", "n_samples_per_prompt") == 1:
        problem(
            f"{show('rollout', 'skip_zero_std_prompts')} with {show('rollout', 'n_samples_per_prompt')}: "
            "a group of one always has zero reward variance, so every prompt would be skipped after its first "
            "group; use groups of two or more samples"
        )


def history_warnings(draft: Draft) -> None:
    """Legal but probably unintended (a config written out in full names the default floor: fine)."""
    floor = draft.get("rollout", "skip_explore_floor")
    if get_skip(draft) is False and floor is not None and floor != _DEFAULT_FLOOR:
        draft.warnings.append(
            f"{draft.show('rollout', 'skip_explore_floor')} without --skip-zero-std-prompts: no prompt is "
            "skipped, so the floor has no effect"
        )


def get_skip(draft: Draft) -> bool:
    return draft.get("rollout", "skip_zero_std_prompts") is True

"""Which of the cursor's prompts generate, and in what order: decisions read from their histories.

The store keeps a short history per prompt (`storage.history`: its last groups' reward spread,
lengths and versions). Two uses of it, both off by default, both pure functions of a history
(so they are tested without a run, and a replay or a resume decides what the run decided):

- **Skipping before rollout** (`--skip-zero-std-prompts`, GRESO's idea). A prompt whose latest
  `k` groups in a row all had zero reward variance (every sample solved it, or none did: the DAPO
  filter would reject the group after generating all its samples) is skipped with probability
  `1 - 2^-k`, never more than `1 - explore_floor`: at least `explore_floor` of such prompts come
  back each time the cursor reaches them, so a prompt the policy can now solve (or has started
  to fail) is seen again, and one group with a spread ends its streak. The draw is a hash of
  (run seed, epoch, dataset row), so the same store and seed decide the same skips.
- **Longest first** (`--length-aware-admission`, sync modes). The new prompts of one admission
  are handed to the pool by predicted response length, longest first (the mean length of the
  prompt's recent groups, the newest weighing most), so the requests that start last in a round
  are the short ones and the round's tail shrinks. A prompt with no history counts as longest:
  started early it costs nothing if it turns out short, started last it may be the tail. Only the
  order within an admission changes, never which prompts are admitted, so no prompt waits longer
  than its round.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from core.types import Group
from storage import PromptHistory

__all__ = [
    "LENGTH_AWARE_RULE",
    "SKIP_REASON",
    "PromptSelection",
    "longest_first",
    "predicted_length",
    "skip_draw",
    "skip_probability",
    "skips",
]

# Why length-aware admission is refused in async mode (the config rules and `RolloutPlan` say it).
LENGTH_AWARE_RULE = (
    "length-aware admission orders the new prompts of a sync round so that the last to start are short; "
    "async admission has no rounds (a group starts whenever a slot frees, across training steps), so there "
    "is no last request to make short: use it with --rollout-mode sync, with or without --partial-rollout"
)
# Why a skipped prompt's group is REJECTED: its `rejected_reason`, and its metric's key
# (`filter/rejected/skipped_zero_std`, beside the filter's own reasons).
SKIP_REASON = "skipped_zero_std"


@dataclass(frozen=True, slots=True)
class PromptSelection:
    """What the dispenser reads from the histories: skips (with their exploration floor) and order."""

    seed: int = 0
    skip_zero_std: bool = False
    explore_floor: float = 0.1  # the least probability that a prompt on a streak is generated again
    longest_first: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.explore_floor <= 1.0:
            raise ValueError(
                f"explore_floor={self.explore_floor!r}: must be in (0, 1]; at 0 a prompt on a zero-variance "
                "streak would never be generated again, even once the policy can learn from it"
            )

    @property
    def reads_history(self) -> bool:
        return self.skip_zero_std or self.longest_first


def skip_probability(history: PromptHistory | None, *, explore_floor: float) -> float:
    """The chance that a prompt with this history is skipped: `1 - 2^-streak`, capped at
    `1 - explore_floor`; 0 without a zero-variance streak (or without a history)."""
    streak = 0 if history is None else history.zero_std_streak
    if streak <= 0:
        return 0.0
    return min(1.0 - explore_floor, 1.0 - 0.5**streak)


def skip_draw(seed: int, epoch: int, index: int) -> float:
    """A uniform draw in [0, 1) for dataset row `index` in pass `epoch`: a function of the run's
    seed alone, so a resumed or replayed run draws the same."""
    digest = hashlib.blake2b(f"{seed}|{epoch}|{index}".encode(), digest_size=8, person=b"skip-draw").digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def skips(history: PromptHistory | None, *, seed: int, epoch: int, index: int, explore_floor: float) -> bool:
    """Whether dataset row `index` is skipped in pass `epoch` (`skip_probability` against `skip_draw`)."""
    p = skip_probability(history, explore_floor=explore_floor)
    return p > 0.0 and skip_draw(seed, epoch, index) < p


def predicted_length(history: PromptHistory | None) -> float | None:
    """The response length (tokens per sample) a prompt's next group is expected to have: the mean
    length of its recent groups, each weighing half the next newer one (the policy drifts, so the
    newest group says most). None for a prompt never finished."""
    if history is None or not history.recent:
        return None
    total = weight_sum = 0.0
    weight = 1.0
    for outcome in reversed(history.recent):
        total += weight * outcome.length_mean
        weight_sum += weight
        weight /= 2
    return total / weight_sum


def longest_first(groups: Sequence[Group], histories: Mapping[int, PromptHistory]) -> list[Group]:
    """`groups` by predicted length, longest first; a prompt with no history first of all (counted
    as longest). Stable: equal predictions keep the cursor's order."""

    def key(group: Group) -> float:
        length = predicted_length(histories.get(group.task.index))
        return -math.inf if length is None else -length

    return sorted(groups, key=key)

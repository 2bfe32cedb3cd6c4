"""What a store remembers of each prompt's past groups: a small summary per prompt, not its samples.

Every group of a dataset row that reaches READY or REJECTED with its rewards (the filter's
verdict or the collector's, never a skip, never a failed group) adds one `GroupOutcome` to the
`PromptHistory` of its row, in the same transaction as the move: whether its rewards were all
equal (what the DAPO filter rejects), its mean reward, its response lengths and the policy version
that made it. A history keeps the last `HISTORY_DEPTH` outcomes and the length of the zero-variance
streak, so it stays a few hundred bytes per prompt however long the run, and garbage collection of
trained groups does not touch it.

The rollout side reads it through `Store.prompt_history(indexes)`: one key per prompt, so the
query costs O(prompts asked), never a scan of the groups. The prediction functions that use it
(skip a prompt, order by length) are pure functions of a history (`stages.selection`).

Stored as a msgpack array `[1, "history", index, groups, streak, [outcome, ...]]`,
never pickle; the LMDB store keeps one record per prompt under `meta` (`keys.history_key`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from core.errors import CorruptRecordError
from core.types import Group

__all__ = [
    "HISTORY_DEPTH",
    "ZERO_STD_TOLERANCE",
    "GroupOutcome",
    "PromptHistory",
    "decode_history",
    "encode_history",
    "outcome_of",
    "rewards_equal",
    "updated_history",
]

HISTORY_DEPTH = 4  # outcomes kept per prompt: enough for a length estimate and a streak's evidence
# Rewards this close count as equal: the same tolerance as the DAPO filter (`stages.filter`).
ZERO_STD_TOLERANCE = 1e-6
_KIND = "history"
_RECORD_VERSION = 1  # of this record's layout; a record of another version is refused, not misread


def rewards_equal(rewards: Sequence[float]) -> bool:
    """Whether every reward is the same (a group with no signal for group-normalised advantages)."""
    return max(rewards) - min(rewards) <= ZERO_STD_TOLERANCE


@dataclass(frozen=True, slots=True)
class GroupOutcome:
    """One finished group of a prompt, as its history keeps it."""

    epoch: int
    zero_std: bool  # every sample's reward equal
    reward_mean: float
    length_mean: float  # response tokens per sample
    length_max: int
    version: int  # the oldest token version of the group (`Group.oldest_version`)


@dataclass(frozen=True, slots=True)
class PromptHistory:
    """A dataset row's finished groups, newest last (at most `HISTORY_DEPTH`), and its streak."""

    index: int  # the dataset row
    groups: int = 0  # outcomes ever recorded for this prompt (not only the kept ones)
    zero_std_streak: int = 0  # how many of its latest groups in a row had zero reward variance
    recent: tuple[GroupOutcome, ...] = ()


def outcome_of(group: Group) -> GroupOutcome | None:
    """What a finished group adds to its prompt's history; None when it has a sample without a
    reward (a failed sample: the group says nothing about the prompt's reward spread)."""
    rewards = [s.reward for s in group.samples]
    if not rewards or any(r is None for r in rewards):
        return None
    scored = [float(r) for r in rewards if r is not None]
    lengths = [s.response_len for s in group.samples]
    return GroupOutcome(
        epoch=group.epoch,
        zero_std=rewards_equal(scored),
        reward_mean=sum(scored) / len(scored),
        length_mean=sum(lengths) / len(lengths),
        length_max=max(lengths),
        version=group.oldest_version,
    )


def updated_history(history: PromptHistory | None, index: int, outcome: GroupOutcome) -> PromptHistory:
    """`history` (None: a prompt never seen) with `outcome` added: a pure function, so both stores
    keep exactly the same summary."""
    old = history if history is not None else PromptHistory(index)
    streak = old.zero_std_streak + 1 if outcome.zero_std else 0
    recent = (*old.recent, outcome)[-HISTORY_DEPTH:]
    return dataclasses.replace(old, groups=old.groups + 1, zero_std_streak=streak, recent=recent)


def encode_history(history: PromptHistory) -> bytes:
    outcomes = [[o.epoch, o.zero_std, o.reward_mean, o.length_mean, o.length_max, o.version] for o in history.recent]
    record = [_RECORD_VERSION, _KIND, history.index, history.groups, history.zero_std_streak, outcomes]
    data: bytes = msgpack.packb(record, use_bin_type=True)
    return data


def decode_history(data: bytes, *, key: str) -> PromptHistory:
    """A history record; CorruptRecordError naming `key` for anything this code did not write."""
    try:
        rec: Any = msgpack.unpackb(data, raw=False)
        version, kind, index, groups, streak, outcomes = rec
        if version != _RECORD_VERSION or kind != _KIND:
            raise ValueError(f"a {kind!r} record of version {version}, expected {_KIND!r} of {_RECORD_VERSION}")
        recent = tuple(
            GroupOutcome(int(e), bool(z), float(r), float(lm), int(lx), int(v)) for e, z, r, lm, lx, v in outcomes
        )
        if not all(isinstance(x, int) and x >= 0 for x in (index, groups, streak)) or len(recent) > groups:
            raise ValueError(f"counts out of range: index={index!r} groups={groups!r} streak={streak!r}")
        return PromptHistory(index, groups, streak, recent)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CorruptRecordError(key, f"not a prompt history record: {exc}") from exc

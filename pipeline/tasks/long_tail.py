"""A second built-in task whose answers have long-tailed lengths: "say b x17:" -> 17 b's, then EOS.

The toy task (`pipeline.tasks.toy`) asks for 1..4 copies, so once the policy learns it every response
is short and partial rollout has no stragglers left to handle. Here the asked count follows a
Zipf-like law over 1..`LONG_TAIL_MAX_COUNT` (P(n) proportional to 1/n): most answers stay short,
and a steady few are long, so a trained policy keeps producing stragglers; and a policy that
forgets to stop runs to the length cap and scores 0, which is what the learning benchmark watches.

Prompts use the toy task's format and reward (`toy_reward`): partial credit for the right character
and for a length close to the asked one, so the tiny model learns it within about 100 CPU steps
(first "stop", then "the right character", then "roughly the right length").
"""

from __future__ import annotations

import random

from core.types import PromptTask
from pipeline.tasks.toy import TOY_CHARS, encode, toy_prompt

__all__ = ["LONG_TAIL_MAX_COUNT", "long_tail_dataset", "long_tail_rows"]

LONG_TAIL_MAX_COUNT = 24  # well inside the default 64-token response cap, so a right answer fits


def _counts(max_count: int) -> tuple[list[int], list[float]]:
    counts = list(range(1, max_count + 1))
    return counts, [1.0 / n for n in counts]


def long_tail_rows(n: int, seed: int, *, max_count: int = LONG_TAIL_MAX_COUNT) -> list[dict[str, object]]:
    """`n` JSONL rows (`prompt`, `label`) drawn from `seed`, for `--prompt-data` with `toy_reward`."""
    if not 1 <= max_count <= 99:
        raise ValueError(f"max_count must be in 1..99, got {max_count}")
    rng = random.Random(seed)
    counts, weights = _counts(max_count)
    rows: list[dict[str, object]] = []
    for _ in range(n):
        char, count = rng.choice(TOY_CHARS), rng.choices(counts, weights)[0]
        rows.append({"prompt": toy_prompt(char, count), "label": {"char": char, "count": count}})
    return rows


def long_tail_dataset(n: int, seed: int, *, max_count: int = LONG_TAIL_MAX_COUNT) -> list[PromptTask]:
    """The same rows as `long_tail_rows`, as `PromptTask`s for the tiny model."""
    return [
        PromptTask(index=i, prompt_ids=encode(str(row["prompt"])), label=row["label"])
        for i, row in enumerate(long_tail_rows(n, seed, max_count=max_count))
    ]

"""A third built-in task whose answers are a few tokens long and earn nothing without the end token:
"add 3+4:" -> "7<eos>", "add 9+8:" -> "17<eos>".

The toy and long-tail tasks give partial credit for the right character and the right length, so
a policy that stops early keeps some reward. Here the answer is one or two digits and the reward
asks for the end token right after it: a response that does not stop (truncated), stops with
nothing ("<eos>" alone) or rambles past three characters scores 0. That makes both collapses the
learning benchmark counts reachable: the policy can lose the end token (every sample truncated,
reward 0, advantages 0, no way back) or shrink to the shortest answer and lose what it knew.

Reward, in [0, 1], for `a + b` with answer `a + b`:
    0                           not stopped on EOS, nothing before EOS, or more than 3 characters
    0.2 * digit share           stopped with some non-digit in the answer
    0.4 + 0.6 * closeness       digits only; closeness = max(0, 1 - |value - (a+b)| / 5)
so "7<eos>" scores 1, "8<eos>" 0.88, "x7<eos>" 0.1, "7" (cut at the cap) 0.

Written as JSONL (`short_answer_rows`) and read back through `--prompt-data` with
`--custom-rm-path pipeline.tasks.short_answer:short_answer_reward`, as the learning benchmark does.
"""

from __future__ import annotations

import random

from core.types import PromptTask, Sample, SampleStatus
from pipeline.tasks.tiny_model import EOS_ID
from pipeline.tasks.toy import decode, encode

__all__ = ["MAX_ADDEND", "short_answer_dataset", "short_answer_reward", "short_answer_rows"]

MAX_ADDEND = 9  # a + b with a, b in 0..9: answers of one or two digits
_MAX_ANSWER_CHARS = 3


def short_answer_rows(n: int, seed: int) -> list[dict[str, object]]:
    """`n` JSONL rows (`prompt`, `label` = the sum) drawn from `seed`."""
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    for _ in range(n):
        a, b = rng.randint(0, MAX_ADDEND), rng.randint(0, MAX_ADDEND)
        rows.append({"prompt": f"add {a}+{b}:", "label": a + b})
    return rows


def short_answer_dataset(n: int, seed: int) -> list[PromptTask]:
    """The same rows as `short_answer_rows`, as `PromptTask`s for the tiny model."""
    return [
        PromptTask(index=i, prompt_ids=encode(str(row["prompt"])), label=row["label"])
        for i, row in enumerate(short_answer_rows(n, seed))
    ]


def short_answer_reward(task: PromptTask, sample: Sample) -> float:
    """The reward in [0, 1] described in the module docstring."""
    response = sample.response_ids
    if sample.status is not SampleStatus.COMPLETED or not response or response[-1] != EOS_ID:
        return 0.0
    answer = decode(list(response[:-1]))
    if not answer or len(answer) > _MAX_ANSWER_CHARS:
        return 0.0
    digits = sum(ch.isdigit() for ch in answer)
    if digits < len(answer):
        return 0.2 * digits / len(answer)
    closeness = max(0.0, 1.0 - abs(int(answer) - int(task.label)) / 5)
    return 0.4 + 0.6 * closeness

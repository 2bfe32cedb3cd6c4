"""A built-in task whose answer length follows from the prompt, with a long tail up to a thousand
tokens and more: "say b x517:" -> 517 b's, then EOS. Made for time-to-target runs
(`benchmarks/time_to_target.py`), where generation has to dominate a step as it does in a
reasoning run.

The long-tail task (`pipeline.tasks.long_tail`) asks for at most 24 copies under a 64-token cap,
and its reward pays half for the right character whatever the length, so a policy that writes a
few right characters and stops keeps most of it. Here the asked count `N` follows P(N) ~ 1/N over
`min_count..max_count` (with the defaults, 1..1024: median 24, mean 136, one prompt in eleven above
512), and the reward pays for the fraction of the asked answer written:

    0                                   not stopped on EOS (truncated, aborted, failed) or empty
    correct / max(len(answer), N)       otherwise; correct = right characters among the first N

so "bbb<eos>" scores 1 for N = 3, a right answer half as long as asked 0.5, one twice as long 0.5,
and a policy earns the reward of a long prompt only by writing that long an answer, then stopping.

From random weights the tiny model learns little of it in a few dozen steps: on the CPU (counts up
to 48) the reward went from 0.003 to about 0.1 in 40 steps, and the written length stayed
uncorrelated with the asked count (r = 0.02). The time-to-target benchmark starts from a base model taught the answers'
format (`benchmarks/base_model.py`): it writes the asked length, in the asked letter half the time,
so the response lengths follow the prompts' long tail from the first step, and RL teaches the
letter: the reward rises from about 0.45 to about 0.8 within a few dozen steps.

Written as JSONL (`long_answer_rows`) and read back through `--prompt-data` with
`--custom-rm-path pipeline.tasks.long_answer:long_answer_reward`.
"""

from __future__ import annotations

import random

from core.types import PromptTask, Sample, SampleStatus
from pipeline.tasks.tiny_model import EOS_ID
from pipeline.tasks.toy import TOY_CHARS, encode, toy_prompt

__all__ = [
    "LONG_ANSWER_MAX_COUNT",
    "long_answer_counts",
    "long_answer_dataset",
    "long_answer_reward",
    "long_answer_rows",
]

LONG_ANSWER_MAX_COUNT = 1024  # answers up to a thousand tokens: generation dominates a step
_ID = {ch: encode(ch)[0] for ch in TOY_CHARS}


def long_answer_counts(min_count: int, max_count: int) -> tuple[list[int], list[float]]:
    """The counts a prompt may ask for and their weights, P(N) ~ 1/N."""
    if not 1 <= min_count <= max_count:
        raise ValueError(f"need 1 <= min_count <= max_count, got min_count={min_count}, max_count={max_count}")
    counts = list(range(min_count, max_count + 1))
    return counts, [1.0 / n for n in counts]


def long_answer_rows(
    n: int, seed: int, *, max_count: int = LONG_ANSWER_MAX_COUNT, min_count: int = 1
) -> list[dict[str, object]]:
    """`n` JSONL rows (`prompt`, `label` = char and count) drawn from `seed`."""
    rng = random.Random(seed)
    counts, weights = long_answer_counts(min_count, max_count)
    rows: list[dict[str, object]] = []
    for _ in range(n):
        char, count = rng.choice(TOY_CHARS), rng.choices(counts, weights)[0]
        rows.append({"prompt": toy_prompt(char, count), "label": {"char": char, "count": count}})
    return rows


def long_answer_dataset(
    n: int, seed: int, *, max_count: int = LONG_ANSWER_MAX_COUNT, min_count: int = 1
) -> list[PromptTask]:
    """The same rows as `long_answer_rows`, as `PromptTask`s for the tiny model."""
    return [
        PromptTask(index=i, prompt_ids=encode(str(row["prompt"])), label=row["label"])
        for i, row in enumerate(long_answer_rows(n, seed, max_count=max_count, min_count=min_count))
    ]


def long_answer_reward(task: PromptTask, sample: Sample) -> float:
    """The reward in [0, 1] described in the module docstring."""
    response = sample.response_ids
    if sample.status is not SampleStatus.COMPLETED or not response or response[-1] != EOS_ID:
        return 0.0
    answer = response[:-1]
    if not answer:
        return 0.0
    target, count = _ID[task.label["char"]], int(task.label["count"])
    correct = list(answer[:count]).count(target)
    return correct / max(len(answer), count)

"""A task for the prompt-history benchmark (issue 50): a finite prompt set, seen over many epochs,
whose prompts split three ways.

- **easy** ("hi b:"), `EASY_SHARE` of the rows: reward 1 for any answer made only of the asked
  character (one or more), then EOS. The policy gets there as soon as it writes the asked
  character and stops, which the learnable rows teach in the first steps, and from then on every
  sample of the group scores 1: zero reward variance, which the DAPO filter rejects after
  generating the group. (Not "any stop": that rewards the bare end token, and a policy that learns
  it stops answering the other rows too, until no group has a spread and the filter never fills
  a batch.)
- **hard** ("say c x13:", 10..`HARD_MAX_COUNT` copies), `HARD_SHARE` of the rows: reward 1 only for
  exactly the asked count of the asked character, then EOS. The tiny model does not get there in
  a benchmark's length (the learnable rows ask for at most 4): every sample scores 0, zero
  variance again, though nothing forbids the policy from reaching it later.
- **learnable** ("say c x3:", 1..4 copies), the rest: the toy task's partial-credit reward
  (`toy_reward`), which keeps a spread for as long as the policy is still learning.

So a share of the prompts is solved early and a share is not solvable yet, both repeating epoch
after epoch: what `--skip-zero-std-prompts` is for. Written as JSONL (`easy_hard_rows`) and read
back through `--prompt-data` with `--custom-rm-path pipeline.tasks.easy_hard:easy_hard_reward`.
"""

from __future__ import annotations

import random

from core.types import PromptTask, Sample, SampleStatus
from pipeline.tasks.tiny_model import EOS_ID
from pipeline.tasks.toy import TOY_CHARS, TOY_MAX_COUNT, encode, toy_prompt, toy_reward

__all__ = ["EASY_SHARE", "HARD_MAX_COUNT", "HARD_SHARE", "easy_hard_dataset", "easy_hard_reward", "easy_hard_rows"]

EASY_SHARE = 0.35
HARD_SHARE = 0.25
HARD_MIN_COUNT, HARD_MAX_COUNT = 10, 16


def easy_hard_rows(n: int, seed: int) -> list[dict[str, object]]:
    """`n` JSONL rows (`prompt`, `label` = {kind, char, count}) drawn from `seed`, the kinds in
    their shares (rounded), shuffled."""
    rng = random.Random(seed)
    n_easy, n_hard = round(n * EASY_SHARE), round(n * HARD_SHARE)
    kinds = ["easy"] * n_easy + ["hard"] * n_hard + ["learnable"] * (n - n_easy - n_hard)
    rng.shuffle(kinds)
    rows: list[dict[str, object]] = []
    for kind in kinds:
        char = rng.choice(TOY_CHARS)
        if kind == "easy":
            rows.append({"prompt": f"hi {char}:", "label": {"kind": kind, "char": char, "count": 0}})
            continue
        count = rng.randint(HARD_MIN_COUNT, HARD_MAX_COUNT) if kind == "hard" else rng.randint(1, TOY_MAX_COUNT)
        rows.append({"prompt": toy_prompt(char, count), "label": {"kind": kind, "char": char, "count": count}})
    return rows


def easy_hard_dataset(n: int, seed: int) -> list[PromptTask]:
    """The same rows as `easy_hard_rows`, as `PromptTask`s for the tiny model."""
    return [
        PromptTask(index=i, prompt_ids=encode(str(row["prompt"])), label=row["label"])
        for i, row in enumerate(easy_hard_rows(n, seed))
    ]


def easy_hard_reward(task: PromptTask, sample: Sample) -> float:
    """The reward of the module docstring, by the row's kind."""
    kind = task.label["kind"]
    response = sample.response_ids
    stopped = sample.status is SampleStatus.COMPLETED and bool(response) and response[-1] == EOS_ID
    answer = tuple(response[:-1]) if stopped else ()
    char = encode(str(task.label["char"]))[0]
    if kind == "easy":
        return 1.0 if answer and all(t == char for t in answer) else 0.0
    if kind == "hard":
        return 1.0 if answer == (char,) * int(task.label["count"]) else 0.0
    return toy_reward(task, sample)

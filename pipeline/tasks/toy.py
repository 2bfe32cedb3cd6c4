"""The built-in toy task: "say b x3:" -> "bbb<eos>". Verifiable, generated in code, learnable fast.

Made for the tiny char-level model (`pipeline.tasks.tiny_model`): one token per character, so the reward
reads token ids directly and there is no re-tokenization ambiguity.

Why this task suits a rollout-pipeline demo:
- The random-init model emits EOS with probability about 1/64 per token, so response lengths are
  long-tailed (roughly geometric): many stop early, and a few run to the response limit. Those
  stragglers are what partial rollout exists for.
- GRPO learns it within a few dozen small steps on CPU: first "stop early" (the length credit),
  then "write the asked character" (the character credit). The rise is measured in
  tests/test_trainer_grpo.py::test_grpo_learns_the_toy_task.

Reward, in [0, 1], for a prompt asking for `count` copies of `char`:
- 0 if the response did not stop on EOS (truncated, aborted, failed): no credit for rambling.
- otherwise, with `answer` = the response before EOS:
  0.5 * (fraction of `answer` that is `char`) + 0.5 * min(len, count) / max(len, count)
  so "bbb<eos>" scores 1, "bb<eos>" 0.83, "bxb<eos>" 0.58, "<eos>" 0.
"""

from __future__ import annotations

import random

from core.types import PromptTask, Sample, SampleStatus
from pipeline.tasks.tiny_model import CHARS, EOS_ID, SPECIALS

__all__ = ["TOY_CHARS", "TOY_MAX_COUNT", "decode", "encode", "toy_dataset", "toy_prompt", "toy_reward"]

TOY_CHARS = "abc"  # the characters a prompt may ask for; few, so the tiny model learns them quickly
TOY_MAX_COUNT = 4  # prompts ask for 1..TOY_MAX_COUNT copies

_ID = {ch: len(SPECIALS) + i for i, ch in enumerate(CHARS)}  # the tokenizer's vocabulary order
_CH = {i: ch for ch, i in _ID.items()}


def encode(text: str) -> tuple[int, ...]:
    """Token ids of `text` for the tiny model, the same ids its tokenizer gives (one per char)."""
    try:
        return tuple(_ID[ch] for ch in text)
    except KeyError as exc:
        raise ValueError(f"{text!r}: character {exc.args[0]!r} is not in the tiny model's alphabet") from exc


def decode(ids: tuple[int, ...] | list[int]) -> str:
    """Text of `ids`; special tokens show as <pad>, <eos>, <bos>."""
    return "".join(_CH.get(i, SPECIALS[i] if i < len(SPECIALS) else f"<{i}>") for i in ids)


def toy_prompt(char: str, count: int) -> str:
    return f"say {char} x{count}:"


def toy_dataset(n: int, seed: int, *, chars: str = TOY_CHARS, max_count: int = TOY_MAX_COUNT) -> list[PromptTask]:
    """`n` prompts drawn from `seed`: the same arguments give the same list, in any process."""
    if not chars or max_count < 1 or max_count > 9:
        raise ValueError(f"need a non-empty chars and 1 <= max_count <= 9, got {chars!r}, {max_count}")
    rng = random.Random(seed)
    tasks = []
    for index in range(n):
        char, count = rng.choice(chars), rng.randint(1, max_count)
        tasks.append(
            PromptTask(index=index, prompt_ids=encode(toy_prompt(char, count)), label={"char": char, "count": count})
        )
    return tasks


def toy_reward(task: PromptTask, sample: Sample) -> float:
    """The reward in [0, 1] described in the module docstring."""
    response = sample.response_ids
    if sample.status is not SampleStatus.COMPLETED or not response or response[-1] != EOS_ID:
        return 0.0
    answer = response[:-1]
    if not answer:
        return 0.0
    target, count = _ID[task.label["char"]], int(task.label["count"])
    hit = sum(1 for t in answer if t == target) / len(answer)
    length = min(len(answer), count) / max(len(answer), count)
    return 0.5 * hit + 0.5 * length

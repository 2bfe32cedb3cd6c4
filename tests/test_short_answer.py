"""The short-answer task (`pipeline.tasks.short_answer`) and the learning benchmark's collapse count
(`benchmarks.learning.collapses`), on hand-made samples and curves."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.learning import collapses
from core.types import FinishReason, PromptTask, Sample, Segment
from pipeline.tasks.short_answer import short_answer_dataset, short_answer_reward, short_answer_rows
from pipeline.tasks.tiny_model import EOS_ID
from pipeline.tasks.toy import decode, encode

TASK = PromptTask(index=0, prompt_ids=encode("add 3+4:"), label=7)


def _sample(text: str, *, eos: bool, cap: int = 16) -> Sample:
    ids = (*encode(text), EOS_ID) if eos else encode(text)
    reason = FinishReason.STOP if eos else FinishReason.LENGTH
    return Sample(index=0, prompt_ids=TASK.prompt_ids).extended(
        Segment(ids, (-1.0,) * len(ids), reason, 0), max_response_len=cap if eos else len(ids)
    )


@pytest.mark.parametrize(
    ("text", "eos", "reward"),
    [
        ("7", True, 1.0),
        ("8", True, 0.4 + 0.6 * 0.8),
        ("x7", True, 0.1),
        ("7", False, 0.0),  # no end token: nothing
        ("", True, 0.0),  # the end token alone: nothing
        ("1234", True, 0.0),  # rambling
        ("17", True, 0.4),  # 10 away: closeness 0
    ],
)
def test_reward_needs_the_end_token_and_a_short_right_answer(text, eos, reward):
    assert short_answer_reward(TASK, _sample(text, eos=eos)) == pytest.approx(reward)


def test_rows_and_dataset_agree_and_are_seeded():
    rows = short_answer_rows(50, seed=3)
    assert rows == short_answer_rows(50, seed=3) != short_answer_rows(50, seed=4)
    tasks = short_answer_dataset(50, seed=3)
    assert [decode(list(t.prompt_ids)) for t in tasks] == [r["prompt"] for r in rows]
    assert all(0 <= t.label <= 18 for t in tasks) and any(t.label >= 10 for t in tasks)
    assert dataclasses.replace(tasks[0]).label == rows[0]["label"]


def test_collapses_of_both_kinds_are_counted():
    cap = 64
    steady = ([0.5] * 20, [10.0] * 20)
    assert collapses(*steady, cap) == (False, False)
    at_cap = ([0.5] * 10 + [0.0] * 6, [10.0] * 10 + [63.0] * 6)
    assert collapses(*at_cap, cap) == (True, False)
    four_at_cap = ([0.5] * 10 + [0.0] * 4, [10.0] * 10 + [63.0] * 4)
    assert collapses(*four_at_cap, cap) == (False, False)
    # short answers while the reward falls from its best (0.56 -> 0.17, the async run): a collapse
    climb = [0.1 * i for i in range(6)] + [0.56] * 10
    short_falling = ([*climb, 0.4, 0.3, 0.2, 0.17, 0.17], [5.0] * 16 + [1.5] * 5)
    assert collapses(*short_falling, cap) == (False, True)
    # four such steps are not yet one
    assert collapses([*climb, 0.3, 0.2, 0.17, 0.17], [5.0] * 16 + [1.5] * 4, cap) == (False, False)
    # short answers that are right (a task whose answers are short): the reward holds, with noise
    noisy = [0.6, 0.7, 0.65, 0.74, 0.58, 0.66, 0.7, 0.6, 0.72, 0.68]
    short_holding = (climb + noisy, [5.0] * 16 + [2.0] * 10)
    assert collapses(*short_holding, cap) == (False, False)

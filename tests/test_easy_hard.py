"""The easy-hard task (`pipeline.tasks.easy_hard`) and the learning benchmark's history table
(`benchmarks.learning.history_rows`), on hand-made samples and runs."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks.learning import final_reward, history_rows
from core.types import FinishReason, PromptTask, Sample, Segment
from pipeline.tasks.easy_hard import easy_hard_dataset, easy_hard_reward, easy_hard_rows
from pipeline.tasks.tiny_model import EOS_ID
from pipeline.tasks.toy import decode, encode


def _sample(task: PromptTask, text: str, *, eos: bool) -> Sample:
    ids = (*encode(text), EOS_ID) if eos else encode(text)
    reason = FinishReason.STOP if eos else FinishReason.LENGTH
    return Sample(index=0, prompt_ids=task.prompt_ids).extended(
        Segment(ids, (-1.0,) * len(ids), reason, 0), max_response_len=64 if eos else len(ids)
    )


def _task(kind: str, char: str = "b", count: int = 0) -> PromptTask:
    return PromptTask(index=0, prompt_ids=encode("x:"), label={"kind": kind, "char": char, "count": count})


@pytest.mark.parametrize(
    ("kind", "count", "text", "eos", "reward"),
    [
        ("easy", 0, "b", True, 1.0),  # the asked character, any count, then the end token
        ("easy", 0, "bbbbb", True, 1.0),
        ("easy", 0, "", True, 0.0),  # the end token alone earns nothing
        ("easy", 0, "bz", True, 0.0),
        ("easy", 0, "bb", False, 0.0),
        ("hard", 12, "b" * 12, True, 1.0),  # the exact count, then the end token
        ("hard", 12, "b" * 11, True, 0.0),  # no partial credit
        ("hard", 12, "b" * 12, False, 0.0),
        ("learnable", 3, "bbb", True, 1.0),  # the toy reward
        ("learnable", 3, "bb", True, 0.5 + 0.5 * 2 / 3),
    ],
)
def test_the_reward_by_kind(kind: str, count: int, text: str, eos: bool, reward: float) -> None:
    task = _task(kind, count=count)
    assert easy_hard_reward(task, _sample(task, text, eos=eos)) == pytest.approx(reward)


def test_rows_split_in_their_shares_and_are_seeded() -> None:
    rows = easy_hard_rows(96, seed=7)
    assert rows == easy_hard_rows(96, seed=7) != easy_hard_rows(96, seed=8)
    kinds = Counter(r["label"]["kind"] for r in rows)  # type: ignore[index]
    assert kinds == {"easy": 34, "hard": 24, "learnable": 38}
    tasks = easy_hard_dataset(96, seed=7)
    assert [decode(list(t.prompt_ids)) for t in tasks] == [r["prompt"] for r in rows]
    assert all(10 <= t.label["count"] <= 16 for t in tasks if t.label["kind"] == "hard")


def _run(mode: str, evals: dict[int, float], tokens_per_step: float, step_time: list[float]) -> dict[str, object]:
    steps = len(step_time)
    return {
        "task": "t",
        "mode": mode,
        "seed": 0,
        "seconds": 60.0,
        "reward": [0.5] * steps,
        "eval": {str(k): v for k, v in evals.items()},  # as read back from runs.jsonl
        "tokens": [tokens_per_step * (i + 1) for i in range(steps)],
        "step_time": step_time,
    }


def test_the_history_table_compares_each_setting_with_its_baseline_at_the_same_reward() -> None:
    evals = {0: 0.1, 4: 0.5, 8: 0.9}
    runs = [
        _run("dapo", evals, 100.0, [1.0] * 8),
        _run("dapo-skip", {0: 0.1, 4: 0.85, 8: 0.9}, 60.0, [1.0] * 8),
        _run("sync", evals, 100.0, [1.0] * 7 + [3.0]),
        _run("length", evals, 100.0, [1.0] * 7 + [1.5]),
    ]
    assert final_reward(runs[0]) == 0.9  # the evaluations of the last quarter (step 8)
    rows = {r["mode"]: r for r in history_rows(runs)}
    # target 0.9 x 0.9 = 0.81: dapo reaches it after 8 steps (800 tokens), dapo-skip after 4 (240)
    assert (rows["dapo"]["steps_to_target"], rows["dapo"]["tokens_to_target"]) == (8, 800.0)
    assert (rows["dapo-skip"]["steps_to_target"], rows["dapo-skip"]["tokens_to_target"]) == (4, 240.0)
    assert rows["dapo-skip"]["tokens_vs_baseline"] == pytest.approx(0.3)
    assert rows["dapo-skip"]["wall_vs_baseline"] == pytest.approx(0.5)
    assert rows["length"]["baseline"] == "sync" and rows["length"]["tail"] < rows["sync"]["tail"]
    assert rows["length"]["tail_vs_baseline"] == pytest.approx(rows["length"]["tail"] / rows["sync"]["tail"])

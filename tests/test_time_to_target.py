"""The time-to-target benchmark's logic on synthetic runs (no launcher runs: those are the benchmark's),
the long-answer task's reward and prompts, and the base model's supervised data.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest

from benchmarks.base_model import RIGHT_LETTER_SHARE, _batches, base_answer
from benchmarks.target_summary import (
    TargetSpec,
    figures,
    summarize,
    table,
    time_to_target,
    trailing_mean,
    verdicts,
)
from benchmarks.time_to_target import (
    COLOCATED,
    MODES,
    PRESETS,
    estimate,
    fits,
    launch_flags,
    length_correlation,
    planned_runs,
    record,
)
from core.types import FinishReason, PromptTask, Sample, Segment
from pipeline.tasks.long_answer import long_answer_reward, long_answer_rows
from pipeline.tasks.tiny_model import EOS_ID
from pipeline.tasks.toy import encode


def _run(mode: str, seed: int, reward: list[float], seconds: list[float], **extra: object) -> dict[str, object]:
    return {"mode": mode, "seed": seed, "batch": 16, "reward": reward, "step_seconds": seconds, **extra}


# ---- the target and one run's figures ----------------------------------------------------------


def test_target_spec_reads_a_reward_or_a_share_of_the_plateau() -> None:
    assert TargetSpec.parse("0.8x").resolve(0.75) == pytest.approx(0.6)
    assert TargetSpec.parse("0.62").resolve(None) == 0.62
    assert str(TargetSpec.parse(" 0.8x ")) == "0.8x"
    with pytest.raises(ValueError, match="needs the calibration run's plateau"):
        TargetSpec.parse("0.8x").resolve(None)
    for bad in ("abc", "1.5", "0", "-0.2x", "nanx"):
        with pytest.raises(ValueError, match=f"--target '{bad}'"):
            TargetSpec.parse(bad)


def test_time_to_target_is_the_steps_seconds_to_the_first_smoothed_reach() -> None:
    reward = [0.1, 0.9, 0.1, 0.5, 0.6, 0.7]
    seconds = [2.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert trailing_mean(reward, 2) == pytest.approx([0.1, 0.5, 0.5, 0.3, 0.55, 0.65])
    # One noisy step does not reach 0.55 over a trailing mean of 2; step 4 does, at 2+1+1+1+1 s.
    assert time_to_target(reward, seconds, 0.55, 2) == pytest.approx(6.0)
    assert time_to_target(reward, seconds, 0.55, 1) == pytest.approx(3.0)  # unsmoothed: step 1's 0.9
    assert time_to_target(reward, seconds, 0.95, 2) is None
    with pytest.raises(ValueError, match="one of each per step"):
        time_to_target(reward, seconds[:-1], 0.5, 1)


def test_a_runs_figures_weight_busy_by_step_time() -> None:
    run = _run(
        "async",
        0,
        [0.2, 0.4, 0.6, 0.8],
        [1.0, 3.0, 2.0, 2.0],
        busy=[0.5, 1.0, 1.0, 0.5],
        publish_stall=[0.1, 0.3, 0.2, 0.2],
    )
    fig = figures(run, target=0.5, smooth=1)
    assert fig.time_to_target == pytest.approx(6.0) and fig.steps_to_target == 3
    assert fig.final_reward == pytest.approx(0.8)  # the last quarter of 4 steps is the last step
    assert fig.groups_per_second == pytest.approx(4 * 16 / 8.0)
    assert fig.busy == pytest.approx((0.5 + 3.0 + 2.0 + 1.0) / 8.0)
    assert fig.publish_stall == pytest.approx(0.2)


# ---- per mode: ratios and verdicts ---------------------------------------------------------------


def _set() -> list[dict[str, object]]:
    rise = [0.1, 0.3, 0.5, 0.7, 0.8, 0.8, 0.8, 0.8]
    return [
        _run("sync", 100, rise, [10.0] * 8, calibration=True),  # left out of the table
        *(_run("sync", s, rise, [10.0] * 8) for s in (0, 1)),  # target 0.7 at step 3: 40 s
        *(_run("partial", s, rise, [9.0] * 8) for s in (0, 1)),  # 36 s: 0.9x, misses 0.8x
        *(_run("async", s, rise, [5.0] * 8) for s in (0, 1)),  # 20 s: 0.5x, meets 0.6x
        _run("async-overlap", 0, rise, [5.0] * 8),
        _run("async-overlap", 1, [0.1] * 8, [5.0] * 8),  # one seed never reaches it
    ]


def test_summarize_holds_each_mode_against_sync() -> None:
    rows = {r["mode"]: r for r in summarize(_set(), target=0.7, smooth=1)}
    assert list(rows) == ["sync", "partial", "async", "async-overlap"]
    assert rows["sync"]["seeds"] == 2  # the calibration run is not a compared seed
    assert rows["sync"]["time_to_target"] == pytest.approx(40.0)
    assert rows["partial"]["time_ratio"] == pytest.approx(0.9)
    assert rows["async"]["time_ratio"] == pytest.approx(0.5)
    assert rows["async"]["reward_ratio"] == pytest.approx(1.0)
    assert rows["async-overlap"]["reached"] == 1 and rows["async-overlap"]["time_ratio"] is None
    assert rows["async-overlap"]["reward_ratio"] == pytest.approx(0.45 / 0.8)
    lines = verdicts(list(rows.values()))
    assert "target partial time <= 0.8x sync: 0.90x (36.0 s against 40.0 s): MISSED" in lines
    assert "target async time <= 0.6x sync: 0.50x (20.0 s against 40.0 s): MET" in lines
    assert "target async final reward within 5% of sync: 1.000: MET" in lines
    assert any(line.startswith("target async-overlap time") and "not measured" in line for line in lines)
    assert "target async-overlap final reward within 5% of sync: 0.562: MISSED" in lines
    text = table(list(rows.values()), 0.7)
    assert "| async | 2/2 | 20.0 ± 0.0 | 0.50 |" in text and "| async-overlap | 1/2 |" in text


def test_colocated_modes_are_held_against_colocated_sync() -> None:
    rise = [0.1, 0.5, 0.9, 0.9]
    runs = [
        _run("sync", 0, rise, [10.0] * 4),
        _run("sync-colocated", 0, rise, [12.0] * 4),
        _run("async-colocated", 0, rise, [6.0] * 4),
    ]
    rows = {r["mode"]: r for r in summarize(runs, target=0.8, smooth=1)}
    assert rows["sync-colocated"]["baseline"] == "sync" and rows["sync-colocated"]["time_ratio"] == pytest.approx(1.2)
    assert rows["async-colocated"]["baseline"] == "sync-colocated"
    assert rows["async-colocated"]["time_ratio"] == pytest.approx(0.5)
    assert not any(line.startswith("target sync-colocated") for line in verdicts(list(rows.values())))


def test_the_picture_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks.target_summary import plot

    plot(_set(), tmp_path / "t.png", 0.7, title="synthetic")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the run plan and the budget ------------------------------------------------------------------


def test_runs_go_seed_by_seed_colocated_last() -> None:
    order = planned_runs(["sync", "sync-colocated", "async"], [0, 1])
    assert order == [("sync", 0), ("async", 0), ("sync", 1), ("async", 1), ("sync-colocated", 0), ("sync-colocated", 1)]


def test_a_run_starts_only_where_its_estimate_fits() -> None:
    done = [{"mode": "sync", "wall": 100.0}, {"mode": "sync", "wall": 120.0}, {"mode": "async", "wall": 50.0}]
    assert estimate("sync", done) == pytest.approx(110.0)
    assert estimate("partial", done) == pytest.approx(120.0)  # never ran: the longest past run
    assert estimate("sync", []) is None
    assert fits(None, 0.0)  # the first run of a folder starts
    assert fits(110.0, 122.0) and not fits(110.0, 120.0)


def test_every_modes_flags_pass_the_launchers_rules(tmp_path: Path) -> None:
    from core.errors import ConfigError
    from pipeline.config import load_config
    from pipeline.tasks.tiny_model import make_model_folder

    tiny_model = make_model_folder(tmp_path / "model")

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in long_answer_rows(8, seed=0, max_count=16)))
    # Each mode once: the colocated ones on a GPU (--colocate refuses a CPU), the others on the CPU
    # and sync on a GPU too, for the device flags.
    for device, modes in (("cpu", [m for m in MODES if not m.endswith("-colocated")]), ("cuda", ["sync", *COLOCATED])):
        plan = dataclasses.replace(PRESETS["h200"], device=device)
        for mode in modes:
            flags = launch_flags(plan, mode, 0, base=tiny_model, prompts=prompts, out=tmp_path / f"{device}-{mode}")
            if "partial" in mode:
                assert flags[flags.index("--over-sampling-batch-size") + 1] == str(2 * plan.batch)
            assert ("--rollout-device" in flags) == (device == "cuda" and not mode.endswith("-colocated"))
            try:
                config = load_config(flags)
            except ConfigError as exc:
                # Here torch sees no GPU, and the rules say so; every other rule passed.
                assert device == "cuda" and len(exc.problems) == 1 and "sees no GPU" in exc.problems[0], exc
                continue
            assert config.engine.colocate == mode.endswith("-colocated")
            assert config.rollout.mode == ("async" if mode.startswith("async") else "sync")


# ---- reading a run ---------------------------------------------------------------------------------


def test_a_run_record_reads_the_kept_metric_names_and_skips_evaluations(tmp_path: Path) -> None:
    steps = [
        {
            "step": i,
            "rollout/raw_reward": 0.1 * i,
            "perf/step_time": 2.0,
            "engine/busy_frac": 0.5,
            "time/publish_gate_closed": 0.25,
            "perf/train_time": 0.5,
            "rollout/response_len/mean": 40.0,
            "rollout/response_len/max": 90,
            "rollout/truncated_ratio": 0.0,
            "staleness/max": i,
        }
        for i in range(3)
    ]
    lines = [steps[0], {"step": 0, "eval/step": 0, "version": 1, "eval/toy": 0.5}, *steps[1:]]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    events = [
        {"kind": "request", "group": "e0000-p000000000", "sample": 0, "start": 0, "end": 1, "prefix": 0, "tokens": 3,
         "finish": "stop"},
        {"kind": "request", "group": "e0000-p000000001", "sample": 0, "start": 0, "end": 1, "prefix": 0, "tokens": 4,
         "finish": "abort"},
        {"kind": "request", "group": "e0000-p000000001", "sample": 0, "start": 2, "end": 3, "prefix": 4, "tokens": 8,
         "finish": "stop"},
        {"kind": "request", "group": "e0001-p000000002", "sample": 1, "start": 0, "end": 1, "prefix": 0, "tokens": 29,
         "finish": "stop"},
        {"kind": "train", "start": 1, "end": 2},
    ]  # fmt: skip
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    plan = PRESETS["cpu"]
    rec = record(tmp_path, "partial", 1, plan, [3, 12, 29], wall=10.0, calibration=False)
    assert rec["reward"] == pytest.approx([0.0, 0.1, 0.2]) and rec["step_seconds"] == [2.0] * 3
    assert rec["busy"] == [0.5] * 3 and rec["publish_stall"] == [0.25] * 3 and rec["staleness_max"] == 2
    # The resumed sample's length is its last request's prefix plus tokens: 12 for the count 12.
    assert rec["length_corr"] == pytest.approx(1.0)
    assert math.isnan(length_correlation(tmp_path / "absent.jsonl", [1]))


# ---- the long-answer task and its base model's data -----------------------------------------------


def _sample(char_ids: list[int], *, stopped: bool = True) -> Sample:
    ids = (*char_ids, EOS_ID) if stopped else tuple(char_ids)
    reason = FinishReason.STOP if stopped else FinishReason.LENGTH
    return Sample(index=0, prompt_ids=(5,)).extended(Segment(ids, (-1.0,) * len(ids), reason, 0), max_response_len=64)


def test_long_answer_reward_pays_the_share_of_the_asked_answer_written() -> None:
    task = PromptTask(index=0, prompt_ids=encode("say b x4:"), label={"char": "b", "count": 4})
    b, c = encode("b")[0], encode("c")[0]
    assert long_answer_reward(task, _sample([b] * 4)) == 1.0
    assert long_answer_reward(task, _sample([b] * 2)) == 0.5  # half as long as asked
    assert long_answer_reward(task, _sample([b] * 8)) == 0.5  # twice as long
    assert long_answer_reward(task, _sample([b, c, b, b])) == 0.75
    assert long_answer_reward(task, _sample([c] * 4)) == 0.0
    assert long_answer_reward(task, _sample([b] * 4, stopped=False)) == 0.0  # no end token
    assert long_answer_reward(task, _sample([])) == 0.0


def test_long_answer_prompts_have_a_long_tail() -> None:
    rows = long_answer_rows(4000, seed=3)
    assert rows == long_answer_rows(4000, seed=3)
    counts = sorted(int(r["label"]["count"]) for r in rows)  # type: ignore[index]
    assert 1 <= counts[0] and counts[-1] <= 1024
    assert counts[len(counts) // 2] < 64 < 512 < counts[-40]  # median short, the top 1% long
    with pytest.raises(ValueError, match="min_count <= max_count"):
        long_answer_rows(1, seed=0, max_count=0)


def test_the_base_model_data_writes_the_asked_letter_half_the_time() -> None:
    rng = random.Random(0)
    answers = [base_answer("b", 7, rng) for _ in range(2000)]
    assert all(len(a) == 7 and len(set(a)) == 1 for a in answers)
    share = sum(a[0] == "b" for a in answers) / len(answers)
    assert abs(share - RIGHT_LETTER_SHARE) < 0.05
    assert {a[0] for a in answers} == {"a", "b", "c"}


def test_base_model_batches_mix_lengths_and_take_every_row_once() -> None:
    rows = [([1] * 10, [2] * n) for n in range(1, 101)]
    batches = _batches(rows, 32, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(len(rows)))
    assert [len(b) for b in batches] == [32, 32, 32, 4]
    # Shuffled, not sorted by length: a batch holds short and long answers alike.
    assert all(max(b) - min(b) > 50 for b in batches[:3])


# ---- the cluster twin's arithmetic ------------------------------------------------------------------


def test_the_cluster_twin_takes_steps_to_target_from_the_seed_mean_curve(tmp_path: Path) -> None:
    from benchmarks.cluster_twin import _learning_runs, predict, steps_to_target

    runs = [
        _run("sync", 0, [0.1, 0.5, 0.7, 0.9], [1.0] * 4),
        _run("sync", 1, [0.1, 0.3, 0.5, 0.7], [1.0] * 4),  # seed mean 0.1, 0.4, 0.6, 0.8
        _run("async", 0, [0.2, 0.2, 0.2, 0.2], [1.0] * 4),
        _run("sync", 100, [0.9] * 4, [1.0] * 4, calibration=True),  # not a compared seed
    ]
    assert steps_to_target(runs, 0.6, smooth=1) == {"sync": (3, 2), "async": (None, 1)}
    assert steps_to_target(runs, 0.6, smooth=2) == {"sync": (4, 2), "async": (None, 1)}
    assert predict(100.0, 20.0, 1) == 100.0 and predict(100.0, 20.0, 4) == 160.0
    # learning.py's runs.jsonl: one task's runs, by --task.
    path = tmp_path / "runs.jsonl"
    lines = [{**_run("sync", 0, [0.1], [1.0]), "task": t} for t in ("toy", "long-tail")]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [r["task"] for r in _learning_runs(path, "long-tail")] == ["long-tail"]
    assert [r["task"] for r in _learning_runs(path, None)] == ["long-tail"]  # the first, sorted
    with pytest.raises(SystemExit, match="--task 'math'"):
        _learning_runs(path, "math")

"""The time-to-target benchmark's logic on synthetic runs, the long-answer task's reward and prompts,
the base model's supervised data, and one end-to-end `--quick` call (real launcher runs and their
evaluations, on the CPU).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import statistics
import sys
from pathlib import Path

import pytest

from benchmarks.base_model import RIGHT_LETTER_SHARE, _batches, base_answer
from benchmarks.target_eval import eval_clock, read_evaluation, refine_versions
from benchmarks.target_run import COLOCATED, EVAL_KEY, MODES, launch_flags, length_correlation, record
from benchmarks.target_summary import (
    TargetSpec,
    calibration_points,
    figures,
    paired_ratio,
    ratio_noise,
    summarize,
    table,
    time_to_target,
    trailing_mean,
    verdicts,
)
from benchmarks.time_to_target import PRESETS, estimate, fits, planned_runs
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
    for bad in ("abc", "1.5", "0", "-0.2x", "nanx", "1.2r", "0r", "r", "0.8y"):
        with pytest.raises(ValueError, match=f"--target '{bad}'"):
            TargetSpec.parse(bad)


def test_target_spec_reads_a_share_of_the_rise() -> None:
    spec = TargetSpec.parse(" 0.8r")
    assert spec.relative and spec.form == "rise" and str(spec) == "0.8r"
    # The H200's first sync run: from 0.57 to 0.87. 0.8x sat at 0.696, reached in a few steps;
    # 0.8r sits at 0.81, four fifths of the way up.
    assert spec.resolve(0.87, 0.57) == pytest.approx(0.81)
    assert TargetSpec.parse("0.8x").resolve(0.87, 0.57) == pytest.approx(0.696)
    assert TargetSpec.parse("1r").resolve(0.87, 0.57) == pytest.approx(0.87)
    assert TargetSpec.parse("0.62").resolve(None, None) == 0.62
    with pytest.raises(ValueError, match=r"--target 0.8r: .* needs the calibration run's plateau"):
        spec.resolve(None, 0.57)
    with pytest.raises(ValueError, match=r"--target 0.8r: a share of the rise needs the calibration run's start"):
        spec.resolve(0.87)
    with pytest.raises(ValueError, match="form 'share'"):
        TargetSpec(0.8, "share")


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


def _evaluated(
    mode: str, seed: int, reward: list[float], seconds: list[float], ev: dict[str, list[float]]
) -> dict[str, object]:
    return _run(mode, seed, reward, seconds, eval={"version": [0, 2, 4], **ev})


def test_a_run_with_an_evaluation_is_judged_by_it() -> None:
    # The batch reward is biased high early (short answers train first); the held-out one is not.
    run = _evaluated(
        "partial", 0, [0.9, 0.9, 0.6, 0.6], [2.0] * 4, {"reward": [0.3, 0.6, 0.8], "seconds": [0, 3.5, 7.0]}
    )
    fig = figures(run, target=0.7, smooth=1)
    assert fig.measure == "eval"
    assert fig.time_to_target == pytest.approx(7.0) and fig.steps_to_target == 4  # version 4: after 4 steps
    assert fig.final_reward == pytest.approx(0.8)  # the last quarter of 3 evaluations: the last
    assert fig.batch_final_reward == pytest.approx(0.6)
    assert fig.steps == 4 and fig.seconds == pytest.approx(8.0)
    # A trailing mean over two evaluations: (0.6 + 0.8) / 2 = 0.7 at version 4 still; 0.75 never.
    assert figures(run, target=0.7, smooth=1, smooth_eval=2).time_to_target == pytest.approx(7.0)
    assert figures(run, target=0.75, smooth=1, smooth_eval=2).time_to_target is None
    # Without the evaluation (an old record) the same run is judged by its batches: at step 1.
    old = {k: v for k, v in run.items() if k != "eval"}
    assert figures(old, target=0.7, smooth=1).time_to_target == pytest.approx(2.0)
    assert figures(old, target=0.7, smooth=1).measure == "batch"
    bad = _evaluated("sync", 0, [0.5] * 4, [1.0] * 4, {"reward": [0.3, 0.6], "seconds": [0, 2, 4]})
    with pytest.raises(ValueError, match="3 versions, 2 rewards and 3 times"):
        figures(bad, target=0.7, smooth=1)


def test_the_calibration_run_fixes_start_and_plateau_by_its_measure() -> None:
    run = _evaluated("sync", 0, [0.5, 0.6, 0.7, 0.9], [1.0] * 4, {"reward": [0.4, 0.7, 0.9], "seconds": [0, 2, 4]})
    assert calibration_points(run, smooth=3) == pytest.approx((0.4, 0.9))  # version 0; the last evaluation
    old = {k: v for k, v in run.items() if k != "eval"}
    assert calibration_points(old, smooth=3) == pytest.approx((0.6, 0.9))  # the first 3 steps' mean; the last step


def test_the_evaluations_clock_leaves_the_checkpoints_extra_seconds_out() -> None:
    steps = [2.0, 2.0, 2.0, 2.0]
    saves = [0.1, 0.5, 0.1, 0.7]  # a weights-only folder at steps 0 and 2, a checkpoint at 1 and 3
    checkpoint = [False, True, False, True]
    # Version 2 after steps 0-1: 4 s less the checkpoint's 0.4 s beyond a weights-only save.
    assert eval_clock(steps, saves, checkpoint, [0, 2, 4]) == pytest.approx([0.0, 3.6, 7.0])
    # No step without a checkpoint (nothing to compare with): each checkpoint's whole save.
    assert eval_clock(steps[:2], [0.3, 0.3], [True, True], [1, 2]) == pytest.approx([1.7, 3.4])
    # A colocated run wrote every folder for the evaluation alone: every save is left out, whole.
    assert eval_clock(steps, saves, checkpoint, [0, 2, 4], all_saves=True) == pytest.approx([0.0, 3.4, 6.6])
    with pytest.raises(ValueError, match=r"versions \[5\]: a run of 4 steps makes versions 0..4"):
        eval_clock(steps, saves, checkpoint, [0, 5])


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
    paired = " (paired by seed, 2 seeds: {}x ± 0.00, two standard errors)"  # every seed alike
    assert "target partial time <= 0.8x sync: 0.90x (36.0 s against 40.0 s): MISSED" + paired.format("0.90") in lines
    assert "target async time <= 0.6x sync: 0.50x (20.0 s against 40.0 s): MET" + paired.format("0.50") in lines
    assert "target async final reward within 5% of sync: 1.000: MET" in lines
    assert any(line.startswith("target async-overlap time") and "not measured" in line for line in lines)
    # Its seeds end at 0.1 and 0.8: missed by the mean, and the spread says two seeds cannot tell.
    assert "target async-overlap final reward within 5% of sync: 0.562: MISSED (within the seeds' noise: ±0.87" in (
        " ".join(lines)
    )
    text = table(list(rows.values()), 0.7)
    assert "| async | 2/2 | 20.0 ± 0.0 | 0.50 (0.50 ± 0.00 by seed) |" in text and "| async-overlap | 1/2 |" in text
    assert "| sync | 2/2 | 40.0 ± 0.0 | 1.00 |" in text  # the baseline against itself: no seed by seed
    assert "trained-batch last-quarter reward" in text


def test_a_verdict_says_when_its_line_lies_inside_the_seeds_noise() -> None:
    def at(final: float) -> list[float]:
        return [0.1, 0.9, final, final, final, final, final, final]

    # Sync's seeds end at 0.80 and 0.84; async's at 0.70 and 0.82: 0.952 of sync by the mean, and
    # its spread over two seeds is wide enough to put 0.95 inside two standard errors.
    runs = [
        _run("sync", 0, at(0.80), [10.0] * 8),
        _run("sync", 1, at(0.84), [10.0] * 8),
        _run("async", 0, at(0.70), [5.0] * 8),
        _run("async", 1, at(0.82), [5.0] * 8),
        _run("partial", 0, at(0.40), [9.0] * 8),
        _run("partial", 1, at(0.41), [9.0] * 8),
    ]
    rows = {r["mode"]: r for r in summarize(runs, target=0.5, smooth=1)}
    noise = rows["async"]["reward_ratio_noise"]
    assert 0.95 - rows["async"]["reward_ratio"] < noise < 0.2
    lines = verdicts(list(rows.values()))
    said = next(line for line in lines if line.startswith("target async final reward"))
    assert said.startswith("target async final reward within 5% of sync: 0.927: MISSED (within the seeds' noise: ±")
    # Partial's seeds agree and sit far below: missed beyond the noise, said plainly.
    assert "target partial final reward within 5% of sync: 0.494: MISSED" in lines
    # Equal times in every seed: no spread, paired or not.
    assert "target async time <= 0.6x sync: 0.50x (10.0 s against 20.0 s): MET (paired by seed, 2 seeds: 0.50x" in (
        " ".join(lines)
    )
    # One seed a side has no spread to go by.
    assert ratio_noise((0.8, 0.0, 1), (0.8, 0.1, 3)) is None


def test_the_time_ratio_is_also_read_seed_by_seed() -> None:
    """A seed fixes the prompts' order and the rollouts' seeds in every mode, so a seed slow in one
    mode is slow in all: the per-seed ratios spread far less than the times. Here sync takes 40
    and 20 s, async 22 and 10 s: by the means 0.53x with a noise (seeds taken as independent)
    that spans 0.6x; seed by seed 0.55x and 0.50x, clear of it."""
    rise = [0.1, 0.3, 0.5, 0.7, 0.8, 0.8, 0.8, 0.8]
    runs = [
        _run("sync", 0, rise, [10.0] * 8),
        _run("sync", 1, rise, [5.0] * 8),
        _run("async", 0, rise, [5.5] * 8),
        _run("async", 1, rise, [2.5] * 8),
        _run("partial", 0, rise, [9.0] * 8),  # one seed: nothing to spread
    ]
    rows = {r["mode"]: r for r in summarize(runs, target=0.7, smooth=1)}
    value, noise, seeds = rows["async"]["time_ratio_paired"]
    assert seeds == 2 and value == pytest.approx(0.525)
    assert noise == pytest.approx(2 * statistics.stdev([0.55, 0.5]) / math.sqrt(2))
    assert rows["async"]["time_ratio_noise"] > 0.6 - rows["async"]["time_ratio"]  # unpaired: spans the goal
    assert rows["partial"]["time_ratio_paired"] == (pytest.approx(0.9), None, 1)
    assert "| partial | 1/1 | 36.0 ± 0.0 | 1.20 (0.90 by seed) |" in table(list(rows.values()), 0.7)
    lines = verdicts(list(rows.values()))
    assert (
        "target async time <= 0.6x sync: 0.53x (16.0 s against 30.0 s): MET (paired by seed, 2 seeds: 0.53x ± 0.05"
        in (" ".join(lines))
    )
    assert not any("spanning the goal" in line for line in lines)
    # One seed paired: the unpaired rule speaks (and has no spread either).
    assert "target partial time <= 0.8x sync: 1.20x (36.0 s against 30.0 s): MISSED" in lines
    assert paired_ratio({0: 1.0}, {1: 2.0}) is None and paired_ratio({0: 1.0}, {0: 0.0}) is None
    assert paired_ratio({0: 1.0, 1: 1.0, 2: 9.0}, {0: 2.0, 1: 4.0}) == (0.375, pytest.approx(0.25), 2)  # seed 2 alone


def test_a_crossing_between_evaluations_is_bracketed_and_read_off_a_straight_line() -> None:
    def run(mode: str, reward: list[float], seconds: list[float]) -> dict[str, object]:
        return _evaluated(mode, 0, [0.5] * 4, [1.0] * 4, {"reward": reward, "seconds": seconds})

    runs = [
        run("sync", [0.2, 0.6, 1.0], [0.0, 40.0, 80.0]),  # crosses 0.8 between 40 and 80 s: at 60 on the line
        run("partial", [0.2, 0.6, 1.0], [0.0, 30.0, 60.0]),  # between 30 and 60 s: at 45
        run("async", [0.2, 0.9, 1.0], [0.0, 20.0, 40.0]),  # between 0 and 20 s: at 20 x 0.6 / 0.7
    ]
    rows = {r["mode"]: r for r in summarize(runs, target=0.8, smooth=1)}
    sync, partial, fast = rows["sync"], rows["partial"], rows["async"]
    assert (sync["time_floor"], sync["time_to_target"], sync["time_interpolated"]) == pytest.approx((40, 80, 60))
    assert fast["time_interpolated"] == pytest.approx(20 * 0.6 / 0.7)
    assert partial["time_ratio"] == pytest.approx(0.75)
    assert partial["time_ratio_bracket"] == pytest.approx((30 / 80, 60 / 40))
    assert partial["time_ratio_interpolated"] == pytest.approx(0.75)
    lines = verdicts(list(rows.values()))
    # Partial's 0.8x line lies inside what its crossings allow: MET on the grid, and it says the grid cannot tell.
    assert (
        "target partial time <= 0.8x sync: 0.75x (60.0 s against 80.0 s): MET (between evaluations: the "
        "crossings fit any ratio from 0.38x to 1.50x, 0.75x on straight lines between them)"
    ) in lines
    # Async's whole bracket (0 to 0.5x) lies under 0.6x: the grid cannot change the verdict, so nothing is added.
    assert "target async time <= 0.6x sync: 0.25x (20.0 s against 80.0 s): MET" in lines
    # A baseline that reaches the target at its first evaluation after the start leaves no upper bound.
    first = [run("sync", [0.2, 0.9, 1.0], [0.0, 40.0, 80.0]), run("async", [0.2, 0.6, 1.0], [0.0, 20.0, 40.0])]
    row = summarize(first, target=0.8, smooth=1)[1]
    assert row["time_ratio_bracket"] == (20 / 40, math.inf)
    assert "from 0.50x to no bound" in verdicts([row])[0]


def test_a_runs_refinement_puts_the_crossing_at_its_step_and_leaves_the_rest_to_the_grid() -> None:
    grid = {
        "version": [0, 2, 4, 6, 8, 10, 12],
        "reward": [0.2, 0.6, 1.0, 0.9, 0.9, 0.9, 0.7],
        "seconds": [0.0, 40.0, 80.0, 120.0, 160.0, 200.0, 240.0],
    }
    run = _run("sync", 0, [0.5] * 12, [20.0] * 12, eval=grid)
    coarse = figures(run, target=0.8, smooth=1)
    assert (coarse.time_to_target, coarse.steps_to_target, coarse.time_floor) == (80.0, 4, 40.0)
    run["eval_refined"] = {"version": [3], "reward": [0.85], "seconds": [60.0]}
    fine = figures(run, target=0.8, smooth=1)
    assert (fine.time_to_target, fine.steps_to_target, fine.time_floor) == (60.0, 3, 40.0)
    assert fine.time_interpolated == pytest.approx(40.0 + 20.0 * 0.2 / 0.25)
    # The last quarter is the grid's (its last of 7 evaluations), as in a run without refinement.
    assert fine.final_reward == coarse.final_reward == pytest.approx(0.7)
    # A refined version short of the target moves only the floor.
    run["eval_refined"] = {"version": [3], "reward": [0.7], "seconds": [60.0]}
    short = figures(run, target=0.8, smooth=1)
    assert (short.time_to_target, short.time_floor) == (80.0, 60.0)
    # Read through a trailing mean over evaluations, denser points would be another measure: the grid alone.
    assert figures(run, target=0.8, smooth=1, smooth_eval=2).time_floor == coarse.time_floor
    # Which versions a run evaluates again: the kept ones strictly between the grid's points around its crossing.
    assert refine_versions(grid, [1, 2, 3, 5], target=0.8) == [3]
    assert refine_versions(grid, [1, 3], target=1.1) == []  # never reached
    assert refine_versions({**grid, "reward": [0.9] * 7}, [1, 3], target=0.8) == []  # reached at the start


def test_a_baseline_at_the_target_from_its_start_gives_no_ratio() -> None:
    at_start = {"reward": [0.8, 0.8, 0.8], "seconds": [0.0, 4.0, 8.0]}
    runs = [
        _evaluated("sync", 0, [0.5] * 4, [2.0] * 4, at_start),
        _evaluated("async", 0, [0.5] * 4, [1.0] * 4, {**at_start, "seconds": [0.0, 2.0, 4.0]}),
    ]
    rows = {r["mode"]: r for r in summarize(runs, target=0.7, smooth=1)}
    assert rows["sync"]["time_to_target"] == 0.0 and rows["async"]["time_ratio"] is None
    assert rows["async"]["steps_to_target"] == 0.0 and rows["async"]["measure"] == "eval"
    assert (
        "not measured (its baseline reached the target at its start, with no training)"
        in verdicts(list(rows.values()))[0]
    )


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

    evaluated = _evaluated("sync", 7, [0.5] * 4, [1.0] * 4, {"reward": [0.4, 0.7, 0.9], "seconds": [0, 2, 4]})
    plot([*_set(), evaluated], tmp_path / "t.png", 0.7, title="synthetic")
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
    # The evaluation's seconds are the last run's, whatever its mode: older ones may have been made
    # one version at a time, the last the way this call makes them.
    done += [
        {"mode": "async", "wall": 70.0, "eval_seconds": 80.0},
        {"mode": "sync", "wall": 140.0, "eval_seconds": 30.0},
    ]
    assert estimate("sync", done) == pytest.approx(120.0 + 30.0)
    assert estimate("partial", done) == pytest.approx(140.0 + 30.0)
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
            out = tmp_path / f"{device}-{mode}"
            flags = launch_flags(plan, mode, 0, base=tiny_model, prompts=prompts, heldout=prompts, out=out)
            # Checkpoints to evaluate after the run, every one kept, and no evaluation inside it.
            assert flags[flags.index("--save-interval") + 1] == str(plan.eval_every)
            assert flags[flags.index("--save-keep-last") + 1] == "0" and "--eval-interval" not in flags
            # Every version kept for the refinement, colocated ones too (their folders written for it);
            # a rule refusing it beside --colocate would be a second problem below.
            assert "--save-keep-weights" in flags
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
            assert config.rollout.eval_prompt_data == ("heldout", str(prompts))
            assert config.rollout.eval_interval is None and config.output.save_keep_last == 0
            # OPSM: on by default in partial and async, off in sync and in the diagnostic modes.
            off_policy = mode.startswith("async") or "partial" in mode
            assert config.trainer.use_opsm == (off_policy and not mode.endswith("-no-opsm"))
            assert config.trainer.opsm_against == ("proximal" if mode.endswith("-opsm-proximal") else "current")


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
            "perf/save_model_time": 0.1 if i != 1 else 0.3,
            "checkpoint/step": -1 if i == 0 else 1,  # the newest checkpoint: step 1's
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
    assert rec["save_seconds"] == [0.1, 0.3, 0.1] and rec["checkpoint"] == [False, True, False]
    # The resumed sample's length is its last request's prefix plus tokens: 12 for the count 12.
    assert rec["length_corr"] == pytest.approx(1.0)
    assert math.isnan(length_correlation(tmp_path / "absent.jsonl", [1]))


def test_a_runs_evaluation_is_read_from_its_eval_log(tmp_path: Path) -> None:
    # pipeline.eval's lines (pipeline/evaluation.py), one an evaluation of weights not asked for.
    lines = [
        {"step": 0, "version": 0, EVAL_KEY: 0.25, f"{EVAL_KEY}/samples": 8.0},
        {"step": 1, "version": 2, EVAL_KEY: 0.5},
        {"step": 2, "version": 3, EVAL_KEY: 0.9},
        {"step": 3, "version": 4, EVAL_KEY: 0.75},
    ]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    rec = {"step_seconds": [2.0] * 4, "save_seconds": [0.1, 0.5, 0.1, 0.7], "checkpoint": [False, True, False, True]}
    ev = read_evaluation(tmp_path, rec, [0, 2, 4], EVAL_KEY)
    assert ev == {"version": [0, 2, 4], "reward": [0.25, 0.5, 0.75], "seconds": pytest.approx([0.0, 3.6, 7.0])}
    # A colocated run's record: its folders were written for the evaluation alone, every save left out.
    colocated = read_evaluation(tmp_path, {**rec, "saves_for_eval": True}, [0, 2, 4], EVAL_KEY)
    assert colocated["seconds"] == pytest.approx([0.0, 3.4, 6.6])
    with pytest.raises(RuntimeError, match=r"no eval/heldout for versions \[1\] \(evaluated: \[0, 2, 3, 4\]\)"):
        read_evaluation(tmp_path, rec, [0, 1], EVAL_KEY)
    # Time to target at version 4's seconds, the checkpoints' extra seconds left out: 7.0, not 8.0.
    fig = figures({**_run("sync", 0, [0.1] * 4, rec["step_seconds"]), "eval": ev}, target=0.7, smooth=1)
    assert fig.time_to_target == pytest.approx(7.0) and fig.steps_to_target == 4


def test_a_folder_of_runs_without_an_evaluation_is_refused_but_still_summarized(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.time_to_target import main

    # An H200 folder of the first runs: runs.jsonl carried without its state.json (gpu_check.sh).
    old = [_run("sync", 0, [0.57, 0.8, 0.87, 0.87], [4.0] * 4), _run("async", 0, [0.9, 0.9, 0.87, 0.87], [2.0] * 4)]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    with pytest.raises(SystemExit, match=r"runs \['sync-s0', 'async-s0'\] have no held-out evaluation"):
        main(["--quick", "--out", str(tmp_path)])
    assert not (tmp_path / "work").exists()  # refused before anything was built
    state = {"plan": dataclasses.asdict(PRESETS["h200"]), "target": {"spec": "0.8x", "value": 0.696, "plateau": 0.87}}
    del state["plan"]["smooth_eval"]  # a state.json of before the evaluation
    (tmp_path / "state.json").write_text(json.dumps(state))
    assert main(["--summarize", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # Judged by the batch reward, as before: async reaches 0.696 at its first step, 2 s against 12 s.
    assert (
        "judged by the trained-batch reward" in out and "| async | 1/1 | 2.0 ± 0.0 | 0.17 (0.17 by seed) | 1.0 |" in out
    )


def test_a_folder_of_runs_judged_on_the_grid_alone_is_refused(tmp_path: Path) -> None:
    from benchmarks.time_to_target import main

    # The H200's first seven runs of lr 1e-4: evaluated, but made before the runs kept their
    # weights, so their crossings are the grid's; new runs would read theirs to the step.
    ev = {"version": [0, 2], "reward": [0.5, 0.9], "seconds": [0.0, 8.0]}
    (tmp_path / "runs.jsonl").write_text(json.dumps(_run("sync", 0, [0.5, 0.7], [4.0] * 2, eval=ev)) + "\n")
    with pytest.raises(SystemExit, match=r"runs \['sync-s0'\] read their crossing off the evaluation grid alone"):
        main(["--quick", "--out", str(tmp_path)])
    assert not (tmp_path / "work").exists()


def test_a_folder_timed_on_one_card_refuses_runs_on_another(tmp_path: Path) -> None:
    from benchmarks.time_to_target import main, mixed_cards

    # A set carried from call to call may find the next call on another kind of card (the device
    # tool lends an H100 or an H200): its times would not compare, so nothing is added.
    ev, refined = {"version": [0], "reward": [0.5]}, {"version": [], "reward": [], "seconds": []}
    h200 = [_run("sync", 0, [0.5, 0.7], [4.0] * 2, card="NVIDIA H200", eval=ev, eval_refined=refined)]
    assert mixed_cards("NVIDIA H200", {"card": "NVIDIA H200"}, h200) is None
    assert mixed_cards("cpu", {}, []) is None
    why = mixed_cards("NVIDIA H100 80GB HBM3", {}, h200)  # runs.jsonl carried without state.json
    assert why is not None and "NVIDIA H200" in why and "NVIDIA H100 80GB HBM3" in why
    (tmp_path / "runs.jsonl").write_text(json.dumps(h200[0]) + "\n")
    with pytest.raises(SystemExit, match=r"timed on NVIDIA H200 and this call runs on cpu"):
        main(["--quick", "--out", str(tmp_path)])
    assert not (tmp_path / "work").exists()  # refused before anything was built


def test_a_set_timed_on_several_machines_says_which_runs_shared_one() -> None:
    """Two machines with the same card differ by more than the modes do (an H100 set's second
    machine ran every mode 14-24% slower): the report names each machine's runs, so a ratio read
    across machines is known as one. One machine, or none recorded, says nothing."""
    from benchmarks.time_to_target import machine_name, machines_said

    assert machine_name("cpu") and " " not in machine_name("cpu")  # the host alone off a GPU
    first = [_run(m, s, [0.5, 0.7], [4.0] * 2, machine="a GPU-1") for s in (0, 1) for m in ("sync", "async")]
    assert machines_said(first) is None
    assert machines_said([_run("sync", 0, [0.5], [4.0])]) is None
    later = [
        _run("sync", 2, [0.5, 0.7], [4.0] * 2, machine="b GPU-2"),
        _run("async", 2, [0.5], [4.0], machine="b GPU-2"),
    ]
    said = machines_said(first + later)
    assert said is not None and said.startswith("timed on 2 machines")
    assert "[sync-s0, async-s0, sync-s1, async-s1]; [sync-s2, async-s2]" in said
    # Records from before machines were kept stand apart, said to be not recorded: they may
    # have spanned several machines, so they are not counted as one.
    old = machines_said([_run("sync", 0, [0.5], [4.0]), _run("sync", 1, [0.5], [4.0]), *later])
    assert old is not None and old.startswith("timed on 1 machine of the card and before machines were recorded")
    assert "[sync-s2, async-s2]; not recorded, one machine or more: [sync-s0, sync-s1]" in old


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


def test_the_cluster_twin_takes_the_tables_steps_to_target(tmp_path: Path) -> None:
    from benchmarks.cluster_twin import _learning_runs, predict, steps_to_target

    runs = [
        _run("sync", 0, [0.1, 0.5, 0.7, 0.9], [1.0] * 4),  # reaches 0.6 at step 3
        _run("sync", 1, [0.1, 0.3, 0.5, 0.7], [1.0] * 4),  # at step 4
        _run("async", 0, [0.2, 0.2, 0.2, 0.2], [1.0] * 4),
        _run("sync", 100, [0.9] * 4, [1.0] * 4, calibration=True),  # not a compared seed
    ]
    assert steps_to_target(runs, 0.6, smooth=1) == {"sync": (3.5, 2, 2), "async": (None, 0, 1)}
    # Trailing means over 2 steps: seed 0's 0.1, 0.3, 0.6, 0.8; seed 1's 0.1, 0.2, 0.4, 0.6 never reach 0.65.
    assert steps_to_target(runs, 0.65, smooth=2) == {"sync": (4.0, 1, 2), "async": (None, 0, 1)}
    rows = summarize(runs, 0.6, smooth=1)
    assert next(r for r in rows if r["mode"] == "sync")["steps_to_target"] == 3.5  # the table's figure
    assert predict(100.0, 20.0, 1) == 100.0 and predict(100.0, 20.0, 4) == 160.0
    assert predict(100.0, 20.0, 0) == 0.0  # the base weights reach it
    # Runs with an evaluation: each seed's first evaluated version to reach it, refined between the
    # grid's points where the run kept its weights.
    evaluated = [
        _evaluated("sync", 0, [0.9] * 4, [1.0] * 4, {"reward": [0.2, 0.5, 0.8], "seconds": [0, 2, 4]}),
        _evaluated("sync", 1, [0.9] * 4, [1.0] * 4, {"reward": [0.2, 0.7, 0.8], "seconds": [0, 2, 4]}),
    ]
    assert steps_to_target(evaluated, 0.6, smooth=1) == {"sync": (3.0, 2, 2)}  # versions 4 and 2
    assert steps_to_target(evaluated, 0.6, smooth=1, smooth_eval=2) == {"sync": (4.0, 2, 2)}
    evaluated[0]["eval_refined"] = {"version": [3], "reward": [0.65], "seconds": [3.0]}
    assert steps_to_target(evaluated, 0.6, smooth=1) == {"sync": (2.5, 2, 2)}  # versions 3 and 2
    # learning.py's runs.jsonl: one task's runs, by --task.
    path = tmp_path / "runs.jsonl"
    lines = [{**_run("sync", 0, [0.1], [1.0]), "task": t} for t in ("toy", "long-tail")]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [r["task"] for r in _learning_runs(path, "long-tail")] == ["long-tail"]
    assert [r["task"] for r in _learning_runs(path, None)] == ["long-tail"]  # the first, sorted
    with pytest.raises(SystemExit, match="--task 'math'"):
        _learning_runs(path, "math")


# ---- end to end ------------------------------------------------------------------------------------


def test_evaluations_side_by_side_report_the_groups_that_failed(tmp_path: Path) -> None:
    from benchmarks.target_eval import _eval_side_by_side

    # A stand-in for `python -m pipeline.eval`: fails when asked for version 3.
    cmd = [sys.executable, "-c", "import sys; print('to stderr', file=sys.stderr); sys.exit('3' in sys.argv)"]
    failed = _eval_side_by_side([(cmd, [0, 2]), (cmd, [1, 3])], tmp_path, cwd=tmp_path, env=dict(os.environ))
    assert [group for (_, group), _ in failed] == [[1, 3]]
    assert "to stderr" in failed[0][1]
    assert _eval_side_by_side([(cmd, [0]), (cmd, [1])], tmp_path, cwd=tmp_path, env=dict(os.environ)) == []


def test_an_evaluations_rounds_are_said_with_their_decode() -> None:
    from benchmarks.target_run import eval_said

    grid = {"versions": 11, "seconds": 61.6, "workers": 3, "decode": [4.0, 4.2, None]}
    refined = {"versions": 3, "seconds": 35.2, "workers": 3, "decode": [None] * 3}
    assert (
        eval_said([grid, refined])
        == "11 versions in 62 s, 3 side by side, decoding 4.1 s each; 3 versions in 35 s, 3 side by side"
    )  # records from before the loads and starts were kept
    assert eval_said([]) == ""  # a record made before the rounds were kept
    grid |= {"load": [0.2, 0.4, None], "starts": [12.2, 14.4, 13.0]}
    refined |= {"load": [None] * 3, "starts": [11.9, 12.1]}
    assert eval_said([grid, refined]) == (
        "11 versions in 62 s, 3 side by side, decoding 4.1 s each, loading 0.3 s each, engines up in 12-14 s; "
        "3 versions in 35 s, 3 side by side, engines up in 12 s"
    )
    refined["rest"] = 6.4
    assert eval_said([refined]).endswith("engines up in 12 s, 6 s besides (the workers' start, engines' stop)")
    # Engines both rounds shared: said once, first; a round's own start (opening them) is not said.
    assert eval_said([refined], engines_up=10.6) == (
        "engines up once in 11 s; 3 versions in 35 s, 3 side by side, 6 s besides (the workers' start)"
    )


def test_an_evaluation_starts_no_engines_of_its_own_beside_the_users(tmp_path: Path) -> None:
    """Flags that name the user's engines (or real SGLang) leave each round to open those itself."""
    from benchmarks.target_eval import eval_engines, evaluate_on_engines

    flags = ["--output-dir", str(tmp_path / "run"), "--sglang-url", "http://127.0.0.1:9"]
    with eval_engines(flags, 2, tmp_path / "logs") as urls:
        assert urls == []
    assert not (tmp_path / "logs").exists()
    with pytest.raises(ValueError, match="no engine URLs"):
        evaluate_on_engines(flags, [0, 1], tmp_path, urls)


def test_an_in_process_worker_that_fails_names_the_error_and_its_log(tmp_path: Path) -> None:
    """The workers on shared engines run in the benchmark's process: one that fails (here, a
    folder that is no run) fails the evaluation with its own error and where its lines went."""
    from benchmarks.target_eval import evaluate_on_engines

    flags = ["--output-dir", str(tmp_path / "no-run")]
    with pytest.raises(
        RuntimeError, match=r"the evaluation of .* failed \(its log: .*eval-workers.log\).*no model folder"
    ):
        evaluate_on_engines(flags, [0, 1], tmp_path, ["http://127.0.0.1:9", "http://127.0.0.1:10"])


def test_a_rounds_rest_is_what_its_slowest_worker_did_not_spend_on_its_engine() -> None:
    """Worker i gets versions i, i + workers, ...; the round lasts as its slowest worker."""
    from benchmarks.target_run import round_rest

    decode = [4.0, 5.0, 6.0, 4.0, 5.0]  # worker 0: versions 0, 2, 4; worker 1: 1, 3
    load = [0.5] * 5
    starts = [10.0, 12.0, None, None, None]  # on each worker's first line
    # Worker 0: 10 + 15 + 1.5 = 26.5; worker 1: 12 + 9 + 1 = 22: the rest of 30 s is 3.5.
    assert round_rest(30.0, 2, decode, load, starts) == pytest.approx(3.5)
    assert round_rest(30.0, 2, [None, *decode[1:]], load, starts) is None  # a version without its figure
    assert round_rest(30.0, 2, decode, load, [10.0, None, None, None, None]) is None


@pytest.mark.slow
def test_a_run_keeps_its_weights_folders_and_any_kept_version_is_evaluated(tmp_path: Path) -> None:
    """`--save-keep-weights` in a real launcher run: every weights-only folder between the
    checkpoints stays, and the evaluation reads any of them (what a refinement asks for)."""
    import subprocess

    from benchmarks.target_eval import grid_versions, kept_versions, read_evaluation, version_seconds
    from benchmarks.target_run import REPO, evaluate_run, run_env
    from benchmarks.time_to_target import _prepare

    plan = PRESETS["quick"]
    inputs = _prepare(plan, tmp_path / "work", {})
    out = tmp_path / "run"
    flags = launch_flags(plan, "sync", 0, base=inputs.base, prompts=inputs.prompts, heldout=inputs.heldout, out=out)
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.launch", *flags], cwd=REPO, env=run_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    grid = list(range(0, plan.steps + 1, plan.eval_every))
    assert grid_versions(out) == grid
    assert kept_versions(out) == [v for v in range(1, plan.steps + 1) if v not in grid]  # v1, v3, v5
    rec = record(out, "sync", 0, plan, inputs.counts, wall=0.0, calibration=False)
    versions, seconds = evaluate_run(plan, 0, inputs, out, [], workers=2, versions=[1, 3])
    ev = read_evaluation(out, rec, versions, EVAL_KEY)
    assert ev["version"] == [1, 3] and all(0.0 <= r <= 1.0 for r in ev["reward"]) and seconds > 0
    assert 0.0 < ev["seconds"][0] < ev["seconds"][1]
    # Each version's own decode, from the evaluation's lines in the run's metrics.jsonl.
    decode = version_seconds(out, [1, 3, 2])
    assert all(0.0 < d < seconds for d in decode[:2]) and math.isnan(decode[2])  # v2 was not evaluated
    assert evaluate_run(plan, 0, inputs, out, [], versions=[]) == ([], 0.0)  # nothing to refine


@pytest.mark.slow
def test_the_quick_call_evaluates_every_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--quick`: every CPU mode's launcher run, then `python -m pipeline.eval` of its checkpoints,
    two side by side (each version still scored once, on the same prompts)."""
    from benchmarks.target_run import run_name
    from benchmarks.time_to_target import default_modes, main

    plan = PRESETS["quick"]
    assert main(["--quick", "--out", str(tmp_path), "--eval-workers", "2"]) == 0, capsys.readouterr().out[-3000:]
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in runs] == default_modes(gpu=False)  # the set's, none of the diagnostic ones
    last = list(range(0, plan.steps + 1, plan.eval_every))
    for run in runs:
        ev = run["eval"]
        assert ev["version"] == last and ev["version"][-1] == plan.steps  # the base weights, then each checkpoint
        assert all(0.0 <= r <= 1.0 for r in ev["reward"]) and run["eval_seconds"] > 0
        # At the steps' wall seconds, less the checkpoints' extra ones: no more than the steps took.
        assert ev["seconds"][0] == 0.0 and ev["seconds"] == sorted(ev["seconds"])
        assert ev["seconds"][-1] <= sum(run["step_seconds"]) and sum(run["checkpoint"]) == len(last) - 1
        # What the corrections did, per step: OPSM is off in sync (the default) and so drops nothing.
        assert len(run["opsm_dropped"]) == len(run["logprob_diff"]) == len(run["reward"])
        assert all(0.0 <= d <= 1.0 for d in run["opsm_dropped"]) and all(d >= 0.0 for d in run["logprob_diff"])
        if run["mode"] == "sync":
            assert not any(run["opsm_dropped"])
        # Where the evaluation's seconds went: the grid's round, the refinement's where it had one.
        grid_round, *refined_round = run["eval_phases"]
        assert (grid_round["versions"], grid_round["workers"]) == (len(last), 2)
        assert all(0.0 < d < grid_round["seconds"] for d in grid_round["decode"])
        assert all(0.0 < d < grid_round["seconds"] for d in grid_round["load"])
        # Both rounds use the engines started once for the run's evaluation: opening them is quick.
        assert 0.0 < run["eval_engines_up"] < run["eval_seconds"]
        assert len(grid_round["starts"]) == 2 and all(0.0 < d < run["eval_engines_up"] for d in grid_round["starts"])
        assert 0.0 <= grid_round["rest"] < grid_round["seconds"]  # the workers' set-up: in this process, no start
        printed = (tmp_path / "work" / "runs" / run_name(run["mode"], run["seed"]) / "eval-workers.log").read_text()
        assert "v0 (step 0)" in printed  # the in-process workers' lines, in the run's folder
        assert [r["versions"] for r in refined_round] == (
            [len(run["eval_refined"]["version"])] if run["eval_refined"]["version"] else []
        )
        rounds = sum(r["seconds"] for r in run["eval_phases"])
        assert rounds + run["eval_engines_up"] <= run["eval_seconds"] < rounds + run["eval_engines_up"] + 30
    # The evaluation set is the same for every run: the base weights score alike everywhere.
    assert len({r["eval"]["reward"][0] for r in runs}) == 1
    state = json.loads((tmp_path / "state.json").read_text())
    sync = runs[0]["eval"]["reward"]
    assert state["target"]["spec"] == "0.8r" and state["target"]["start"] == pytest.approx(sync[0])
    assert state["target"]["value"] == pytest.approx(sync[0] + 0.8 * (sync[-1] - sync[0]))  # one version a quarter
    target = state["target"]["value"]
    for run in runs:
        # Where the grid crossed the target after its start, the kept step between went too (6 steps,
        # a checkpoint every 2: one step between two evaluations).
        hit = next(i for i, r in enumerate(run["eval"]["reward"] + [math.inf]) if r >= target)
        between = [v for v in range(1, plan.steps) if 0 < hit < len(last) and last[hit - 1] < v < last[hit]]
        assert run["eval_refined"]["version"] == between
        run_dir = tmp_path / "work" / "runs" / f"{run['mode']}-s{run['seed']}"
        evaluated = [json.loads(line)["version"] for line in (run_dir / "eval.jsonl").read_text().splitlines()]
        assert sorted(evaluated) == sorted(last + between)  # one line per version, none twice
    summary = (tmp_path / "summary.md").read_text()
    assert "judged by the held-out reward (8 prompts" in summary and "trained-batch last-quarter reward" in summary


def test_prepare_only_builds_the_base_model_and_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--prepare-only`: the base model's minutes as a device call of their own; its fingerprint goes
    into state.json (a base built again later is checked against it), and no run is made."""
    from benchmarks.base_model import fingerprint
    from benchmarks.time_to_target import main

    assert main(["--quick", "--out", str(tmp_path), "--prepare-only"]) == 0
    state = json.loads((tmp_path / "state.json").read_text())
    base = tmp_path / "work" / "base"
    assert state["base"]["fingerprint"] == fingerprint(base)
    assert "target" not in state and not (tmp_path / "runs.jsonl").exists()
    assert not (tmp_path / "work" / "runs").exists()
    assert state["base"]["fingerprint"][:12] in capsys.readouterr().out
    # A base that differs from the one state.json names: taken where no run used the other,
    # refused where runs did (their target and start were read from theirs).
    from benchmarks.time_to_target import _prepare

    other = {**state, "base": {**state["base"], "fingerprint": "f" * 64}}
    with pytest.raises(SystemExit, match="differs from the one this folder's 2 run"):
        _prepare(PRESETS["quick"], tmp_path / "work", dict(other), runs=2)
    taken = dict(other)
    _prepare(PRESETS["quick"], tmp_path / "work", taken, runs=0)
    assert taken["base"]["fingerprint"] == fingerprint(base)


def test_the_base_models_packed_batch_has_the_padded_batchs_loss(tmp_path: Path) -> None:
    """The base model's supervised batch, packed end to end, scores each answer token as the
    right-padded batch does: the same mean loss (fp32, CPU), and no prompt or next-sample token."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.base_model import _packed_batch, answer_loss
    from pipeline.tasks.tiny_model import PAD_ID, make_model_folder
    from trainers.packed_attention import packed

    rng = random.Random(3)
    rows = [
        ([rng.randrange(3, 30) for _ in range(rng.randint(3, 9))], [rng.randrange(3, 30)] * n) for n in (1, 40, 7, 13)
    ]
    model = AutoModelForCausalLM.from_pretrained(make_model_folder(tmp_path / "m", seed=2), dtype=torch.float32)
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for j, (prompt, answer) in enumerate(rows):
        ids[j, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[j, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
    padded = model(input_ids=ids, labels=labels, use_cache=False).loss
    packed_ids, packed_labels, layout = _packed_batch(rows)
    assert int((packed_labels != -100).sum()) == sum(len(a) for _, a in rows)
    with packed(model, layout) as arguments:
        out = model(input_ids=packed_ids, labels=packed_labels, use_cache=False, **arguments)
    torch.testing.assert_close(out.loss, padded, rtol=1e-5, atol=1e-6)
    # The build's own loss (one-hot, for deterministic kernels) is the model's.
    torch.testing.assert_close(answer_loss(out.logits, packed_labels), padded, rtol=1e-5, atol=1e-6)

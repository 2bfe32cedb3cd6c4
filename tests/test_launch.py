"""`python -m pipeline.launch` end to end: built-in engine(s) over real HTTP, the real trainer,
memory and LMDB state, the real sglang-router for two engines, and resuming a stopped run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.run.cli import main
from storage import GroupState, LmdbStore


def run(tmp_path: Path, *flags: str) -> list[dict]:
    out = tmp_path / "run"
    code = main(["--output-dir", str(out), "--no-progress", "--log-level", "warning", *flags])
    assert code == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_default_task_learns_in_sync_mode(tmp_path):
    records = run(tmp_path, "--num-rollout", "40")
    assert [r["version"] for r in records] == list(range(40))
    first = sum(r["rollout/raw_reward"] for r in records[:5]) / 5
    last = sum(r["rollout/raw_reward"] for r in records[-5:]) / 5
    assert last > first + 0.1, (first, last)
    # the trainer recomputes what the engine sampled: same model, same log-probs
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < 1e-3
    # The save is part of the training time, reported apart (slime's name beside ours).
    assert all(0 < r["perf/save_model_time"] <= r["perf/train_time"] for r in records)


def test_partial_rollout_on_lmdb_keeps_every_group(tmp_path):
    records = run(
        tmp_path,
        "--num-rollout",
        "6",
        "--partial-rollout",
        "--over-sampling-batch-size",
        "16",
        "--rollout-max-response-len",
        "128",
        "--rollout-data-transport",
        "lmdb",
    )
    assert len(records) == 6
    assert records[-1]["groups/partial_total"] > 0, "over-sampling never left a partial group"
    with LmdbStore(tmp_path / "run" / "rollout_data", readonly=True) as store:
        counts = {s: store.count(s) for s in GroupState}
        assert counts[GroupState.TRAINED] == 6 * 8
        assert counts[GroupState.RUNNING] == 0
        # every prompt the cursor handed out is somewhere in the store, exactly once
        assert sum(counts.values()) == store.cursor().index
        trained = [g.group_id for step in range(6) for g in store.batch(step).groups]
        assert len(trained) == len(set(trained))


def test_two_engines_behind_the_real_router(tmp_path):
    records = run(tmp_path, "--num-rollout", "3", "--rollout-num-engines", "2", "--rollout-batch-size", "4")
    assert [r["version"] for r in records] == [0, 1, 2]


def test_a_stopped_lmdb_run_resumes_where_it_stopped(tmp_path):
    flags = ("--rollout-data-transport", "lmdb", "--partial-rollout", "--rollout-max-response-len", "128")
    first = run(tmp_path, "--num-rollout", "3", *flags)
    assert [r["step"] for r in first] == [0, 1, 2]
    second = run(tmp_path, "--num-rollout", "5", *flags)  # appends to the same metrics file
    assert [r["step"] for r in second] == [0, 1, 2, 3, 4]
    assert [r["version"] for r in second[3:]] == [3, 4]  # resumed from the saved weights of version 3
    with LmdbStore(tmp_path / "run" / "rollout_data", readonly=True) as store:
        trained = [g.group_id for step in range(5) for g in store.batch(step).groups]
        assert len(trained) == len(set(trained)) == 5 * 8


def test_an_incompatible_restart_is_refused_with_the_difference(tmp_path, capsys):
    run(tmp_path, "--num-rollout", "1", "--rollout-data-transport", "lmdb")
    out = tmp_path / "run"
    code = main(
        [
            "--output-dir",
            str(out),
            "--no-progress",
            "--rollout-data-transport",
            "lmdb",
            "--num-rollout",
            "2",
            "--n-samples-per-prompt",
            "4",
        ]
    )
    assert code == 1
    assert "n_samples_per_prompt" in capsys.readouterr().err


def test_config_errors_are_listed_together(capsys):
    code = main(
        ["--rollout-batch-size", "0", "--rollout-temperature", "-1", "--rollout-mode", "async", "--eval-interval", "5"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "--rollout-batch-size" in err and "--rollout-temperature" in err and "inline evaluation" in err


def test_async_mode_learns_and_reports_staleness(tmp_path):
    # A staleness bound keeps this small, fast-moving policy stable; without one the tiny model's
    # response length can spike mid-run before it recovers (see docs/modes.md, staleness).
    records = run(tmp_path, "--num-rollout", "40", "--rollout-mode", "async", "--max-staleness", "1")
    first = sum(r["rollout/raw_reward"] for r in records[:5]) / 5
    last = sum(r["rollout/raw_reward"] for r in records[-5:]) / 5
    assert last > first + 0.08, (first, last)
    # generation ran ahead of training: some groups were trained versions after they started
    assert max(r["staleness/max"] for r in records) >= 1
    assert any(r["staleness/multi_version_frac"] > 0 for r in records)


def short_answer_reward(task, sample):
    """A user reward: 1 for an answer that stops within the label's length."""
    return float(sample.status.value == "completed" and sample.response_len <= int(task.label))


def test_bring_your_own_prompts_and_reward(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"answer in {n} letters:", "label": n}) + "\n" for n in range(1, 9))
    )
    records = run(
        tmp_path,
        "--num-rollout",
        "3",
        "--prompt-data",
        str(prompts),
        "--custom-rm-path",
        "tests.test_launch:short_answer_reward",
        "--rollout-batch-size",
        "4",
    )
    assert len(records) == 3
    assert all(0.0 <= r["rollout/raw_reward"] <= 1.0 for r in records)


def test_prompts_that_all_fail_stop_the_run_naming_the_error(tmp_path, capsys):
    # Every prompt is longer than the built-in model's 512-position context, so the engine refuses
    # each request (HTTP 400) and every group fails. Before, the run admitted the dataset again and
    # again, epoch after epoch, without a word and without end.
    prompts = tmp_path / "long.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "a" * 600, "label": n}) + "\n" for n in range(3)))
    flags = ["--prompt-data", str(prompts), "--custom-rm-path", "tests.test_launch:short_answer_reward"]
    flags += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4"]
    flags += ["--rollout-data-transport", "lmdb"]
    code = main(["--output-dir", str(tmp_path / "run"), "--no-progress", "--num-rollout", "1", *flags])
    assert code == 1
    err = capsys.readouterr().err
    assert "error: the last 64 groups all failed" in err and "maximum context length of 512" in err
    assert "Traceback" not in err
    with LmdbStore(tmp_path / "run" / "rollout_data", readonly=True) as store:
        # each kept with its error; a group still in flight when the run stopped stays RUNNING,
        # as after any error exit, and the next start recovers it
        assert store.count(GroupState.FAILED) >= 64
        assert store.count(GroupState.TRAINED) == 0


def test_another_run_in_the_output_dir_of_an_lmdb_run_is_refused_and_changes_nothing(tmp_path, capsys):
    small = ("--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4")
    lmdb = ("--rollout-data-transport", "lmdb")
    run(tmp_path, "--num-rollout", "1", *small, *lmdb)
    out = tmp_path / "run"
    checkpoint = (out / "checkpoints" / "v1" / "model.safetensors").read_bytes()
    metrics = (out / "metrics.jsonl").read_text()
    # A memory run (or an LMDB run on another store) in the same folder would write weights/v1..
    # over the checkpoints the store counts as trained, and a resume would load them unknowingly.
    for other in ((), (*lmdb, "--rollout-data-dir", str(tmp_path / "elsewhere"))):
        code = main(["--output-dir", str(out), "--no-progress", "--num-rollout", "1", "--lr", "0.1", *small, *other])
        assert code == 2  # refused when the run folder is claimed, before anything is written
        err = capsys.readouterr().err
        assert f"{out / 'rollout_data'}" in err and "--output-dir" in err and "Traceback" not in err
    assert (out / "checkpoints" / "v1" / "model.safetensors").read_bytes() == checkpoint
    assert (out / "metrics.jsonl").read_text() == metrics
    assert [r["step"] for r in run(tmp_path, "--num-rollout", "2", *small, *lmdb)] == [0, 1]  # still resumes


def test_zero_steps_sets_up_the_run_and_trains_nothing(tmp_path, capsys):
    # `--num-rollout 0`: the model folder, the store and the engine come up, nothing is trained
    # (a smoke test of a setup before a long run; a resumed run asked for fewer steps than it has
    # trained ends the same way).
    out = tmp_path / "run"
    code = main(["--output-dir", str(out), "--no-progress", "--num-rollout", "0", "--rollout-data-transport", "lmdb"])
    assert code == 0
    assert "nothing to do: the run has trained all of its --num-rollout=0 steps" in capsys.readouterr().out
    assert (out / "model" / "config.json").exists() and not (out / "metrics.jsonl").read_text()
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        assert store.trained_step() == -1 and store.count(GroupState.TRAINED) == 0


@pytest.mark.parametrize("flag", ["--output-dir", "--metrics-file"])
def test_an_output_path_that_cannot_be_made_is_one_error_line(tmp_path, capsys, flag):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    where = blocker / "run"
    # before any engine starts (the metrics file used to fail only after start-up, with a traceback)
    paths = {"--output-dir": str(tmp_path / "run"), flag: str(where)}
    code = main([*(x for kv in paths.items() for x in kv), "--no-progress", "--num-rollout", "0"])
    assert code == 2  # a config error, as those found when the config loads
    err = capsys.readouterr().err
    assert f"{flag}={where}: cannot be created" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "model").exists()


def test_a_memory_run_says_it_keeps_nothing_to_resume_from():
    """Issue 30: a stopped memory run used to say "run the same command again to resume" and then
    start at step 0."""
    from pipeline.config import load_config
    from pipeline.run.folder import resume_hint as _resume_hint

    memory = _resume_hint(load_config(["--rollout-data-transport", "memory"]))
    assert "keeps no rollout state" in memory and "step 0" in memory and "to resume" not in memory.split("(")[0]
    assert "run the same command again to resume" in _resume_hint(load_config(["--rollout-data-transport", "lmdb"]))

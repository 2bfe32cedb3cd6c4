"""Conveniences every peer has (issue 33, item 5): the end-of-run line, plain progress lines off a
terminal, learning curves as a PNG, the resolved config printed and saved, `--version`, TOML keys
spelled as the flags, and group ids found from `replay`. End to end with the built-in engine."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from pipeline import plot, replay
from pipeline.config import load_config
from pipeline.run.cli import main

SMALL = ("--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4")
SMALL += ("--num-prompts", "16", "--num-rollout", "2")


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    out = tmp_path_factory.mktemp("conv") / "run"
    # capsys is per test; one run serves the module, so it is captured by hand.
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        assert main(["--output-dir", str(out), *SMALL]) == 0  # --progress is on by default
    return out, stdout.getvalue(), stderr.getvalue()


def test_the_run_ends_with_one_line_saying_where_and_how_fast(memory_run):
    out, stdout, _ = memory_run
    line = stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"run {re.escape(str(out))}: 2 steps in \d+ s \([\d.]+ samples/s, \d+ tokens/s\); metrics in "
        rf"{re.escape(str(out / 'metrics.jsonl'))} \(python -m pipeline.plot {re.escape(str(out))} draws them\)",
        line,
    ), line


def test_progress_off_a_terminal_is_plain_lines(memory_run):
    _, stdout, stderr = memory_run
    assert "\r" not in stderr  # no bar redrawn into a log file
    assert len([line for line in stdout.splitlines() if "] step " in line]) == 2


def test_plot_draws_the_learning_curves_of_a_memory_run(memory_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, _, _ = memory_run
    assert plot.main([str(out), "-o", str(tmp_path / "c.png"), "--key", "train/entropy"]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    said = capsys.readouterr().out
    for key in (
        "rollout/raw_reward",
        "rollout/response_len/mean",
        "staleness/mean",
        "train/approx_kl_k3",
        "train/entropy",
    ):
        assert key in said


def test_plot_names_a_folder_without_metrics(tmp_path, capsys):
    assert plot.main([str(tmp_path)]) == 2
    assert "no metrics file" in capsys.readouterr().err


def test_the_resolved_config_is_saved_printed_and_loads_back(memory_run, tmp_path, capsys):
    out, _, _ = memory_run
    saved = json.loads((out / "config.json").read_text())
    assert saved["rollout"]["rollout_batch_size"] == 2 and saved["rollout"]["over_sampling_batch_size"] == 2
    assert main(["--print-config", "--rollout-batch-size", "3", "--output-dir", str(tmp_path / "x")]) == 0
    toml = capsys.readouterr().out
    assert "rollout-batch-size = 3" in toml and "over-sampling-batch-size = 3" in toml
    (tmp_path / "run.toml").write_text(toml)
    again = load_config(["--config", str(tmp_path / "run.toml")])
    assert again == load_config(["--rollout-batch-size", "3", "--output-dir", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()  # printing runs nothing


def test_toml_keys_may_be_spelled_as_the_flags(tmp_path):
    (tmp_path / "run.toml").write_text('[rollout]\nrollout-batch-size = 4\nnum-rollout = 7\n[output]\nsave = "o"\n')
    config = load_config(["--config", str(tmp_path / "run.toml")])
    assert (config.rollout.rollout_batch_size, config.rollout.num_rollout) == (4, 7)
    assert config.output.dir == Path("o")


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and re.fullmatch(r"rollout-pipeline \S+\n", capsys.readouterr().out)


def test_replay_lists_groups_and_finds_a_prompts_groups(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--output-dir", str(out), "--no-progress", *SMALL, "--rollout-data-transport", "lmdb"]) == 0
    capsys.readouterr()
    assert replay.main([str(out), "groups", "--state", "trained"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[-1] == "4 groups" and all(" trained " in line for line in listed[1:-1])
    first = listed[1].split()
    assert replay.main([str(out), "group", first[2]]) == 0  # by the prompt's row number
    assert first[0] in capsys.readouterr().out
    if plot_available():  # an LMDB run's curves, as a memory run's
        assert plot.main([str(out)]) == 0 and (out / "curves.png").exists()


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True

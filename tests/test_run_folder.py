"""One run, one folder (issue 33): the README's commands, run one after another in one working
directory, never write into each other's folders; an LMDB run's same command still resumes it.
End to end through `pipeline.run.cli.main` with the built-in engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.run.cli import main

SMALL = ("--no-progress", "--log-level", "warning", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2")
SMALL += ("--rollout-max-response-len", "4", "--num-prompts", "16")


def steps(folder: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_memory_runs_without_an_output_dir_each_get_a_fresh_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*SMALL, "--num-rollout", "1"]) == 0
    assert main([*SMALL, "--num-rollout", "2", "--partial-rollout"]) == 0
    folders = sorted(p for p in (tmp_path / "runs").iterdir() if p.name != "latest")
    # Before: both wrote into runs/default (weights, events and metrics of two runs mixed).
    assert len(folders) == 2 and all(p.name.startswith("default-") for p in folders)
    assert sorted(steps(p) for p in folders) == [[0], [0, 1]]
    for folder in folders:
        run = json.loads((folder / "run.json").read_text())
        assert run["transport"] == "memory" and run["store"] is None
        config = json.loads((folder / "config.json").read_text())
        assert config["rollout"]["partial_rollout"] == (steps(folder) == [0, 1])
    assert (tmp_path / "runs" / "latest").resolve() in {p.resolve() for p in folders}
    assert steps(tmp_path / "runs" / "latest") == [0, 1]


def test_a_new_run_in_a_memory_runs_folder_is_refused_and_changes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--output-dir", str(out), *SMALL, "--num-rollout", "1"]) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    for transport in ("memory", "lmdb"):
        code = main(["--output-dir", str(out), *SMALL, "--num-rollout", "2", "--rollout-data-transport", transport])
        assert code == 2
        err = capsys.readouterr().err
        assert f"--output-dir={out}: the folder holds the memory run" in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_folder_of_run_files_from_before_run_json_is_refused(tmp_path, capsys):
    out = tmp_path / "old"
    (out / "weights" / "v1").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    assert main(["--output-dir", str(out), *SMALL, "--num-rollout", "1"]) == 2
    assert "another run's files (metrics.jsonl, weights)" in capsys.readouterr().err
    assert not (out / "run.json").exists()


def test_a_weights_folder_made_ready_on_another_disk_is_not_another_runs_files(tmp_path):
    """A user links `weights` to a fresh disk before the first run: the disk's `lost+found` and
    hidden entries are no run's files (before, the run was refused as writing into another run's)."""
    disk = tmp_path / "disk"
    (disk / "lost+found").mkdir(parents=True)
    (disk / ".mounted").write_text("")
    out = tmp_path / "run"
    out.mkdir()
    (out / "weights").symlink_to(disk)
    assert main(["--output-dir", str(out), *SMALL, "--num-rollout", "1"]) == 0
    assert (out / "run.json").exists()
    (disk / "stray").write_text("x")  # a visible entry of unknown origin still counts
    other = tmp_path / "other"
    other.mkdir()
    (other / "weights").symlink_to(disk)
    assert main(["--output-dir", str(other), *SMALL, "--num-rollout", "1"]) == 2


def test_the_same_lmdb_command_resumes_in_its_default_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lmdb = ("--rollout-data-transport", "lmdb")
    assert main([*SMALL, *lmdb, "--num-rollout", "1"]) == 0
    assert main([*SMALL, *lmdb, "--num-rollout", "2"]) == 0
    assert steps(tmp_path / "runs" / "default") == [0, 1]
    assert json.loads((tmp_path / "runs" / "default" / "run.json").read_text())["store"] == "rollout_data"


@pytest.mark.parametrize("given", [("--output-dir", "mine"), ("--rollout-queue-run-id", "exp")])
def test_a_named_folder_is_used_as_named(tmp_path, monkeypatch, given):
    from pipeline.config import load_config

    monkeypatch.chdir(tmp_path)
    config = load_config(list(given))
    assert config.output.dir == (Path("mine") if given[0] == "--output-dir" else Path("runs/exp"))


def test_the_hint_after_a_stopped_run_is_true_for_its_transport():
    from pipeline.config import load_config
    from pipeline.run.folder import resume_hint as _resume_hint

    # Before: "run the same command again to resume" after a memory run too, which kept nothing.
    assert "a memory run keeps no rollout state" in _resume_hint(load_config([]))
    lmdb = _resume_hint(load_config(["--rollout-data-transport", "lmdb"]))
    assert "run the same command again to resume" in lmdb and "runs/default" in lmdb


def test_a_failed_start_leaves_no_run_folder_and_runs_latest_where_it_was(tmp_path, monkeypatch, capsys):
    """Issue 45.9: every failed start left a run folder and moved runs/latest to it (five empty
    folders in an hour; `pipeline.plot runs/latest` then found no step record). A start refused
    before the run owns its folder (a model whose tokenizer does not load) writes nothing; one that fails
    after (its engine does not come up on broken weights) removes the folder it made, store and all."""
    from pipeline.tasks.tiny_model import make_model_folder

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "earlier").mkdir(parents=True)
    (tmp_path / "runs" / "latest").symlink_to("earlier", target_is_directory=True)
    no_tokenizer = make_model_folder(tmp_path / "no-tokenizer")
    (no_tokenizer / "tokenizer.json").write_text("not a tokenizer")
    broken = make_model_folder(tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    flags = (*SMALL, "--num-rollout", "1")
    assert main([*flags, "--hf-checkpoint", str(no_tokenizer)]) == 2
    assert "its tokenizer cannot be loaded" in capsys.readouterr().err
    assert main([*flags, "--hf-checkpoint", str(broken), "--rollout-data-transport", "lmdb"]) == 1
    assert "the engine exited with code" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["earlier", "latest"]
    assert (tmp_path / "runs" / "latest").readlink() == Path("earlier")

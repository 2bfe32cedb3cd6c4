"""A resume with changed settings (real runs of the launcher, real LMDB store, `replay summary`):
each setting the store recorded is either refused with both values named, or accepted and
recorded with the step it took effect, which replay shows (`pipeline/run/resume_settings.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import config_to_dict, load_config
from pipeline.replay import main as replay
from pipeline.run.cli import main as launch
from pipeline.run.resume_settings import REFUSED, changed_settings, refused_change, run_meta, without_secrets
from storage import LmdbStore

BASE = ("--rollout-data-transport", "lmdb", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "32",
        "--no-progress", "--log-level", "warning")  # fmt: skip


def _launch(out: Path, *flags: str) -> int:
    return launch(["--output-dir", str(out), *BASE, *flags])


@pytest.mark.slow
def test_a_changed_batch_size_is_accepted_recorded_and_shown_and_a_changed_backend_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert _launch(out, "--num-rollout", "2", "--rollout-batch-size", "2") == 0
    assert _launch(out, "--num-rollout", "3", "--rollout-batch-size", "4") == 0
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        assert [len(store.batch(s).groups) for s in range(3)] == [2, 2, 4]  # it took effect at step 2
        meta = store.read_meta()
    assert meta is not None
    assert meta.extra["config"]["rollout"]["rollout_batch_size"] == 4  # the settings now in force
    changes = {c["setting"]: c for c in meta.extra["config_changes"]}
    assert changes["rollout.rollout_batch_size"] == {
        "step": 2, "setting": "rollout.rollout_batch_size", "from": 2, "to": 4,
    }  # fmt: skip
    assert changes["rollout.num_rollout"]["from"] == 2 and changes["rollout.num_rollout"]["to"] == 3

    capsys.readouterr()
    assert replay([str(out), "summary"]) == 0
    summary = capsys.readouterr().out
    assert "rollout_batch_size=4" in summary
    assert "setting changed from step 2: rollout.rollout_batch_size 2 -> 4" in summary

    # Refused: the checkpoints hold the torch trainer's optimizer state. Both values named, the
    # store untouched (no change recorded).
    code = _launch(out, "--num-rollout", "4", "--rollout-batch-size", "4", "--train-backend", "megatron")
    err = capsys.readouterr().err
    assert code == 1, err
    assert "backend='torch'" in err and "backend='megatron'" in err, err
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        after = store.read_meta()
        assert store.trained_step() == 2
    assert after == meta


def test_every_recorded_setting_is_either_refused_or_recorded():
    """The decision covers every setting there is: a change of any of them is either refused
    (by name) or comes out as a change record with both values."""
    before = config_to_dict(load_config([]))
    for section, settings in before.items():
        for name, value in settings.items():
            after = {s: dict(v) for s, v in before.items()}
            after[section][name] = ["changed", value]  # any other value
            changes = changed_settings(before, after, step=7)
            assert [c["setting"] for c in changes] == [f"{section}.{name}"]
            refused = refused_change(changes)
            assert (refused is not None) == (f"{section}.{name}" in REFUSED)
            if refused is None and name != "api_key":
                expected = {"step": 7, "setting": f"{section}.{name}", "from": value, "to": ["changed", value]}
                assert changes[0] == expected
    secret = changed_settings({"engine": {"api_key": None}}, {"engine": {"api_key": "s3cret"}}, step=0)
    assert secret == [{"step": 0, "setting": "engine.api_key", "from": None, "to": "<set>"}]  # never the key


def test_the_engines_api_key_is_never_written_to_the_run_folder_or_the_store(tmp_path):
    """A run folder is copied, shared and attached to bug reports: the key stays out of it."""
    from pipeline.run.folder import check_run_folder

    config = load_config(["--output-dir", str(tmp_path / "run"), "--api-key", "sekrit-123", *BASE])
    folder = check_run_folder(config)
    folder.take(config)
    out = folder.path
    assert config.engine.api_key == "sekrit-123"  # the run itself still sends it
    written = (out / "config.json").read_text()
    assert "sekrit-123" not in written and '"api_key": "<set>"' in written
    meta = run_meta(config, [], tmp_path)
    assert meta.extra["config"]["engine"]["api_key"] == "<set>"
    assert without_secrets(config_to_dict(load_config([])))["engine"]["api_key"] is None
    # Resuming with the same key, or another one, records no change of a value nobody can read.
    again = without_secrets(config_to_dict(load_config(["--api-key", "other", *BASE])))
    assert [c for c in changed_settings(meta.extra["config"], again, step=1) if "api_key" in c["setting"]] == []

"""A resume with changed settings (real runs of the launcher, real LMDB store, `replay summary`):
each setting the store recorded is either refused with both values named, or accepted and
recorded with the step it took effect, which replay shows (`pipeline/run/resume_settings.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import IncompatibleStoreError
from pipeline.config import config_to_dict, load_config
from pipeline.replay import main as replay
from pipeline.run.cli import main as launch
from pipeline.run.resume_settings import (
    REFUSED,
    changed_settings,
    check_meta,
    refused_change,
    run_meta,
    without_secrets,
)
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


def test_a_changed_group_size_is_refused_with_the_flag_that_resumes_the_run(tmp_path):
    """The store's own group size is checked before the settings are: that refusal says the fix too."""
    stored = run_meta(load_config(["--n-samples-per-prompt", "8"]), [], tmp_path)
    with LmdbStore(tmp_path / "rollout_data") as store:
        check_meta(store, stored)  # a new store takes it
        with pytest.raises(IncompatibleStoreError) as err:
            check_meta(store, run_meta(load_config(["--n-samples-per-prompt", "4"]), [], tmp_path))
        assert store.read_meta() == stored  # nothing recorded
    assert str(err.value) == (
        "the store was written with n_samples_per_prompt=8, this run has n_samples_per_prompt=4: a resume "
        "cannot change it (stored groups hold that many samples each); run it with --n-samples-per-prompt 8 "
        "again, or start a new run in another --output-dir"
    )


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


def test_the_settings_of_any_step_are_read_back_from_the_record_of_changes():
    """`settings_at(step)` undoes the changes that took effect after `step`, newest first: two
    resumes, one at step 5 and one at step 8 (which also sets a setting the store's writer did not
    have: left out, so the schema's default applies)."""
    from pipeline.settings_history import changes_after, settings_at

    first = config_to_dict(load_config(["--lr", "5e-3"]))
    second = config_to_dict(load_config(["--lr", "2e-3"]))
    third = config_to_dict(load_config(["--lr", "1e-3", "--eps-clip", "0.05"]))
    first["trainer"].pop("entropy_coef")  # a setting this store's first writer did not know
    history = changed_settings(first, second, step=5) + changed_settings(second, third, step=8)
    extra = {"config": third, "config_changes": history}
    lr = [settings_at(extra, step)["trainer"]["lr"] for step in range(10)]
    assert lr == [5e-3] * 5 + [2e-3] * 3 + [1e-3] * 2
    assert [settings_at(extra, step)["trainer"]["eps_clip"] for step in (4, 7, 8)] == [0.2, 0.2, 0.05]
    assert "entropy_coef" not in settings_at(extra, 4)["trainer"]
    assert settings_at(extra, 9) == third
    after_7 = [c["setting"] for c in changes_after(extra, 7)]
    assert after_7 == ["trainer.eps_clip", "trainer.eps_clip_high", "trainer.lr"]
    assert settings_at({}, 3) is None  # a store that records no settings

"""Resume rules and the storage declaration, through `pipeline.run.cli.main` on real runs and real LMDB files.

A damaged store (a record that does not decode, a destroyed file header) is moved aside untouched,
the next run warns naming it, and continues from what was still readable; a store of another run
still stops the run. One 3-step run is made once for the module; each test damages its own copy.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch
from safetensors.torch import load_file

from storage import Cursor, GroupState, LmdbStore, keys, salvage_store
from tests.conftest import copy_of_run, file_digest, small_lmdb_run


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("resume") / "run"
    assert small_lmdb_run(out) == 0
    return out


@pytest.fixture
def run_copy(base_run, tmp_path) -> Path:
    return copy_of_run(base_run, tmp_path)


def _put_raw(store_dir: Path, key: bytes, value: bytes) -> None:
    """Overwrite one record of the `meta` database with bytes no codec wrote."""
    env = lmdb.open(str(store_dir), max_dbs=len(keys.DATABASES), subdir=True)
    try:
        with env.begin(write=True, db=env.open_db(keys.META)) as txn:
            txn.put(key, value)
    finally:
        env.close()


def _aside(out: Path) -> Path:
    [aside] = [p for p in out.iterdir() if p.name.startswith("rollout_data.unreadable-")]
    return aside


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _resume_and_check(out: Path, capsys, *, reason: str) -> tuple[Path, str]:
    """Runs 2 more steps after damage; checks the warning, the aside store, and the resumed steps."""
    store_dir = out / "rollout_data"
    damaged = {name: file_digest(store_dir / name) for name in ("data.mdb",)}
    capsys.readouterr()
    assert small_lmdb_run(out, steps=5) == 0
    text = "".join(capsys.readouterr())
    aside = _aside(out)
    assert str(aside) in text and "unreadable" in text and reason in text
    assert {name: file_digest(aside / name) for name in damaged} == damaged, "the damaged store was changed"
    records = _metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["version"] for r in records[3:]] == [3, 4]  # resumed from the saved weights of version 3
    with LmdbStore(store_dir, readonly=True) as store:
        assert store.trained_step() == 4
        assert store.count(GroupState.TRAINED) == 2 * 2  # steps 3 and 4 in the fresh store
    return aside, text


def _trained_again(out: Path) -> set[int]:
    """The prompts the resumed steps 3 and 4 trained."""
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        return {g.task.index for step in (3, 4) for g in store.batch(step).groups}


def test_a_corrupt_cursor_is_set_aside_and_rollout_goes_on_past_what_the_store_and_checkpoint_name(run_copy, capsys):
    with LmdbStore(run_copy / "rollout_data", readonly=True) as store:
        cursor = store.cursor()
    _put_raw(run_copy / "rollout_data", keys.META_CURSOR, b"\xc1 not a cursor")
    aside, text = _resume_and_check(run_copy, capsys, reason="meta/cursor")
    assert "the dataset cursor is unreadable" in text and "beginning of the dataset" not in text
    salvaged = salvage_store(aside)
    assert (salvaged.cursor, salvaged.trained_step) == (None, 2)  # the trained step survived the cursor
    assert min(_trained_again(run_copy)) >= cursor.index  # no prompt checkpoint v3 covers is trained again


def test_a_corrupt_cursor_with_a_checkpoint_of_an_older_version_starts_the_dataset_again(run_copy, capsys):
    """A checkpoint written before checkpoints recorded what they cover: nothing says where the
    dataset stood, so it starts again, and the warning says what that costs."""
    (run_copy / "checkpoints" / "v3" / "covers.json").unlink()
    _put_raw(run_copy / "rollout_data", keys.META_CURSOR, b"\xc1 not a cursor")
    _, text = _resume_and_check(run_copy, capsys, reason="meta/cursor")
    assert "beginning of the dataset" in text and "steps 0..2 (about 6) are trained a second time" in text
    assert 0 in _trained_again(run_copy)  # the first prompt of the dataset again


def test_a_corrupt_run_meta_keeps_the_cursor(run_copy, capsys):
    with LmdbStore(run_copy / "rollout_data", readonly=True) as store:
        cursor = store.cursor()
    assert cursor.index >= 6
    _put_raw(run_copy / "rollout_data", keys.META_RUN, b"garbage")
    _resume_and_check(run_copy, capsys, reason="meta/run")
    with LmdbStore(run_copy / "rollout_data", readonly=True) as store:
        indexes = {g.task.index for step in (3, 4) for g in store.batch(step).groups}
        assert store.read_meta().run_id == "default"  # the fresh store knows which run it is
    assert min(indexes) >= cursor.index  # continued where the readable cursor pointed


def test_a_destroyed_file_header_resumes_from_the_newest_checkpoint_and_the_cursor_it_records(run_copy, capsys):
    with LmdbStore(run_copy / "rollout_data", readonly=True) as store:
        cursor = store.cursor()
    data = run_copy / "rollout_data" / "data.mdb"
    with data.open("r+b") as fh:
        fh.write(b"\0" * 8192)  # both LMDB meta pages
    _, text = _resume_and_check(run_copy, capsys, reason="both meta pages are damaged")
    assert "resuming from the newest checkpoint, checkpoint v3" in text and "beginning of the dataset" not in text
    assert min(_trained_again(run_copy)) >= cursor.index


def _files(out: Path) -> dict[str, bytes]:
    """Every file of a run folder, as bytes; LMDB's lock file (its reader table) aside."""
    return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "lock.mdb"}


def _changed(out: Path, before: dict[str, bytes]) -> list[str]:
    """The files of `out` written, made or removed since `before` was taken."""
    now = _files(out)
    return sorted(name for name in before.keys() | now.keys() if before.get(name) != now.get(name))


def test_a_store_of_another_run_is_refused_and_left_in_place(run_copy, capsys):
    before = _files(run_copy)
    assert small_lmdb_run(run_copy, "--rollout-queue-run-id", "other", "--rollout-temperature", "0.5") == 1
    err = capsys.readouterr().err
    assert "run_id='default'" in err and "run_id='other'" in err
    # The folder as it was, its config.json included (the refused run used to write its own there).
    assert _changed(run_copy, before) == []


def test_a_store_held_by_a_live_controller_is_refused_and_left_in_place(run_copy, capsys):
    """A second controller on a live run's store is refused, and leaves the folder as it was: the
    live run's config.json (it said the refused run's 7 steps at temperature 0.5, while the live
    run trained on at 1.0) and the checkpoint the live run is saving (`.v4.tmp-*`, which the
    refused start's clean-up of unfinished saves used to delete)."""
    store_dir = run_copy / "rollout_data"
    saving = run_copy / "checkpoints" / ".v4.tmp-live"
    saving.mkdir()
    (saving / "model.safetensors").write_bytes(b"half of a checkpoint")
    before = _files(run_copy)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from storage import LmdbStore; s = LmdbStore(sys.argv[1]); "
            "print('open', flush=True); sys.stdin.read(); s.close()",
            str(store_dir),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        assert small_lmdb_run(run_copy, "--rollout-temperature", "0.5", steps=7) == 1
    finally:
        holder.communicate(timeout=30)
    assert f"the rollout store {store_dir} is held by pid {holder.pid}" in capsys.readouterr().err
    assert _changed(run_copy, before) == []


def test_a_resume_without_the_newest_checkpoint_trains_the_stored_batches_again(run_copy, capsys):
    """The base run checkpointed only its last step (v3, --save-interval 10): without it the resume
    starts from the base model and trains the three stored batches again before new work."""
    shutil.rmtree(run_copy / "checkpoints" / "v3")
    assert small_lmdb_run(run_copy, steps=5) == 0
    assert "replaying stored batches" in capsys.readouterr().out
    assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == ["v5"]
    meta = json.loads((run_copy / "checkpoints" / "v5" / "optimizer" / "state.json").read_text())
    assert meta["trainer_steps"] == 5  # three replayed, two new: none twice, none lost


def test_stored_steps_trained_again_run_with_the_settings_they_first_ran_with(run_copy, capsys, tmp_path):
    """Issue 46: a resume that changes trainer settings records them from the next new step
    (`trainer.lr: 0.005 -> 0.001 from_step=3`), but the steps after the last checkpoint, trained
    again from the store first, ran with the old ones. The killed run's own weights after step 2 are
    its checkpoint v3, moved aside here (as if the kill came before it was saved): the resume trains
    steps 0..2 again from the base model with their settings and lands on them bit for bit, then
    trains step 3 with the new ones; `replay train` feeds each step its settings too."""
    from pipeline.metric_names import trainer_record
    from pipeline.replay import main as replay

    killed = tmp_path / "v3-of-the-killed-run"
    (run_copy / "checkpoints" / "v3").rename(killed)
    changed = ("--lr", "1e-3", "--eps-clip", "0.05", "--tis-clip", "0.5", "--use-opsm")
    assert small_lmdb_run(run_copy, "--save-interval", "3", *changed, steps=4) == 0  # v3 is saved again, by the replay
    assert "replaying stored batches" in capsys.readouterr().out
    theirs, replayed = (load_file(str(d / "model.safetensors")) for d in (killed, run_copy / "checkpoints" / "v3"))
    assert set(theirs) == set(replayed)
    assert [k for k in theirs if not torch.equal(theirs[k], replayed[k])] == []
    records = _metrics(run_copy)
    assert [(r["step"], r["train/lr-pg_0"]) for r in records] == [(0, 5e-3), (1, 5e-3), (2, 5e-3), (3, 1e-3)]

    capsys.readouterr()
    assert replay([str(run_copy), "train"]) == 0
    again = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in again] == [0, 1, 2, 3]
    for r, m in zip(again, records, strict=True):
        for key in ("lr", "loss", "grad_norm", "opsm_mask_frac"):
            assert r[key] == pytest.approx(m[trainer_record({key: 0.0}).popitem()[0]], rel=1e-6, abs=1e-9), (
                r["step"],
                key,
            )


def test_a_resume_whose_batches_to_train_again_were_collected_names_the_folder(run_copy, capsys):
    shutil.rmtree(run_copy / "checkpoints" / "v3")
    with LmdbStore(run_copy / "rollout_data") as store:
        store.collect_garbage(1)
    assert small_lmdb_run(run_copy, steps=5) == 1
    err = capsys.readouterr().err
    assert "batches of steps 0..1 to train again were collected" in err and str(run_copy / "checkpoints") in err


def test_salvage_of_a_store_that_never_admitted_anything(tmp_path):
    LmdbStore(tmp_path / "s", sync=False).close()
    salvaged = salvage_store(tmp_path / "s")
    assert (salvaged.cursor, salvaged.trained_step, salvaged.problems) == (Cursor(), -1, ())
    missing = salvage_store(tmp_path / "nowhere")
    assert (missing.cursor, missing.trained_step) == (None, None) and str(tmp_path / "nowhere") in missing.problems[0]


# --- the storage declaration --------------------------------------------------------------------


def test_a_profile_that_disagrees_with_the_local_disk_names_both(tmp_path, capsys):
    assert small_lmdb_run(tmp_path / "run", "--rollout-storage-profile", "nfs", steps=1) == 2  # a config error
    err = capsys.readouterr().err
    assert "--rollout-storage-profile='nfs' covers nfs, nfs4" in err
    assert str((tmp_path / "run" / "rollout_data").resolve()) in err and " is on " in err
    assert not (tmp_path / "run" / "rollout_data").exists()  # refused before the store was created


@pytest.fixture
def nfs_mount(tmp_path, monkeypatch) -> Path:
    """The kernel's mount table with tmp_path on NFS (the one fake: /proc/self/mountinfo)."""
    import storage.declaration

    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        f"22 1 0:21 / / rw - ext4 /dev/sda1 rw\n99 22 0:55 / {tmp_path.resolve()} rw - nfs4 server:/export rw\n"
    )
    monkeypatch.setattr(storage.declaration, "MOUNTINFO", str(mountinfo))
    return tmp_path


def test_an_undeclared_network_filesystem_stops_the_run(nfs_mount, capsys):
    assert small_lmdb_run(nfs_mount / "run", steps=1) == 1
    err = capsys.readouterr().err
    assert "network filesystem" in err and "nfs4" in err and "--rollout-storage-declaration" in err


def test_a_declared_network_filesystem_runs_and_says_what_declared_it(nfs_mount, capsys):
    declaration = nfs_mount / "storage.json"
    declaration.write_text(
        json.dumps(
            {"mount_path": str(nfs_mount.resolve()), "filesystem": "nfs4", "durability": {"synced_commits": False}}
        )
    )
    capsys.readouterr()
    assert (
        small_lmdb_run(nfs_mount / "run", "--rollout-storage-declaration", str(declaration), steps=1, level="info") == 0
    )
    text = "".join(capsys.readouterr())
    assert f"declaration {declaration}" in text and "nfs4" in text
    assert "synced_commits=False" in text


def test_a_run_folder_of_the_older_layout_resumes_from_its_last_step_without_a_replay(run_copy, capsys):
    """Before issue 30 every step saved its full checkpoint as weights/vN: such a folder still resumes
    from the last one, with nothing to train again, and is never deleted as a publish folder."""
    shutil.rmtree(run_copy / "weights")
    (run_copy / "weights").mkdir()
    (run_copy / "checkpoints" / "v3").rename(run_copy / "weights" / "v3")
    (run_copy / "checkpoints").rmdir()
    assert small_lmdb_run(run_copy, steps=5) == 0
    assert "replaying stored batches" not in capsys.readouterr().out
    assert (run_copy / "weights" / "v3" / "optimizer").is_dir()
    meta = json.loads((run_copy / "checkpoints" / "v5" / "optimizer" / "state.json").read_text())
    assert meta["trainer_steps"] == 5

"""Damaged stores through the real launcher (`pipeline.run.cli.main`), as a user meets them: run 3 steps,
damage `data.mdb` as a disk or a copy would, run the same command for 5 steps.

A store that does not open (a meta page, a truncated file, a newer layout) is moved aside
untouched, the warning names both folders and what is damaged, and the run continues from what
was readable. A store that opens but holds a damaged group keeps it quarantined and generates its
prompt again, so every prompt whose data is readable is trained exactly once.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import lmdb
import pytest

from core.types import Group, PromptTask
from pipeline.replay import main as replay
from pipeline.run.cli import main as launch
from storage import Cursor, GroupState, LmdbStore, keys
from storage.migrate import layout_value
from storage.seal import OVERHEAD

FLAGS = (
    "--rollout-data-transport",
    "lmdb",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "4",
    "--rollout-max-response-len",
    "32",
    "--no-progress",
)


def run(out: Path, *, steps: int, extra: tuple[str, ...] = ()) -> int:
    return launch(["--output-dir", str(out), "--num-rollout", str(steps), "--log-level", "warning", *FLAGS, *extra])


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corrupt") / "run"
    assert run(out, steps=3) == 0
    return out


@pytest.fixture
def run_copy(base_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    return out


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _resume_moved_aside(out: Path, capsys, *, reason: str) -> str:
    """Resume for 5 steps; the damaged store must be moved aside untouched and named with the fresh one."""
    store_dir = out / "rollout_data"
    before = _digest(store_dir / "data.mdb")
    capsys.readouterr()
    assert run(out, steps=5) == 0
    text = "".join(capsys.readouterr())
    [aside] = [p for p in out.iterdir() if p.name.startswith("rollout_data.unreadable-")]
    assert str(aside) in text and str(store_dir) in text and reason in text, text
    assert _digest(aside / "data.mdb") == before, "the damaged store was changed"
    assert _steps(out)[-1] == 4
    with LmdbStore(store_dir, readonly=True) as store:
        assert store.trained_step() == 4 and store.verify().ok
    return text


def _newer_meta_page(path: Path) -> int:
    data = path.read_bytes()
    txnids = [struct.unpack_from("<Q", data, page * 4096 + 136 + 8)[0] for page in (0, 1)]
    return 0 if txnids[0] > txnids[1] else 1


def test_a_damaged_meta_page_is_moved_aside_and_everything_before_the_last_commit_continues(run_copy, capsys):
    data = run_copy / "rollout_data" / "data.mdb"
    older = 1 - _newer_meta_page(data)
    with data.open("r+b") as fh:  # the case: LMDB said "Cannot allocate memory"
        fh.seek(older * 4096 + 16)
        fh.write(b"\xa5" * 200)
    text = _resume_moved_aside(run_copy, capsys, reason=f"meta page {older}")
    assert "Cannot allocate memory" not in text
    assert _steps(run_copy) == [0, 1, 2, 3, 4]  # the other meta page held the whole run: nothing lost


def test_a_truncated_file_is_moved_aside_and_the_run_continues(run_copy, capsys):
    data = run_copy / "rollout_data" / "data.mdb"
    with data.open("r+b") as fh:
        fh.truncate(data.stat().st_size - 4096)
    _resume_moved_aside(run_copy, capsys, reason="truncated")


def test_a_store_of_a_newer_layout_is_moved_aside_naming_both_versions(run_copy, capsys):
    env = lmdb.open(str(run_copy / "rollout_data"), max_dbs=len(keys.DATABASES))
    with env.begin(write=True) as txn:
        txn.put(keys.META_LAYOUT, layout_value(7), db=env.open_db(keys.META, txn=txn))
    env.close()
    text = _resume_moved_aside(run_copy, capsys, reason="layout 7")
    assert "reads layouts 1 to 2" in text


def test_a_damaged_group_is_quarantined_and_its_prompt_trained_once(run_copy, capsys):
    store_dir = run_copy / "rollout_data"
    with LmdbStore(store_dir) as store:  # a run stopped while prompt 6 was generating
        cursor = store.cursor()
        assert cursor.index == 6
        stand_in = Group.fresh(PromptTask(index=6, prompt_ids=(1, 2, 3)), epoch=0, n_samples=4, version=3, seq=6)
        store.admit([stand_in], Cursor(cursor.epoch, 7, 7))
    env = lmdb.open(str(store_dir), max_dbs=len(keys.DATABASES))
    with env.begin(write=True) as txn:
        db = env.open_db(keys.GROUPS, txn=txn)
        value = bytearray(txn.get(stand_in.group_id.encode(), db=db))
        value[OVERHEAD + 5] ^= 0x01  # one bit, as a disk would flip it
        txn.put(stand_in.group_id.encode(), bytes(value), db=db)
    env.close()
    capsys.readouterr()
    assert run(run_copy, steps=5) == 0
    text = "".join(capsys.readouterr())
    assert "quarantined" in text and not [p for p in run_copy.iterdir() if ".unreadable-" in p.name]
    with LmdbStore(store_dir, readonly=True) as store:
        assert store.count(GroupState.QUARANTINED) == 1  # kept, counted, never trained
        trained = [g for step in (3, 4) for g in store.batch(step).groups]
        indexes = [g.task.index for g in trained]
        assert sorted(indexes) == sorted(set(indexes)) and 6 in indexes  # prompt 6 again, once
        assert f"{stand_in.group_id}.requeued" in {g.group_id for g in trained}


def _scribble_tree_roots(store_dir: Path, *trees: bytes) -> None:
    """Overwrite the root page of each named tree, as a disk would: the tree cannot be read."""
    env = lmdb.open(str(store_dir), max_dbs=len(keys.DATABASES), readonly=True, lock=False)
    with env.begin() as txn:
        roots = [struct.unpack_from("<Q", bytes(txn.get(tree)), 40)[0] for tree in trees]  # MDB_db.md_root
    env.close()
    with (store_dir / "data.mdb").open("r+b") as fh:
        for root in roots:
            fh.seek(root * 4096 + 16)
            fh.write(b"\xa5" * (4096 - 16))


def test_with_the_groups_unreadable_the_prompts_no_trained_batch_names_are_generated_again(tmp_path, capsys):
    """The groups and state trees are damaged, the batches tree is intact: the prompts below the
    cursor that no trained batch names (partial or ready when the run stopped) are generated
    again, said in one line, and replay says the earlier steps' batches are in the store moved
    aside (not that they were garbage collected)."""
    out = tmp_path / "run"
    over = ("--partial-rollout", "--over-sampling-batch-size", "4")  # leaves partial and ready groups
    assert run(out, steps=3, extra=over) == 0
    store_dir = out / "rollout_data"
    with LmdbStore(store_dir, readonly=True) as store:
        cursor = store.cursor()
        trained_before = {g.task.index for step in range(3) for g in store.batch(step).groups}
        left = {g.group_id for state in (GroupState.PARTIAL, GroupState.READY) for g in store.groups(state)}
    unaccounted = {f"e0000-p{i:09d}" for i in range(cursor.index)} - {f"e0000-p{i:09d}" for i in trained_before}
    assert cursor.epoch == 0 and left and left <= unaccounted, (left, unaccounted)
    _scribble_tree_roots(store_dir, keys.GROUPS, keys.STATE)

    capsys.readouterr()
    assert run(out, steps=5, extra=over) == 0
    text = "".join(capsys.readouterr())
    said = [line for line in text.splitlines() if "generated again" in line and "below the cursor" in line]
    assert len(said) == 1 and f"prompts={len(unaccounted)}" in said[0], text
    with LmdbStore(store_dir, readonly=True) as store:
        assert all(store.get(gid) is not None for gid in unaccounted), "a prompt below the cursor was dropped"
        trained_after = [g.task.index for step in (3, 4) for g in store.batch(step).groups]
    assert len(trained_after) == len(set(trained_after)) and not set(trained_after) & trained_before

    capsys.readouterr()
    assert replay([str(out), "summary"]) == 0
    summary = capsys.readouterr().out
    [aside] = [p for p in out.iterdir() if p.name.startswith("rollout_data.unreadable-")]
    assert "steps 0..2 were trained before this store was seeded from a damaged one" in summary, summary
    assert str(aside) in summary and "garbage collected: 0" not in summary, summary


def test_a_damaged_record_of_a_group_trained_before_the_checkpoint_is_left_to_verify(run_copy, capsys):
    """A resume reads what it trains again, never the whole store (issue 49): a damaged record of a
    group trained before the checkpoint is history, not read on resume; `replay verify` names it.
    (The damaged records of the steps a resume trains again are named once on resume:
    tests/test_store_at_size.py.)"""
    store_dir = run_copy / "rollout_data"
    with LmdbStore(store_dir, readonly=True) as store:
        victim = store.batch(1).groups[0].group_id
    env = lmdb.open(str(store_dir), max_dbs=len(keys.DATABASES))
    with env.begin(write=True) as txn:
        db = env.open_db(keys.GROUPS, txn=txn)
        value = bytearray(txn.get(victim.encode(), db=db))
        value[OVERHEAD + 5] ^= 0x01  # one bit, as a disk would flip it
        txn.put(victim.encode(), bytes(value), db=db)
    env.close()
    capsys.readouterr()
    assert run(run_copy, steps=4) == 0  # checkpoint v3: nothing trained again, nothing trained read
    assert "already trained" not in "".join(capsys.readouterr())
    assert replay([str(run_copy), "verify"]) == 1
    assert victim in capsys.readouterr().out
    with LmdbStore(store_dir, readonly=True) as store:
        assert store.trained_step() == 3

"""Damaged stores through the real launcher (`pipeline.run.cli.main`), as a user meets them: run 3 steps,
damage `data.mdb` as a disk or a copy would, run the same command for 5 steps.

A store that does not open (a meta page, a truncated file, a newer layout) is moved aside
untouched, the warning names both folders and what is damaged, and the run continues from what
was readable. A store that opens but holds a damaged group keeps it quarantined and generates its
prompt again, so every prompt whose data is readable is trained exactly once.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import lmdb
import pytest

from core.types import FinishReason, Group, PromptTask, Segment
from pipeline.replay import main as replay
from pipeline.run.reconcile import prompt_of
from storage import Cursor, GroupState, LmdbStore, keys, salvage_store
from storage.migrate import layout_value
from tests.conftest import copy_of_run, file_digest, flip_a_stored_group_bit, small_lmdb_run


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corrupt") / "run"
    assert small_lmdb_run(out, steps=3) == 0
    return out


@pytest.fixture
def run_copy(base_run, tmp_path) -> Path:
    return copy_of_run(base_run, tmp_path)


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _resume_moved_aside(out: Path, capsys, *, reason: str) -> str:
    """Resume for 5 steps; the damaged store must be moved aside untouched and named with the fresh one."""
    store_dir = out / "rollout_data"
    before = file_digest(store_dir / "data.mdb")
    capsys.readouterr()
    assert small_lmdb_run(out, steps=5) == 0
    text = "".join(capsys.readouterr())
    [aside] = [p for p in out.iterdir() if p.name.startswith("rollout_data.unreadable-")]
    assert str(aside) in text and str(store_dir) in text and reason in text, text
    assert file_digest(aside / "data.mdb") == before, "the damaged store was changed"
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
    flip_a_stored_group_bit(store_dir, stand_in.group_id)
    capsys.readouterr()
    assert small_lmdb_run(run_copy, steps=5) == 0
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
    assert small_lmdb_run(out, *over, steps=3) == 0
    store_dir = out / "rollout_data"
    with LmdbStore(store_dir, readonly=True) as store:
        cursor = store.cursor()
        trained_before = {g.task.index for step in range(3) for g in store.batch(step).groups}
        left = {g.group_id for state in (GroupState.PARTIAL, GroupState.READY) for g in store.groups(state)}
    unaccounted = {f"e0000-p{i:09d}" for i in range(cursor.index)} - {f"e0000-p{i:09d}" for i in trained_before}
    assert cursor.epoch == 0 and left and left <= unaccounted, (left, unaccounted)
    _scribble_tree_roots(store_dir, keys.GROUPS, keys.STATE)

    capsys.readouterr()
    assert small_lmdb_run(out, *over, steps=5) == 0
    text = "".join(capsys.readouterr())
    said = [line for line in text.splitlines() if "prompts generated again" in line]
    assert len(said) == 1 and f"count={len(unaccounted)}" in said[0], text
    assert all(gid in said[0] for gid in unaccounted), text
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


@pytest.mark.parametrize("record", [True, False], ids=["with its record", "of an older version"])
def test_a_damaged_newest_meta_page_right_after_the_final_checkpoint_resumes_from_it(run_copy, capsys, record):
    """The base run's last commit (step 2's) is lost with the newer meta page: the other says step
    1, while checkpoint v3 covers step 2. The resume reconciles from what v3 records (or, for a
    checkpoint of an older version, from step 2's batch record) and trains none of its prompts
    again."""
    with LmdbStore(run_copy / "rollout_data", readonly=True) as store:
        covered = _prompts(g.group_id for step in range(3) for g in store.batch(step).groups)
    if not record:
        (run_copy / "checkpoints" / "v3" / "covers.json").unlink(missing_ok=True)
    data = run_copy / "rollout_data" / "data.mdb"
    with data.open("r+b") as fh:
        fh.seek(_newer_meta_page(data) * 4096 + 16)
        fh.write(b"\xa5" * 200)
    assert salvage_store(run_copy / "rollout_data").trained_step == 1  # the commit before the last
    capsys.readouterr()
    assert small_lmdb_run(run_copy, steps=4) == 0
    text = "".join(capsys.readouterr())
    assert "base model" not in text and "resuming from the newest checkpoint, checkpoint v3" in text, text
    with LmdbStore(run_copy / "rollout_data", readonly=True) as store:
        assert store.trained_step() == 3
        trained = _prompts(g.group_id for g in store.batch(3).groups)
    assert len(trained) == 2 and not trained & covered


def test_a_damaged_record_of_a_group_trained_before_the_checkpoint_is_left_to_verify(run_copy, capsys):
    """A resume reads what it trains again, never the whole store (issue 49): a damaged record of a
    group trained before the checkpoint is history, not read on resume; `replay verify` names it.
    (The damaged records of the steps a resume trains again are named once on resume:
    tests/test_store_at_size.py.)"""
    store_dir = run_copy / "rollout_data"
    with LmdbStore(store_dir, readonly=True) as store:
        victim = store.batch(1).groups[0].group_id
    flip_a_stored_group_bit(store_dir, victim)
    capsys.readouterr()
    assert small_lmdb_run(run_copy, steps=4) == 0  # checkpoint v3: nothing trained again, nothing trained read
    assert "already trained" not in "".join(capsys.readouterr())
    assert replay([str(run_copy), "verify"]) == 1
    assert victim in capsys.readouterr().out
    with LmdbStore(store_dir, readonly=True) as store:
        assert store.trained_step() == 3


# --- damage after the newest checkpoint (issue 46) ---------------------------------------------
#
# A 4-step partial-rollout run checkpointed at v2 (--save-interval 2), its v4 removed: the state a
# kill leaves after step 3 committed and before its checkpoint. Steps 2 and 3 were trained after
# the newest checkpoint, and unfinished groups carry tokens of versions up to 3. Whatever the
# damage, the resume must train no prompt v2 covers again, lose none it does not cover (each
# trained again from its stored batch, carried over, or generated again and named), and train no
# token at a step older than its version.

AFTER = ("--save-interval", "2", "--partial-rollout", "--over-sampling-batch-size", "4")


@pytest.fixture(scope="module")
def after_checkpoint_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("after") / "run"
    assert small_lmdb_run(out, *AFTER, steps=4) == 0
    shutil.rmtree(out / "checkpoints" / "v4")
    return out


@pytest.fixture
def after_copy(after_checkpoint_run, tmp_path) -> Path:
    return copy_of_run(after_checkpoint_run, tmp_path)


def _prompts(gids) -> set[str]:
    return {gid.split(".")[0] for gid in gids}


def _before_damage(out: Path) -> tuple[set[str], set[str]]:
    """(prompts checkpoint v2 covers, prompts admitted that it does not)."""
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        covered = _prompts(g.group_id for step in (0, 1) for g in store.batch(step).groups)
        admitted = {f"e0000-p{i:09d}" for i in range(store.cursor().index)}
    return covered, admitted - covered


def _regenerated_events(out: Path) -> list[dict]:
    lines = (out / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == "regenerated"]


def _resume_after_damage(out: Path, capsys, covered: set[str], open_: set[str]) -> tuple[str, set[str]]:
    """Resume to step 3 and check the promises; returns the log and the prompts generated again."""
    capsys.readouterr()
    assert small_lmdb_run(out, *AFTER, steps=4) == 0
    text = "".join(capsys.readouterr())
    said = [line for line in text.splitlines() if "prompts generated again" in line]
    events = _regenerated_events(out)
    regenerated = {gid for e in events for gid in e["groups"]}
    assert len(said) == len(events) <= 1, text
    if said:
        assert f"count={len(regenerated)}" in said[0] and all(gid in said[0] for gid in regenerated), said
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        assert store.trained_step() == 3
        first = store.statistics().collected_step + 1  # the steps the fresh store holds batches of
        trained = [g for step in range(max(first, 2), 4) for g in store.batch(step).groups]
        records = store.step_metrics()
        held = {g.group_id for s in (GroupState.PARTIAL, GroupState.READY) for g in store.groups(s)}
        cursor = store.cursor()
        for step in range(max(first, 2), 4):
            newest = max(v for g in store.batch(step).groups for x in g.samples for v in x.versions)
            assert newest <= records[step]["version"] == step, f"step {step} trained version {newest} tokens"
            assert records[step]["staleness/mean"] >= 0
    ids = [g.group_id for g in trained]
    assert not _prompts(ids) & covered, "a prompt checkpoint v2 covers was trained again"
    assert not _prompts(held) & covered, "a prompt checkpoint v2 covers is held again"
    assert len(_prompts(ids)) == len(ids), "a prompt was trained twice"
    assert len(_prompts({*ids, *held})) == len(ids) + len(held), "a prompt is both trained and held, or held twice"
    # A prompt at or past the fresh store's cursor is not lost: the dataset admits it next. (A
    # resume that cannot read the cursor rewinds to the newest one it can infer, and the prompts
    # admitted after that, which nothing readable names, are admitted again as new work.)
    ahead = {p for p in open_ if prompt_of(p) >= (cursor.epoch, cursor.index)}
    lost = open_ - _prompts(ids) - _prompts(held) - ahead
    assert not lost, f"prompts neither trained again, carried over nor generated again: {lost}"
    assert regenerated <= {*ids, *held}
    return text, _prompts(regenerated)


def test_a_damaged_group_in_a_batch_to_train_again_is_left_out_and_its_prompt_generated_again(after_copy, capsys):
    """The store opens; a group of step 2 (trained after checkpoint v2) fails its checksum. The
    replay trains the rest of its batch, the prompt is generated again under a new id, named in
    one line and in events.jsonl, once, and the run goes on."""
    covered, open_ = _before_damage(after_copy)
    with LmdbStore(after_copy / "rollout_data", readonly=True) as store:
        victim = store.batch(2).groups[0].group_id
    flip_a_stored_group_bit(after_copy / "rollout_data", victim)
    capsys.readouterr()
    assert small_lmdb_run(after_copy, *AFTER, steps=5) == 0
    text = "".join(capsys.readouterr())
    assert not [p for p in after_copy.iterdir() if ".unreadable-" in p.name]  # it opens: not moved aside
    said = [line for line in text.splitlines() if "prompts generated again" in line]
    assert len(said) == 1 and f"'{victim}.requeued'" in said[0] and "count=1" in said[0], text
    [event] = _regenerated_events(after_copy)
    assert event["groups"] == [f"{victim}.requeued"] and event["steps"] == [2]
    with LmdbStore(after_copy / "rollout_data", readonly=True) as store:
        assert store.trained_step() == 4
        again = [g.group_id for step in range(2, 5) for g in store.batch(step, damaged=[]).groups]
        held = {g.group_id for s in (GroupState.PARTIAL, GroupState.READY) for g in store.groups(s)}
    assert f"{victim}.requeued" in {*again, *held} and victim not in again
    assert not _prompts(again) & covered and len(_prompts(again)) == len(again)
    assert not open_ - _prompts(again) - _prompts(held)
    state = json.loads((after_copy / "checkpoints" / "v5" / "optimizer" / "state.json").read_text())
    assert state["trainer_steps"] == 5  # steps 2 and 3 trained again (step 2 without the victim), then 4


def test_a_damaged_batch_record_to_train_again_moves_the_store_aside_and_the_rest_is_trained_again(after_copy, capsys):
    """Step 3's batch record itself fails its checksum: which prompts it trained is known only
    from the groups' states, so the store is moved aside, step 2 trained again from its batch,
    and step 3's prompts generated again, named."""
    covered, open_ = _before_damage(after_copy)
    with LmdbStore(after_copy / "rollout_data", readonly=True) as store:
        step_3 = _prompts(g.group_id for g in store.batch(3).groups)
    env = lmdb.open(str(after_copy / "rollout_data"), max_dbs=len(keys.DATABASES))
    with env.begin(write=True) as txn:
        db = env.open_db(keys.BATCHES, txn=txn)
        value = bytearray(txn.get(keys.step_key(3), db=db))
        value[-1] ^= 0x01
        txn.put(keys.step_key(3), bytes(value), db=db)
    env.close()
    text, regenerated = _resume_after_damage(after_copy, capsys, covered, open_)
    assert "the batch record of step 3, to be trained again, is damaged" in text and "steps=2..2" in text
    assert step_3 <= regenerated


def _tree_pages(store_dir: Path, tree: bytes) -> tuple[list[int], list[int]]:
    """(branch pages, leaf pages) of the named tree, walked from its root."""
    env = lmdb.open(str(store_dir), max_dbs=len(keys.DATABASES), readonly=True, lock=False)
    with env.begin() as txn:
        root = struct.unpack_from("<Q", bytes(txn.get(tree)), 40)[0]  # MDB_db.md_root
    env.close()
    data = (store_dir / "data.mdb").read_bytes()
    branches, leaves, todo = [], [], [root]
    while todo:
        page = todo.pop()
        flags, lower = struct.unpack_from("<HH", data, page * 4096 + 10)
        if not flags & 0x01:
            leaves.append(page)
            continue
        branches.append(page)
        for offset in struct.unpack_from(f"<{(lower - 16) // 2}H", data, page * 4096 + 16):
            lo, hi, high = struct.unpack_from("<HHH", data, page * 4096 + offset)
            todo.append(lo | hi << 16 | high << 32)
    return branches, leaves


def _damage(store_dir: Path, where: str) -> None:
    data = store_dir / "data.mdb"
    if where == "meta page":  # the newer one: the other holds the commit before the last
        page = _newer_meta_page(data)
        start, size = page * 4096 + 16, 200
    elif where == "leaf header":
        page = _tree_pages(store_dir, keys.GROUPS)[1][0]
        start, size = page * 4096, 16
    elif where == "branch page":
        branches = _tree_pages(store_dir, keys.GROUPS)[0]
        assert branches, "the groups tree has no branch page"
        start, size = branches[0] * 4096 + 16, 4096 - 16
    else:  # truncated: the second half of the file is gone, and the meta tree (cursor, trained step) with it
        # Where LMDB put the meta tree's pages depends on the run's timing: a cut at half the file
        # kept them in some runs. The cut goes below them, so the cursor is always lost.
        branches, leaves = _tree_pages(store_dir, keys.META)
        with data.open("r+b") as fh:
            fh.truncate(min(data.stat().st_size // 2, min(branches + leaves) * 4096))
        return
    with data.open("r+b") as fh:
        fh.seek(start)
        fh.write(b"\xa5" * size)


def _admit_ahead(store_dir: Path, n: int) -> None:
    """Admit `n` more prompts, as a run that stopped with much in flight leaves them: how far the
    base run admitted depends on timing (its cursor ended at 9 to 15 in the runs seen), and this puts it past where
    a resume from checkpoint v2's cursor gets to in two steps, every time."""
    with LmdbStore(store_dir) as store:
        cursor = store.cursor()
        ahead = [
            Group.fresh(
                PromptTask(index=cursor.index + i, prompt_ids=(1, 2, 3)),
                epoch=0,
                n_samples=4,
                version=3,
                seq=cursor.next_seq + i,
            )
            for i in range(n)
        ]
        store.admit(ahead, Cursor(cursor.epoch, cursor.index + n, cursor.next_seq + n))


@pytest.mark.parametrize("where", ["meta page", "leaf header", "branch page", "truncated"])
def test_a_store_moved_aside_after_the_checkpoint_loses_no_prompt_and_trains_none_twice(after_copy, capsys, where):
    """Salvage replays what the surviving trees hold and generates again, naming them, the
    prompts it cannot account for; checkpoint v2's record says which prompts it covers even when
    the cursor and the trained step are lost (truncated)."""
    if where == "truncated":
        _admit_ahead(after_copy / "rollout_data", 8)
    covered, open_ = _before_damage(after_copy)
    _damage(after_copy / "rollout_data", where)
    text, regenerated = _resume_after_damage(after_copy, capsys, covered, open_)
    assert "moved aside" in text
    if where == "truncated":  # the cursor is in the lost half: what followed the inferred one is admitted again
        assert "are admitted again from there as new work" in text, text
    if where == "meta page":  # the other meta page still reads every batch: trained again, none lost
        assert "are trained again from the batches the unreadable store still holds" in text
    else:
        assert regenerated and not regenerated & covered


def test_unfinished_groups_of_weights_the_resume_cannot_rebuild_are_generated_again(after_copy, capsys):
    """The trained step is unreadable: the resume rebuilds only checkpoint v2 (version 2), so an
    unfinished group holding tokens of version 3 (generated after step 2's publish) cannot be
    trained as if on-policy (its behaviour log-probs came from weights the rewind threw away): its
    prompt is generated again, named; groups of versions up to 2 are carried over."""
    covered, open_ = _before_damage(after_copy)
    with LmdbStore(after_copy / "rollout_data") as store:  # a run stopped mid-generation at version 3
        cursor = store.cursor()
        task = PromptTask(index=cursor.index, prompt_ids=(1, 2, 3))
        stand_in = Group.fresh(task, epoch=0, n_samples=4, version=3, seq=cursor.next_seq)
        store.admit([stand_in], Cursor(0, cursor.index + 1, cursor.next_seq + 1))
        segment = Segment((5, 6), (-0.5, -0.7), FinishReason.ABORT, 3)
        store.put_partial(
            stand_in.with_samples([s.resumed().extended(segment, max_response_len=32) for s in stand_in.samples])
        )
    env = lmdb.open(str(after_copy / "rollout_data"), max_dbs=len(keys.DATABASES))
    with env.begin(write=True) as txn:
        txn.put(keys.META_TRAINED_STEP, b"\x01\x02", db=env.open_db(keys.META, txn=txn))
    env.close()
    text, regenerated = _resume_after_damage(after_copy, capsys, covered, open_ | {stand_in.group_id})
    assert "generated by weights the resume cannot rebuild" in text and stand_in.group_id in regenerated

"""Damaged stores, on real LMDB files: each kind of damage ends in a clear message that names what
is damaged, loses nothing that can still be read, and leaves a store a run can continue from.

The damage is what disk or copy corruption does: bytes overwritten in LMDB's meta pages, in branch
pages, in a record's bytes in a leaf page; a file cut short; and a store of a newer layout. The
launcher's side of the same damage (moved aside, salvaged, the run going on) is in
tests/test_corruption_resume.py.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import lmdb
import pytest

from core.errors import IncompatibleStoreError, StoreCorruptionError
from core.types import Batch
from pipeline.replay import main as replay
from storage import Cursor, GroupState, LmdbStore, MemoryStore, keys, salvage_store
from storage.migrate import layout_value
from storage.seal import OVERHEAD, seal
from tests.test_store import cursor_after, finished, fresh, generated

PAGE = 4096
P_BRANCH, P_LEAF = 0x01, 0x02


def _fill(path: Path, n: int = 40) -> None:
    """A store mid-run: step 0 trained, READY and PARTIAL groups waiting, some RUNNING."""
    with LmdbStore(path, sync=False) as store:
        store.admit([fresh(i) for i in range(n)], cursor_after(n))
        for i in range(n // 2):
            store.put_ready(finished(fresh(i), 0))
        for i in range(n // 2, n - 4):
            store.put_partial(generated(fresh(i), 0))
        store.take_batch(0, 4)
        store.finish_batch(0)
        store.admit([], cursor_after(n))  # a last commit that changes nothing the others need


def _pages(path: Path, flags: int) -> list[int]:
    data = (path / "data.mdb").read_bytes()
    return [n for n in range(2, len(data) // PAGE) if struct.unpack_from("<H", data, n * PAGE + 10)[0] == flags]


def _scribble(path: Path, page: int, *, start: int = 16, seed: int = 0) -> None:
    rng = random.Random(seed)
    with (path / "data.mdb").open("r+b") as fh:
        fh.seek(page * PAGE + start)
        fh.write(bytes(rng.randrange(256) for _ in range(PAGE - start)))


def _state_of_everything(path: Path) -> tuple[Cursor, int, set[str], set[str]]:
    with LmdbStore(path, readonly=True) as store:
        return (
            store.cursor(),
            store.trained_step(),
            {g.group_id for g in store.groups(GroupState.PARTIAL)}
            | {g.group_id for g in store.groups(GroupState.RUNNING)},
            {g.group_id for g in store.groups(GroupState.READY)},
        )


def _seed_from(path: Path, target: Path) -> LmdbStore:
    salvaged = salvage_store(path)
    store = LmdbStore(target, sync=False)
    trained = -1 if salvaged.trained_step is None else salvaged.trained_step
    store.seed(salvaged.cursor or Cursor(), trained, partial=salvaged.partial, ready=salvaged.ready)
    return store


@pytest.mark.parametrize("page", [0, 1])
def test_a_damaged_meta_page_is_named_and_the_other_one_still_reads_everything(tmp_path: Path, page: int) -> None:
    path = tmp_path / "s"
    _fill(path)
    cursor, trained, unfinished, ready = _state_of_everything(path)
    before = (path / "data.mdb").read_bytes()
    _scribble(path, page, start=16)  # the case: "Cannot allocate memory" from LMDB
    with pytest.raises(StoreCorruptionError, match=f"meta page {page}: ") as info:
        LmdbStore(path)
    assert info.value.where == str(path / "data.mdb")
    with pytest.raises(StoreCorruptionError, match=f"meta page {page}"):
        LmdbStore(path, readonly=True)
    salvaged = salvage_store(path)
    assert f"meta page {page} is damaged" in salvaged.problems[0]
    assert (salvaged.cursor, salvaged.trained_step) == (cursor, trained)
    assert {g.group_id for g in salvaged.partial} == unfinished and {g.group_id for g in salvaged.ready} == ready
    assert (path / "data.mdb").read_bytes()[PAGE * 2 :] == before[PAGE * 2 :], "salvage wrote to the damaged file"
    with _seed_from(path, tmp_path / "fresh") as store:  # and a fresh store continues from it
        assert store.cursor() == cursor and store.trained_step() == trained
        assert store.take_batch(trained + 1, 4) is not None and len(store.claim_partial(100)) == len(unfinished)


def test_damaged_branch_pages_are_found_on_open_and_the_meta_records_salvaged(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _fill(path, n=400)
    branches = _pages(path, P_BRANCH)
    assert branches, "the store is too small to have branch pages"
    for seed, page in enumerate(branches):
        _scribble(path, page, seed=seed)
    with pytest.raises(StoreCorruptionError, match="the groups tree is damaged: page [0-9]+: a node offset"):
        LmdbStore(path)
    salvaged = salvage_store(path)
    assert (salvaged.cursor, salvaged.trained_step) == (cursor_after(400), 0)
    assert any("damaged" in p for p in salvaged.problems)


def test_a_damaged_record_in_a_leaf_page_is_quarantined_and_named_by_verify(tmp_path: Path, capsys) -> None:
    path = tmp_path / "s"
    _fill(path)
    victim = fresh(30).group_id  # a PARTIAL group
    with LmdbStore(path, readonly=True) as store:
        assert store.get(victim)[0] is GroupState.PARTIAL
    env = lmdb.open(str(path), max_dbs=len(keys.DATABASES), readonly=True, lock=False)
    with env.begin() as txn:
        value = bytes(txn.get(victim.encode(), db=env.open_db(keys.GROUPS, txn=txn, create=False)))
    env.close()
    data = bytearray((path / "data.mdb").read_bytes())
    hits = 0
    at = data.find(value)
    while at >= 0:  # every copy LMDB keeps (copy-on-write leaves old ones in free pages)
        data[at + OVERHEAD + 20] ^= 0x40
        hits += 1
        at = data.find(value, at + 1)
    assert hits
    (path / "data.mdb").write_bytes(bytes(data))

    assert replay([str(path), "verify"]) == 1
    out = capsys.readouterr().out
    assert f"groups/{victim}" in out and "checksum mismatch" in out and "1 damaged" in out
    assert replay([str(path), "summary"]) == 0  # reports it and goes on
    out = capsys.readouterr().out
    assert f"groups/{victim}" in out and "groups: 40 in all" in out
    assert replay([str(path), "group", victim]) == 1
    assert f"group {victim}: damaged" in capsys.readouterr().out

    with LmdbStore(path) as store:  # the store still opens: the damage is one record
        served = store.claim_partial(100)
        assert victim not in {g.group_id for g in served} and len(served) == 15
        assert store.count(GroupState.QUARANTINED) == 1
        assert store.requeue_quarantined(lambda gid: fresh(int(gid[-4:]))) == 1
        [again] = store.claim_partial(1)
        assert again.group_id == f"{victim}.requeued" and again.task == fresh(30).task


def test_a_truncated_file_is_named_as_such(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _fill(path, n=200)
    data = path / "data.mdb"
    size = data.stat().st_size
    with data.open("r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(StoreCorruptionError, match="past the end of the .*-byte file"):
        LmdbStore(path)
    salvaged = salvage_store(path)  # nothing can be trusted past the cut: said, not guessed
    assert salvaged.problems
    with data.open("r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(StoreCorruptionError, match="too short to hold LMDB's two meta pages"):
        LmdbStore(path)


def test_a_store_of_a_newer_layout_is_refused_naming_both_and_never_interpreted(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _fill(path)
    env = lmdb.open(str(path), max_dbs=len(keys.DATABASES))
    with env.begin(write=True) as txn:
        txn.put(keys.META_LAYOUT, layout_value(3), db=env.open_db(keys.META, txn=txn))
    env.close()
    for readonly in (False, True):
        with pytest.raises(IncompatibleStoreError, match="newer rollout-pipeline .*layout 3.*reads layouts 1 to 2"):
            LmdbStore(path, readonly=readonly)
    salvaged = salvage_store(path)
    assert (salvaged.cursor, salvaged.trained_step, salvaged.partial) == (None, None, ())
    assert salvaged.groups_lost, "nothing was read: the states must not read as saying nothing was in flight"
    assert "layout 3" in salvaged.problems[0]


def _to_layout_1(path: Path) -> None:
    """What the previous version wrote: the same records, unsealed, and an 8-byte layout record
    (and no prompt histories: that version kept none)."""
    env = lmdb.open(str(path), max_dbs=len(keys.DATABASES) + len(keys.OPTIONAL_DATABASES))
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(keys.HISTORY, txn=txn), delete=True)
        for name in (keys.META, keys.GROUPS, keys.STATE, keys.BATCHES, keys.LEASES, keys.TOMBSTONES):
            db = env.open_db(name, txn=txn)
            for key, value in list(txn.cursor(db=db).iternext(keys=True, values=True)):
                if name == keys.META and bytes(key) == keys.META_LAYOUT:
                    continue
                txn.put(bytes(key), bytes(value)[OVERHEAD:], db=db)
        txn.put(keys.META_LAYOUT, keys.i64_value(1), db=env.open_db(keys.META, txn=txn))
    env.close()


def test_a_store_of_the_previous_layout_is_read_as_it_is_and_migrated_by_a_writer(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _fill(path)
    expected = _state_of_everything(path)
    _to_layout_1(path)
    with LmdbStore(path, readonly=True) as store:  # a reader reads it as it is
        assert store.verify().ok
    assert _state_of_everything(path) == expected
    with LmdbStore(path) as store:  # a writer migrates it: every value sealed from now on
        assert store.verify().ok
        store.put_ready(finished(fresh(36), 0))
    env = lmdb.open(str(path), max_dbs=len(keys.DATABASES), readonly=True, lock=False)
    with env.begin() as txn:
        key = fresh(0).group_id.encode()
        value = bytes(txn.get(key, db=env.open_db(keys.GROUPS, txn=txn, create=False)))
        assert value == seal(key, value[OVERHEAD:])
    env.close()


def test_verify_of_a_sound_store_and_of_counters_that_disagree(tmp_path: Path, capsys) -> None:
    path = tmp_path / "s"
    _fill(path)
    assert replay([str(path), "verify"]) == 0
    assert "nothing damaged" in capsys.readouterr().out
    env = lmdb.open(str(path), max_dbs=len(keys.DATABASES))
    with env.begin(write=True) as txn:
        counts = dict.fromkeys(GroupState, 0) | {GroupState.READY: 99}
        txn.put(keys.META_COUNTS, seal(keys.META_COUNTS, keys.counts_value(counts)), db=env.open_db(keys.META, txn=txn))
    env.close()
    with pytest.raises(StoreCorruptionError, match="meta/counts.*the counters say"):
        LmdbStore(path)


def test_seed_starts_only_an_empty_store_in_both_stores(tmp_path: Path) -> None:
    for store in (MemoryStore(), LmdbStore(tmp_path / "s", sync=False)):
        with store:
            store.seed(cursor_after(9), 4, partial=[generated(fresh(7), 3)], ready=[finished(fresh(8), 4)])
            assert (store.cursor(), store.trained_step(), store.statistics().collected_step) == (cursor_after(9), 4, 4)
            assert store.take_batch(5, 1).groups[0].group_id == fresh(8).group_id
            with pytest.raises(Exception, match="only an empty store can be seeded"):
                store.seed(Cursor(), -1)
            with pytest.raises(Exception, match="already exists"):
                store.admit([fresh(7)], cursor_after(10))


def test_seed_with_batches_to_train_again_in_both_stores(tmp_path: Path) -> None:
    """A salvage's batches of the steps after the checkpoint enter as trained steps, with their
    metrics records, so a resume trains them again; the steps before count as collected."""
    for store in (MemoryStore(), LmdbStore(tmp_path / "s", sync=False)):
        with store:
            with pytest.raises(ValueError, match="last trained steps"):
                store.seed(cursor_after(9), 4, replay=[(Batch(3, (finished(fresh(0), 3),)), None)])
            step_3, step_4 = (finished(fresh(0), 3), finished(fresh(1), 3)), (finished(fresh(2), 4),)
            replay = [(Batch(3, step_3), {"version": 3}), (Batch(4, step_4), None)]
            store.seed(cursor_after(9), 4, partial=[generated(fresh(7), 4)], replay=replay)
            stats = store.statistics()
            assert (stats.trained_step, stats.collected_step, stats.counts[GroupState.TRAINED]) == (4, 2, 3)
            assert store.batch(3).groups == step_3 and store.batch(4).groups == step_4
            assert store.step_metrics() == {3: {"version": 3}} and store.batch(2) is None
            assert store.coverage(2).unsettled == (fresh(7).group_id, *(g.group_id for g in (*step_3, *step_4)))


def test_damaged_in_batch_names_a_damaged_group_of_a_trained_batch_by_its_checksum(tmp_path: Path) -> None:
    """What a resume checks in the batches it trains again: the checksums alone, each record read
    where LMDB keeps it (no decoding), in both stores; a step without a batch record is None."""
    path = tmp_path / "s"
    _fill(path)
    with LmdbStore(path, readonly=True) as store:
        ids = [g.group_id for g in store.batch(0).groups]
        assert store.damaged_in_batch(0) == [] and store.damaged_in_batch(1) is None
    victim = ids[2]
    env = lmdb.open(str(path), max_dbs=len(keys.DATABASES), readonly=True, lock=False)
    with env.begin() as txn:
        value = bytes(txn.get(victim.encode(), db=env.open_db(keys.GROUPS, txn=txn, create=False)))
    env.close()
    data = bytearray((path / "data.mdb").read_bytes())
    at = data.find(value)
    while at >= 0:
        data[at + OVERHEAD + 20] ^= 0x40
        at = data.find(value, at + 1)
    (path / "data.mdb").write_bytes(bytes(data))
    with LmdbStore(path, readonly=True) as store:
        [(gid, error)] = store.damaged_in_batch(0)
        assert gid == victim and "checksum mismatch" in str(error) and f"groups/{victim}" in str(error)
        errors: list = []
        assert victim not in {g.group_id for g in store.batch(0, damaged=errors).groups} and len(errors) == 1

    memory = MemoryStore()
    memory.admit([fresh(i) for i in range(4)], cursor_after(4))
    for i in range(4):
        memory.put_ready(finished(fresh(i), 0))
    memory.take_batch(0, 4)
    assert memory.damaged_in_batch(0) == [] and memory.damaged_in_batch(1) is None

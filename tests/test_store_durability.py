"""What the LMDB store promises across processes, reopenings and disk trouble.

Leases and tombstones survive a reopen; a process that dies without closing loses nothing it
committed; a map that fills grows (through several doublings) or, at its cap, fails with a clear
error and no partial write; a corrupt lease names its key and changes nothing.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from core.errors import CorruptRecordError, StoreError
from core.types import FinishReason, Group, PromptTask, Segment
from storage import GroupState, Lease, LmdbStore, RecoveryReport, keys, lmdb_env

from .test_store import cursor_after, finished, fresh, generated

RUNNING, PARTIAL, READY, TRAINED = GroupState.RUNNING, GroupState.PARTIAL, GroupState.READY, GroupState.TRAINED


def group_sized(index: int, *, tokens: int = 1024, n: int = 8) -> Group:
    """A group as a real run stores it: 8 samples x 1k response tokens (about 100 KB encoded)."""
    task = PromptTask(index=index, prompt_ids=tuple(range(64)), label="x", metadata={})
    group = Group.fresh(task, epoch=0, n_samples=n, version=0, seq=index)
    samples = []
    for s in group.samples:
        ids = tuple((index * 31 + s.index * 7 + i) % 50_000 for i in range(tokens))
        lps = tuple(-0.001 * (i % 97) for i in range(tokens))
        segment = Segment(ids, lps, FinishReason.ABORT, 0)
        samples.append(s.resumed().extended(segment, max_response_len=tokens * 2))
    return group.with_samples(samples)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_leases_survive_a_reopen_and_expire_by_the_new_clock(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with LmdbStore(path, clock=Clock(100.0)) as store:
        store.admit([fresh(0), fresh(1)], cursor_after(2), owner="p1", lease_seconds=10.0)
        store.admit([fresh(2)], cursor_after(3), owner="p2", lease_seconds=30.0)
    clock = Clock(120.0)
    with LmdbStore(path, clock=clock) as store:
        assert store.lease(fresh(0).group_id) == Lease("p1", 110.0)
        assert store.reclaim_expired() == 2  # p1's expired while the store was closed
        assert store.lease(fresh(2).group_id) == Lease("p2", 130.0)
        assert store.count(PARTIAL) == 2 and store.count(RUNNING) == 1


def test_collected_groups_stay_refused_after_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with LmdbStore(path) as store:
        store.admit([fresh(i) for i in range(4)], cursor_after(4))
        for i in range(4):
            store.put_ready(finished(fresh(i), 0))
        store.take_batch(0, 2)
        store.take_batch(1, 2)
        store.finish_batch(0)
        assert store.collect_garbage(0) == 2
    with LmdbStore(path) as store:
        stats = store.statistics()
        assert (stats.collected, stats.collected_step, stats.trained_step) == (2, 0, 0)
        assert stats.counts[GroupState.BATCHED] == 2 and stats.counts[TRAINED] == 0
        with pytest.raises(StoreError, match="trained at step 0, then collected"):
            store.admit([fresh(0)], cursor_after(5))
        assert store.recover() == RecoveryReport(running_to_partial=0, batched_to_ready=2)
    with LmdbStore(path, readonly=True) as ro:
        assert ro.statistics().collected == 2 and ro.get(fresh(1).group_id) is None


def test_collected_space_is_reused(tmp_path: Path) -> None:
    """Deleting trained groups frees their pages: a second round of the same size fits in them."""
    with LmdbStore(tmp_path / "s", sync=False) as store:

        def one_round(start: int, step: int) -> None:
            groups = [group_sized(i, tokens=256) for i in range(start, start + 20)]
            store.admit([fresh(g.task.index) for g in groups], cursor_after(start + 20))
            for g in groups:
                store.put_ready(g)
            store.take_batch(step, 20)
            store.finish_batch(step)

        one_round(0, 0)
        after_first = store.statistics().bytes_used
        store.collect_garbage(0)
        one_round(20, 1)
        after_second = store.statistics().bytes_used
        assert after_first > 20 * 8 * 256 * 12  # the round really took that much room
        assert after_second < after_first * 1.25  # without collection it would be about 2x


def test_a_killed_writer_loses_nothing_it_committed(tmp_path: Path) -> None:
    """A process that dies without closing (no atexit, no flush) keeps every committed transaction."""
    path = tmp_path / "s"
    code = f"""
import os
from storage import LmdbStore
from tests.test_store import cursor_after, fresh, generated
store = LmdbStore({str(path)!r})
store.admit([fresh(0), fresh(1)], cursor_after(2), owner="p1", lease_seconds=60.0)
store.put_partial(generated(fresh(0), 0))
os._exit(0)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr
    with LmdbStore(path) as store:  # the dead writer's flock went with its process
        assert store.get(fresh(0).group_id) == (PARTIAL, generated(fresh(0), 0))
        assert store.lease(fresh(1).group_id).owner == "p1"
        assert store.recover() == RecoveryReport(running_to_partial=1, batched_to_ready=0)
        assert store.cursor() == cursor_after(2)


def test_the_map_grows_through_several_doublings_with_group_sized_records(tmp_path: Path) -> None:
    start = 1 << 20
    groups = [group_sized(i) for i in range(40)]  # ~4 MB encoded: at least two doublings past 1 MiB
    with LmdbStore(tmp_path / "s", map_size=start, sync=False) as store:
        store.admit([fresh(g.task.index) for g in groups], cursor_after(40))
        sizes = set()
        for g in groups:
            store.put_partial(g)
            sizes.add(store.statistics().map_size)
        stats = store.statistics()
        assert stats.map_size >= 4 * start and len(sizes) >= 3  # grew, one doubling at a time
        assert stats.bytes_used > 3 * start and stats.counts[PARTIAL] == 40
    with LmdbStore(tmp_path / "s", map_size=start) as store:  # reopening with the old size adopts the new
        assert list(store.groups(PARTIAL)) == groups


def test_a_map_at_its_cap_fails_clearly_and_keeps_everything_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lmdb_env, "MAX_MAP_SIZE", 1 << 20)
    with LmdbStore(tmp_path / "s", map_size=1 << 20, sync=False) as store:
        store.admit([fresh(i) for i in range(20)], cursor_after(20))
        stored = 0
        with pytest.raises(StoreError, match=r"the map is full at 1048576 bytes and may not grow further"):
            for i in range(20):
                store.put_partial(group_sized(i))
                stored += 1
        assert 0 < stored < 20
        assert store.count(PARTIAL) == stored and store.count(RUNNING) == 20 - stored
        assert store.get(fresh(stored).group_id) == (RUNNING, fresh(stored))  # the failed put left no trace
        store.put_ready(finished(fresh(stored), 0))  # small writes still fit
    with LmdbStore(tmp_path / "s") as store:  # and a bigger cap lets the run go on
        store.put_partial(group_sized(stored + 1))
        assert store.count(PARTIAL) == stored + 1


def test_a_corrupt_lease_names_its_key_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with LmdbStore(path) as store:
        store.admit([fresh(0), fresh(1)], cursor_after(2), owner="p1", lease_seconds=5.0)
    victim = fresh(1).group_id
    env = lmdb.open(str(path), max_dbs=len(keys.DATABASES))
    with env.begin(write=True) as txn:
        txn.put(victim.encode(), b"\x01", db=env.open_db(keys.LEASES, txn=txn))
    env.close()
    with LmdbStore(path, clock=Clock(math.inf)) as store:
        with pytest.raises(CorruptRecordError) as info:
            store.reclaim_expired()
        assert info.value.key == f"leases/{victim}"
        with pytest.raises(CorruptRecordError, match=victim):
            store.renew_leases("p1", 5.0)
        assert store.count(RUNNING) == 2 and store.count(PARTIAL) == 0
        assert store.recover() == RecoveryReport(running_to_partial=2, batched_to_ready=0)  # recovery still works
        assert store.lease(victim) is None

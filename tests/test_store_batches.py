"""Many groups in one store call: `put_ready_groups` and `put_rejected_groups`.

Held against both stores (real LMDB files under tmp_path): a batch put leaves the store exactly as
the same puts one by one would, in one transaction; a batch with any bad group (named twice, not
running, leased to someone else) stores nothing and names that group; a batch survives a reopen;
and a process SIGKILLed in the middle of a batch's transaction leaves every group as it was, so
`recover()` requeues them all and nothing is half-stored (the exactly-once argument).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from core.errors import StoreError
from core.types import Group
from storage import AsyncStore, Cursor, GroupState, LmdbStore, MemoryStore, Store
from tests.test_store import finished, fresh

ROOT = Path(__file__).resolve().parent.parent
RUNNING, PARTIAL, READY, REJECTED = GroupState.RUNNING, GroupState.PARTIAL, GroupState.READY, GroupState.REJECTED


def _open(kind: str, path: Path) -> Store:
    return MemoryStore() if kind == "memory" else LmdbStore(path, map_size=1 << 24)


@pytest.fixture(params=["memory", "lmdb"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def stores(kind: str, tmp_path: Path) -> Iterator[tuple[Store, Store]]:
    a, b = _open(kind, tmp_path / "a"), _open(kind, tmp_path / "b")
    yield a, b
    a.close()
    b.close()


def _admitted(store: Store, n: int) -> list[Group]:
    groups = [fresh(i) for i in range(n)]
    store.admit(groups, Cursor(0, n, n))
    return [finished(g, 0) for g in groups]


def _rejected(group: Group) -> Group:
    return dataclasses.replace(group, rejected_reason="same rewards")


def _snapshot(store: Store) -> tuple[object, ...]:
    counts = {s: store.count(s) for s in GroupState}
    ready = list(store.groups(READY))
    rejected = sorted(store.groups(REJECTED), key=lambda g: g.group_id)
    return counts, ready, rejected, store.lease(fresh(0).group_id)


def test_a_batch_put_equals_the_same_puts_one_by_one(stores: tuple[Store, Store]) -> None:
    batched, single = stores
    groups = _admitted(batched, 6)
    assert _admitted(single, 6) == groups
    before = batched.statistics().transactions

    batched.put_ready_groups([groups[3], groups[0], groups[5]])
    batched.put_rejected_groups([_rejected(groups[1]), _rejected(groups[4])])
    for g in (groups[3], groups[0], groups[5]):
        single.put_ready(g)
    for g in (groups[1], groups[4]):
        single.put_rejected(_rejected(g))

    assert batched.statistics().transactions - before == 2  # one per call, not one per group
    assert _snapshot(batched) == _snapshot(single)
    assert [g.group_id for g in batched.groups(READY)] == [groups[i].group_id for i in (0, 3, 5)]  # FIFO by seq
    assert batched.get(groups[2].group_id) == (RUNNING, fresh(2))  # not in any batch: untouched
    assert batched.take_batch(0, 3) == single.take_batch(0, 3)


def test_a_group_named_twice_in_one_batch_is_refused_and_nothing_is_stored(stores: tuple[Store, Store]) -> None:
    store, _ = stores
    groups = _admitted(store, 3)
    before = _snapshot(store)
    with pytest.raises(StoreError, match=re.escape(f"{groups[1].group_id!r} appears twice in one put of ready groups")):
        store.put_ready_groups([groups[0], groups[1], groups[2], groups[1]])
    with pytest.raises(StoreError, match=re.escape(f"{groups[0].group_id!r} appears twice in one put of rejected")):
        store.put_rejected_groups([_rejected(groups[0]), _rejected(groups[0])])
    assert _snapshot(store) == before
    assert all(store.get(g.group_id) == (RUNNING, fresh(i)) for i, g in enumerate(groups))


@pytest.mark.parametrize("bad", ["ready", "unknown", "leased"])
def test_one_bad_group_refuses_the_whole_batch_naming_it(stores: tuple[Store, Store], bad: str) -> None:
    store, _ = stores
    groups = _admitted(store, 4)
    owner = None
    if bad == "ready":  # already moved on: it is not running any more
        store.put_ready(groups[2])
        culprit, message = groups[2], "is ready, not running"
    elif bad == "unknown":
        culprit, message = finished(fresh(99), 0), "is not in the store"
    else:  # its lease went to another owner: the batch's owner may not store it
        store.reclaim_expired(float("inf"))
        claimed = store.claim_partial(4, owner="p1", lease_seconds=60.0)
        assert {g.group_id for g in claimed} == {g.group_id for g in groups}
        store.hand_over(groups[2].group_id, owner="p1", to="p2", lease_seconds=60.0)
        culprit, message, owner = groups[2], "is leased to 'p2', not 'p1'", "p1"
    before = _snapshot(store)
    batch = [groups[0], groups[1], culprit, groups[3]]
    with pytest.raises(StoreError, match=re.escape(f"{culprit.group_id!r} {message}")):
        store.put_ready_groups(batch, owner=owner)
    assert _snapshot(store) == before
    assert store.count(READY) == (1 if bad == "ready" else 0)


def test_an_empty_batch_is_no_transaction(stores: tuple[Store, Store]) -> None:
    store, _ = stores
    _admitted(store, 1)
    before = store.statistics().transactions
    store.put_ready_groups([])
    store.put_rejected_groups([])
    assert store.statistics().transactions == before


def test_a_batch_survives_a_reopen_and_a_refused_one_left_nothing(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with LmdbStore(path) as store:
        groups = _admitted(store, 5)
        store.put_ready_groups(groups[:3])
        with pytest.raises(StoreError, match="appears twice"):
            store.put_rejected_groups([_rejected(groups[3]), _rejected(groups[3])])
    with LmdbStore(path) as store:
        assert store.verify().ok
        assert list(store.groups(READY)) == groups[:3]  # read back from disk, not the ready cache
        assert store.count(RUNNING) == 2 and store.count(REJECTED) == 0
        store.put_rejected_groups([_rejected(groups[3]), _rejected(groups[4])])
    with LmdbStore(path, readonly=True) as store:
        assert store.count(REJECTED) == 2 and store.count(RUNNING) == 0
        assert store.verify().ok


@pytest.mark.anyio
async def test_a_refused_batch_in_a_commit_group_leaves_the_others_committed(tmp_path: Path) -> None:
    """Group commit: a batch call that fails after writing aborts the shared transaction, which
    runs again without it; the other callers' batches are stored, the refused one is not."""
    store = LmdbStore(tmp_path / "store")
    groups = _admitted(store, 6)
    astore = AsyncStore(store)
    outcomes: dict[str, str] = {}

    async def put(name: str, batch: list[Group]) -> None:
        try:
            await astore.put_ready_groups(batch)
            outcomes[name] = "stored"
        except StoreError as exc:
            outcomes[name] = str(exc)

    async with astore:
        store.put_ready(groups[5])  # so the middle batch fails inside the transaction, after writing
        async with anyio.create_task_group() as tg:
            tg.start_soon(put, "first", groups[0:2])
            tg.start_soon(put, "bad", [groups[2], groups[5]])
            tg.start_soon(put, "last", groups[3:5])
        assert outcomes["first"] == outcomes["last"] == "stored"
        assert f"{groups[5].group_id!r} is ready, not running" in outcomes["bad"]
        assert await astore.get(groups[2].group_id) == (RUNNING, fresh(2))
        assert await astore.count(READY) == 5
        grouping = astore.group_commit_statistics()
        assert grouping is not None and grouping.largest >= 2  # the refused batch did share a transaction


class _StoreBeforeBatches:
    """A custom store written before the batched moves existed: every method but those two."""

    def __init__(self) -> None:
        self.inner = MemoryStore()
        self.moves: list[str] = []

    def put_ready(self, group: Group, **kwargs: object) -> None:
        self.moves.append(f"ready {group.group_id}")
        self.inner.put_ready(group, **kwargs)  # type: ignore[arg-type]

    def put_rejected(self, group: Group, **kwargs: object) -> None:
        self.moves.append(f"rejected {group.group_id}")
        self.inner.put_rejected(group, **kwargs)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> object:
        if name.endswith("_groups"):
            raise AttributeError(name)
        return getattr(self.inner, name)


@pytest.mark.anyio
async def test_a_store_without_batched_moves_gets_them_one_by_one() -> None:
    """The collector and filter always call the batched moves; a store that lacks them still works
    (each group its own move, in order) instead of failing mid-run."""
    old = _StoreBeforeBatches()
    groups = _admitted(old.inner, 4)
    astore = AsyncStore(old)  # type: ignore[arg-type]
    async with astore:
        await astore.put_ready_groups([groups[2], groups[0]])
        await astore.put_rejected_groups([_rejected(groups[3])])
        assert old.inner.count(READY) == 2 and old.inner.count(REJECTED) == 1 and old.inner.count(RUNNING) == 1
    ids = [g.group_id for g in groups]
    assert old.moves == [f"ready {ids[2]}", f"ready {ids[0]}", f"rejected {ids[3]}"]


_KILLED_MID_BATCH = """
    import os, signal, sys
    import storage.lmdb_txn as lmdb_txn
    from storage import LmdbStore
    from tests.test_store import finished, fresh

    moves = 0
    real_move = lmdb_txn.Txn.move

    def move(self, *args, **kwargs):
        # The third group of the batch: two are written into the open transaction, not committed.
        global moves
        moves += 1
        if moves == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_move(self, *args, **kwargs)

    lmdb_txn.Txn.move = move
    store = LmdbStore(sys.argv[1])
    store.put_ready_groups([finished(fresh(i), 0) for i in range(5)])
    print("the batch committed: the kill never came")
"""


def test_a_sigkill_in_the_middle_of_a_batch_stores_none_of_it_and_recover_requeues_all(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with LmdbStore(path) as store:
        groups = _admitted(store, 5)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_MID_BATCH), str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    with LmdbStore(path) as store:
        assert store.verify().ok
        assert store.count(READY) == 0 and store.count(RUNNING) == 5  # not one of the batch is ready
        report = store.recover()
        assert report.running_to_partial == 5
        # Every group comes back once, as it was admitted (no tokens stored from the lost batch).
        assert sorted(g.group_id for g in store.groups(PARTIAL)) == sorted(g.group_id for g in groups)
        assert store.take_batch(0, 1) is None


# --- the Ray producers' moves: many leases handed out, a producer's results taken back ---------------

FAILED = GroupState.FAILED


def _leased(store: Store, n: int, to: str = "p1") -> list[Group]:
    """`n` groups admitted by the controller and handed to producer `to`, one by one."""
    groups = [fresh(i) for i in range(n)]
    store.admit(groups, Cursor(0, n, n))
    for g in groups:
        store.hand_over(g.group_id, owner="controller", to=to, lease_seconds=60.0)
    return groups


def _leases(store: Store, n: int) -> list[tuple[str, float] | None]:
    out = []
    for i in range(n):
        lease = store.lease(fresh(i).group_id)
        out.append(None if lease is None else (lease.owner, lease.expires_at))
    return out


def _owners(store: Store, n: int) -> list[str | None]:
    return [owner for owner, _ in (lease or (None, 0.0) for lease in _leases(store, n))]


def test_hand_over_groups_equals_the_same_hand_overs_one_by_one(kind: str, tmp_path: Path) -> None:
    now = [1000.0]
    a = MemoryStore(clock=lambda: now[0]) if kind == "memory" else LmdbStore(tmp_path / "a", clock=lambda: now[0])
    b = MemoryStore(clock=lambda: now[0]) if kind == "memory" else LmdbStore(tmp_path / "b", clock=lambda: now[0])
    with a, b:
        groups = [fresh(i) for i in range(5)]
        for store in (a, b):
            store.admit(groups, Cursor(0, 5, 5))
        before = a.statistics().transactions
        a.hand_over_groups(
            [groups[3].group_id, groups[0].group_id, groups[4].group_id],
            owner="controller",
            to="p1",
            lease_seconds=30.0,
        )
        for i in (3, 0, 4):
            b.hand_over(groups[i].group_id, owner="controller", to="p1", lease_seconds=30.0)
        assert a.statistics().transactions - before == 1  # one transaction for the three
        assert _leases(a, 5) == _leases(b, 5)
        assert _owners(a, 5) == ["p1", "controller", "controller", "p1", "p1"]
        assert [a.get(g.group_id) for g in groups] == [b.get(g.group_id) for g in groups]  # records untouched
        a.hand_over_groups([], owner="controller", to="p1", lease_seconds=30.0)
        assert a.statistics().transactions - before == 1  # no groups, no transaction


@pytest.mark.parametrize("bad", ["not_held", "twice", "unknown", "partial"])
def test_hand_over_groups_with_one_group_not_held_changes_nothing_and_names_it(
    stores: tuple[Store, Store], bad: str
) -> None:
    store, _ = stores
    groups = [fresh(i) for i in range(4)]
    store.admit(groups, Cursor(0, 4, 4))
    ids = [g.group_id for g in groups]
    if bad == "not_held":  # already handed to p2: the controller no longer holds it
        store.hand_over(ids[2], owner="controller", to="p2", lease_seconds=60.0)
        batch, message = ids, f"{ids[2]!r} is leased to 'p2', not 'controller'"
    elif bad == "twice":
        batch, message = [ids[0], ids[1], ids[0]], f"{ids[0]!r} appears twice in one hand-over to 'p1'"
    elif bad == "unknown":
        batch, message = [ids[0], "nobody-knows-me"], "'nobody-knows-me' is not in the store"
    else:
        store.put_partial(groups[2])
        batch, message = ids, f"{ids[2]!r} is partial, not running"
    before = (_leases(store, 4), _snapshot(store), store.count(PARTIAL))
    with pytest.raises(StoreError, match=re.escape(message)):
        store.hand_over_groups(batch, owner="controller", to="p1", lease_seconds=60.0)
    assert (_leases(store, 4), _snapshot(store), store.count(PARTIAL)) == before
    assert "p1" not in _owners(store, 4)


def _results(groups: list[Group]) -> list[tuple[GroupState, Group]]:
    """One result of each kind: accepted (its lease back), partial, rejected, failed, accepted."""
    g = groups
    return [
        (RUNNING, finished(g[0], 0)),
        (PARTIAL, finished(g[1], 0)),
        (REJECTED, _rejected(finished(g[2], 0))),
        (FAILED, finished(g[3], 0)),
        (RUNNING, finished(g[4], 0)),
    ]


def test_accept_results_commits_a_batch_in_one_transaction(stores: tuple[Store, Store]) -> None:
    store, single = stores
    groups = _leased(store, 5)
    assert _leased(single, 5) == groups
    results = _results(groups)
    before = store.statistics().transactions

    assert store.accept_results("p1", results) == {}

    assert store.statistics().transactions - before == 1
    assert _owners(store, 5) == ["controller", None, None, None, "controller"]
    assert store.get(groups[0].group_id) == (RUNNING, groups[0])  # handed back: the record is unchanged
    assert store.get(groups[1].group_id) == (PARTIAL, results[1][1])
    assert store.get(groups[2].group_id) == (REJECTED, results[2][1])
    assert store.get(groups[3].group_id) == (FAILED, results[3][1])
    # The same as the single moves one by one (the path a store without accept_results takes).
    single.hand_over(groups[0].group_id, owner="p1", to="controller", lease_seconds=float("inf"))
    single.put_partial(results[1][1], owner="p1")
    single.put_rejected(results[2][1], owner="p1")
    single.put_failed(results[3][1], owner="p1")
    single.hand_over(groups[4].group_id, owner="p1", to="controller", lease_seconds=float("inf"))
    assert _snapshot(store) == _snapshot(single)
    assert [store.get(g.group_id) for g in groups] == [single.get(g.group_id) for g in groups]


def test_accept_results_fences_a_reassigned_group_and_commits_the_others(stores: tuple[Store, Store]) -> None:
    """A producer's batch holds a group whose lease expired and went to p2 meanwhile: that one is
    refused, named, and left as p2 has it; every other result of the batch is committed. The
    controller trains the fenced group only through p2, so nothing is trained twice."""
    store, _ = stores
    groups = _leased(store, 5)
    store.renew_leases("p1", 1e-6)  # p1 went quiet; its leases ran out ...
    assert store.reclaim_expired(float("inf")) == 5
    again = store.claim_partial(1, owner="controller")  # ... and group 0 was served again, to p2
    assert [g.group_id for g in again] == [groups[0].group_id]
    store.hand_over(groups[0].group_id, owner="controller", to="p2", lease_seconds=60.0)
    # Groups 1-4 were claimed back by p1 (a fresh lease), then its late batch arrives with group 0 in it.
    store.claim_partial(4, owner="p1", lease_seconds=60.0)

    refused = store.accept_results("p1", _results(groups))

    assert list(refused) == [groups[0].group_id]
    assert "leased to 'p2', not 'p1'" in refused[groups[0].group_id]
    assert store.lease(groups[0].group_id).owner == "p2"  # type: ignore[union-attr]
    assert store.get(groups[0].group_id) == (RUNNING, groups[0])  # p1's tokens never landed
    assert [store.get(g.group_id)[0] for g in groups[1:]] == [PARTIAL, REJECTED, FAILED, RUNNING]  # type: ignore[index]
    assert store.lease(groups[4].group_id).owner == "controller"  # type: ignore[union-attr]
    # A result for a group no longer running (already stored) is fenced the same way.
    refused = store.accept_results("p1", [(PARTIAL, finished(groups[1], 0))])
    assert f"{groups[1].group_id!r} is partial, not running" in refused[groups[1].group_id]


def test_accept_results_refuses_a_group_named_twice_or_a_state_it_has_no_move_for(stores: tuple[Store, Store]) -> None:
    store, _ = stores
    groups = _leased(store, 2)
    before = (_leases(store, 2), _snapshot(store))
    twice = [(RUNNING, groups[0]), (PARTIAL, groups[1]), (PARTIAL, groups[0])]
    with pytest.raises(StoreError, match=re.escape(f"{groups[0].group_id!r} appears twice in one batch of results")):
        store.accept_results("p1", twice)
    with pytest.raises(ValueError, match=re.escape(f"{groups[1].group_id!r}: state 'batched' is not one of")):
        store.accept_results("p1", [(RUNNING, groups[0]), (GroupState.BATCHED, groups[1])])
    assert (_leases(store, 2), _snapshot(store)) == before


def test_an_exception_in_the_middle_of_accept_results_stores_none_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import storage.lmdb_txn as lmdb_txn

    path = tmp_path / "store"
    with LmdbStore(path) as store:
        groups = _leased(store, 5)
        before = (_leases(store, 5), _snapshot(store), [store.get(g.group_id) for g in groups])
        real_move, moves = lmdb_txn.Txn.move, []

        def move(self: object, *args: object, **kwargs: object) -> None:
            moves.append(args[0])
            if len(moves) == 2:  # the rejected group: a lease and a partial are already written
                raise RuntimeError("the disk went away")
            real_move(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(lmdb_txn.Txn, "move", move)
        with pytest.raises(RuntimeError, match="the disk went away"):
            store.accept_results("p1", _results(groups))
        monkeypatch.undo()
        assert (_leases(store, 5), _snapshot(store), [store.get(g.group_id) for g in groups]) == before
    with LmdbStore(path) as store:  # and on disk
        assert store.verify().ok
        assert _owners(store, 5) == ["p1"] * 5 and store.count(RUNNING) == 5


_KILLED_MID_ACCEPT = """
    import dataclasses, os, signal, sys
    import storage.lmdb_txn as lmdb_txn
    from storage import GroupState, LmdbStore
    from tests.test_store import finished, fresh

    moves = 0
    real_move = lmdb_txn.Txn.move

    def move(self, *args, **kwargs):
        # The second put of the batch: a lease handed back and one group stored, not committed.
        global moves
        moves += 1
        if moves == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_move(self, *args, **kwargs)

    lmdb_txn.Txn.move = move
    store = LmdbStore(sys.argv[1])
    g = [fresh(i) for i in range(4)]
    store.accept_results("p1", [
        (GroupState.RUNNING, finished(g[0], 0)),
        (GroupState.PARTIAL, finished(g[1], 0)),
        (GroupState.REJECTED, dataclasses.replace(finished(g[2], 0), rejected_reason="same")),
        (GroupState.FAILED, finished(g[3], 0)),
    ])
    print("the batch committed: the kill never came")
"""


def test_a_sigkill_in_the_middle_of_accept_results_stores_none_of_it(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with LmdbStore(path) as store:
        groups = _leased(store, 4)
        before = [store.get(g.group_id) for g in groups]
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_MID_ACCEPT), str(path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    with LmdbStore(path) as store:
        assert store.verify().ok
        # Not one result landed: every group still RUNNING under p1's lease, its record as handed out.
        assert _owners(store, 4) == ["p1"] * 4
        assert [store.get(g.group_id) for g in groups] == before
        assert store.count(PARTIAL) == store.count(REJECTED) == store.count(FAILED) == 0


class _StoreBeforeProducers:
    """A custom store written before the producers' batched moves: the single moves only."""

    def __init__(self) -> None:
        self.inner = MemoryStore()
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> object:
        if name in ("hand_over_groups", "accept_results"):
            raise AttributeError(name)
        self.calls.append(name)
        return getattr(self.inner, name)


@pytest.mark.anyio
async def test_a_store_without_the_producers_batched_moves_gets_them_one_by_one() -> None:
    old = _StoreBeforeProducers()
    groups = [fresh(i) for i in range(5)]
    old.inner.admit(groups, Cursor(0, 5, 5))
    astore = AsyncStore(old)  # type: ignore[arg-type]
    async with astore:
        await astore.hand_over_groups([g.group_id for g in groups], owner="controller", to="p1", lease_seconds=60.0)
        assert _owners(old.inner, 5) == ["p1"] * 5
        old.inner.hand_over(groups[3].group_id, owner="p1", to="p2", lease_seconds=60.0)  # reassigned
        refused = await astore.accept_results("p1", _results(groups))
        assert _owners(old.inner, 5) == ["controller", None, None, "p2", "controller"]
    assert list(refused) == [groups[3].group_id] and "leased to 'p2'" in refused[groups[3].group_id]
    assert {"hand_over", "put_partial", "put_rejected", "put_failed"} <= set(old.calls)  # the single moves

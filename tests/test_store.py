"""The Store contract, held against both implementations, plus what only LMDB promises.

One suite runs over `MemoryStore` and `LmdbStore` (real files under tmp_path). A hypothesis test
drives random operation sequences through both stores and a plain reference model and requires
the same observable results from all three.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.from_thread
import lmdb
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from core.errors import (
    CorruptRecordError,
    IncompatibleStoreError,
    StoreCorruptionError,
    StoreError,
    StoreLockedError,
)
from core.types import Batch, FinishReason, Group, PromptTask, Segment
from storage import (
    AsyncStore,
    Cursor,
    GroupState,
    Lease,
    LmdbStore,
    MemoryStore,
    RecoveryReport,
    RunMeta,
    Store,
    keys,
    open_store,
)
from storage.migrate import layout_value

RUNNING, PARTIAL, READY, BATCHED, TRAINED, REJECTED, FAILED = (
    GroupState.RUNNING,
    GroupState.PARTIAL,
    GroupState.READY,
    GroupState.BATCHED,
    GroupState.TRAINED,
    GroupState.REJECTED,
    GroupState.FAILED,
)

# --- building groups with the real API --------------------------------------------------------


def fresh(index: int, *, version: int = 0, seq: int | None = None, n: int = 2) -> Group:
    task = PromptTask(index=index, prompt_ids=(7, 8, 9, index), label=str(index), metadata={"row": index})
    return Group.fresh(task, epoch=0, n_samples=n, version=version, seq=index if seq is None else seq)


def generated(group: Group, version: int, *, reason: FinishReason = FinishReason.ABORT, tokens: int = 3) -> Group:
    """`group` after one engine call per sample at policy `version`."""
    samples = []
    for s in group.samples:
        ids = tuple(100 + s.index + i for i in range(tokens))
        lps = tuple(-0.25 * (i + 1) for i in range(tokens))
        samples.append(s.resumed().extended(Segment(ids, lps, reason, version), max_response_len=64))
    return group.with_samples(samples)


def finished(group: Group, version: int) -> Group:
    done = generated(group, version, reason=FinishReason.STOP)
    return done.with_samples([dataclasses.replace(s, reward=1.0) for s in done.samples])


def ids(groups) -> list[str]:
    return [g.group_id for g in groups]


def cursor_after(n: int) -> Cursor:
    return Cursor(epoch=0, index=n, next_seq=n)


def counts(store: Store) -> dict[GroupState, int]:
    return {s: store.count(s) for s in GroupState}


# --- the shared suite ------------------------------------------------------------------------


@pytest.fixture(params=["memory", "lmdb"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s = MemoryStore() if request.param == "memory" else LmdbStore(tmp_path / "store")
    yield s
    s.close()


def test_a_new_store_is_empty(store: Store) -> None:
    assert isinstance(store, Store)
    assert store.read_meta() is None
    assert store.cursor() == Cursor()
    assert store.trained_step() == -1
    assert counts(store) == dict.fromkeys(GroupState, 0)
    assert store.get("e0000-p000000000") is None
    assert store.batch(0) is None
    assert store.claim_partial(5) == []
    assert list(store.groups(PARTIAL)) == []


def test_run_meta_is_written_once(store: Store) -> None:
    meta = RunMeta("run-a", "ds:1", "tok:1", 4, extra={"lr": 1e-6})
    store.write_meta(meta)
    assert store.read_meta() == meta
    store.write_meta(meta)  # the same run again: fine
    with pytest.raises(IncompatibleStoreError) as info:
        store.write_meta(dataclasses.replace(meta, dataset_fingerprint="ds:2"))
    assert (info.value.field, info.value.stored, info.value.given) == ("dataset_fingerprint", "ds:1", "ds:2")
    assert store.read_meta() == meta


def test_the_full_state_machine(store: Store) -> None:
    g0, g1, g2, g3 = (fresh(i) for i in range(4))
    store.admit([g0, g1, g2, g3], cursor_after(4))
    assert store.cursor() == cursor_after(4)
    assert counts(store)[RUNNING] == 4
    assert store.get(g0.group_id) == (RUNNING, g0)

    # RUNNING -> PARTIAL keeps the prefix; claim_partial brings it back RUNNING, prefix and all.
    p0 = generated(g0, 0)
    store.put_partial(p0)
    assert store.get(g0.group_id) == (PARTIAL, p0)
    assert store.claim_partial(5) == [p0]
    assert store.get(g0.group_id) == (RUNNING, p0)

    r0, r1 = finished(p0, 1), finished(g1, 1)
    store.put_ready(r0)
    store.put_ready(r1)
    rejected = dataclasses.replace(finished(g2, 1), rejected_reason="all rewards equal")
    store.put_rejected(rejected)
    store.put_failed(g3)
    assert counts(store) == {**dict.fromkeys(GroupState, 0), READY: 2, REJECTED: 1, FAILED: 1}
    assert store.get(g2.group_id) == (REJECTED, rejected)

    batch = store.take_batch(0, 2)
    assert batch == Batch(0, (r0, r1))
    assert store.get(g0.group_id) == (BATCHED, r0)
    assert store.trained_step() == -1
    store.finish_batch(0)
    assert store.trained_step() == 0
    assert counts(store) == {**dict.fromkeys(GroupState, 0), TRAINED: 2, REJECTED: 1, FAILED: 1}
    assert store.batch(0) == batch
    assert sorted(ids(store.groups(TRAINED))) == [g0.group_id, g1.group_id]


def test_illegal_transitions_are_refused_and_change_nothing(store: Store) -> None:
    g0, g1 = fresh(0), fresh(1)
    store.admit([g0, g1], cursor_after(2))
    store.put_ready(finished(g0, 0))
    before = counts(store)
    with pytest.raises(StoreError, match="not in the store"):
        store.put_ready(finished(fresh(9), 0))
    with pytest.raises(StoreError, match="is ready, not running"):
        store.put_partial(g0)
    with pytest.raises(StoreError, match="is ready, not running"):
        store.put_ready(finished(g0, 0))
    store.put_partial(generated(g1, 0))
    with pytest.raises(StoreError, match="is partial, not running"):
        store.put_failed(g1)
    assert counts(store) == {**before, RUNNING: 0, PARTIAL: 1}
    assert store.get(g0.group_id)[0] is READY


def test_admit_refuses_duplicates_and_stores_nothing(store: Store) -> None:
    g0, g1, g2 = fresh(0), fresh(1), fresh(2)
    store.admit([g0], cursor_after(1))
    stats = store.statistics()
    with pytest.raises(StoreError, match=g0.group_id):
        store.admit([g1, g0], cursor_after(2))
    with pytest.raises(StoreError, match="twice"):
        store.admit([g2, g2], cursor_after(3))
    store.put_ready(finished(g0, 0))
    store.take_batch(0, 1)
    store.finish_batch(0)
    with pytest.raises(StoreError, match="already exists"):  # in any state, trained included
        store.admit([fresh(0)], cursor_after(5))
    assert store.get(g1.group_id) is None and store.get(g2.group_id) is None
    assert store.cursor() == cursor_after(1)
    assert store.count(RUNNING) == 0
    assert store.statistics().transactions == stats.transactions + 3  # only the three that succeeded


def _staged(store: Store, put: str) -> list[Group]:
    """Six groups put PARTIAL or READY with these (oldest version, seq): the serving order is by both."""
    plan = [(2, 0), (1, 1), (1, 2), (0, 3), (2, 4), (0, 5)]
    groups = [fresh(seq, seq=seq) for _, seq in plan]
    store.admit(groups, cursor_after(len(plan)))
    out = []
    for (version, _), g in zip(plan, groups, strict=True):
        g = generated(g, version) if put == "partial" else finished(g, version)
        getattr(store, f"put_{put}")(g)
        out.append(g)
    assert [g.oldest_version for g in out] == [v for v, _ in plan]
    return out


def test_claim_partial_serves_oldest_version_then_fifo(store: Store) -> None:
    g = _staged(store, "partial")
    expected = [g[3], g[5], g[1], g[2], g[0], g[4]]
    assert list(store.groups(PARTIAL)) == expected
    assert store.claim_partial(2) == expected[:2]
    assert store.claim_partial(0) == []
    assert store.claim_partial(3) == expected[2:5]
    assert store.claim_partial(10) == expected[5:]
    assert store.claim_partial(10) == []
    assert store.count(RUNNING) == 6


def test_a_requeued_group_keeps_its_fifo_place(store: Store) -> None:
    g = _staged(store, "partial")
    first = store.claim_partial(1)[0]
    assert first == g[3]
    store.put_partial(first)  # back, unchanged: it is again the first served
    assert store.claim_partial(1) == [first]


def test_take_batch_serves_oldest_version_then_fifo(store: Store) -> None:
    g = _staged(store, "ready")
    expected = [g[3], g[5], g[1], g[2], g[0], g[4]]
    assert list(store.groups(READY)) == expected
    assert store.take_batch(0, 4) == Batch(0, tuple(expected[:4]))
    assert list(store.groups(READY)) == expected[4:]


def test_take_batch_returns_none_and_changes_nothing_when_too_few_are_ready(store: Store) -> None:
    _staged(store, "ready")
    assert store.take_batch(0, 7) is None
    assert store.count(READY) == 6 and store.batch(0) is None
    with pytest.raises(ValueError, match="size=0"):
        store.take_batch(0, 0)


def test_take_batch_for_a_taken_step_returns_the_same_batch(store: Store) -> None:
    _staged(store, "ready")
    first = store.take_batch(3, 2)
    assert store.take_batch(3, 2) == first
    assert store.take_batch(3, 5) == first  # the recorded batch wins, whatever size is asked
    assert store.count(READY) == 4 and store.count(BATCHED) == 2
    store.finish_batch(3)
    assert store.take_batch(3, 2) == first  # still, after training
    assert store.batch(3) == first
    with pytest.raises(StoreError, match="already trained"):
        store.take_batch(2, 2)


def test_finish_batch_rules(store: Store) -> None:
    _staged(store, "ready")
    with pytest.raises(StoreError, match="no batch"):
        store.finish_batch(0)
    b0, b1 = store.take_batch(0, 2), store.take_batch(1, 2)
    with pytest.raises(StoreError, match="before step 0"):
        store.finish_batch(1)
    store.finish_batch(0)
    store.finish_batch(0)  # a retry: nothing changes
    assert store.trained_step() == 0 and store.count(TRAINED) == 2
    store.finish_batch(1)
    assert store.trained_step() == 1 and store.count(TRAINED) == 4
    assert (store.batch(0), store.batch(1)) == (b0, b1)


def test_a_steps_metrics_are_stored_with_its_commit_and_outlive_garbage_collection(store: Store) -> None:
    _staged(store, "ready")
    store.take_batch(0, 2), store.take_batch(1, 2), store.take_batch(2, 2)
    # Refused before anything changes: the step stays untrained and has no record.
    with pytest.raises(ValueError, match="step 0: the metrics record is not JSON"):
        store.finish_batch(0, {"loss": object()})
    assert store.trained_step() == -1 and store.step_metrics() == {}
    store.finish_batch(0, {"step": 0, "reward/mean": 0.5, "reward/std": math.nan})
    store.finish_batch(0, {"step": 0, "reward/mean": 9.0})  # a retry changes nothing, the record included
    store.finish_batch(1)  # no record: the step is trained and has none
    store.finish_batch(2, {"step": 2, "batch/tokens": 12})
    # NaN is stored as JSON keeps it (null), the same in both stores.
    assert store.step_metrics() == {
        0: {"step": 0, "reward/mean": 0.5, "reward/std": None},
        2: {"step": 2, "batch/tokens": 12},
    }
    assert list(store.step_metrics(1)) == [2]
    store.collect_garbage(2)
    assert list(store.step_metrics()) == [0, 2]


def test_recover_requeues_running_and_untrained_batches(store: Store) -> None:
    g = _staged(store, "ready")  # READY in order g3 g5 g1 g2 g0 g4
    b0 = store.take_batch(0, 2)
    store.take_batch(1, 2)
    store.take_batch(2, 1)
    store.finish_batch(0)
    extra = [fresh(10, seq=10), fresh(11, seq=11)]
    store.admit(extra, cursor_after(12))
    store.put_partial(generated(extra[0], 1))
    claimed = store.claim_partial(1)[0]  # RUNNING again, with its prefix

    report = store.recover()
    assert report == RecoveryReport(running_to_partial=2, batched_to_ready=3)
    assert store.batch(0) == b0 and store.batch(1) is None and store.batch(2) is None
    assert store.trained_step() == 0
    assert list(store.groups(READY)) == [g[1], g[2], g[0], g[4]]
    assert list(store.groups(PARTIAL)) == [extra[1], claimed]  # version 0 (no tokens yet) before 1
    assert store.get(claimed.group_id) == (PARTIAL, claimed)
    assert counts(store) == {**dict.fromkeys(GroupState, 0), TRAINED: 2, READY: 4, PARTIAL: 2}
    assert store.recover() == RecoveryReport(0, 0)
    assert store.take_batch(1, 2) == Batch(1, (g[1], g[2]))  # step 1 is taken afresh


def test_statistics(store: Store) -> None:
    store.admit([fresh(0), fresh(1)], cursor_after(2))
    store.put_ready(finished(fresh(0), 0))
    stats = store.statistics()
    assert stats.counts == {**dict.fromkeys(GroupState, 0), RUNNING: 1, READY: 1}
    assert stats.cursor == cursor_after(2)
    assert stats.trained_step == -1
    assert stats.transactions == 2
    if isinstance(store, LmdbStore):
        assert stats.bytes_used > 0
    else:
        assert stats.bytes_used == 0


def test_a_closed_store_refuses_calls(store: Store) -> None:
    store.close()
    store.close()  # twice is fine
    with pytest.raises(StoreError, match="closed"):
        store.admit([fresh(0)], cursor_after(1))
    with pytest.raises(StoreError, match="closed"):
        store.count(READY)


# --- leases -----------------------------------------------------------------------------------


class Clock:
    """The time a store reads its lease expiry against, set by the test."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "lmdb"])
def timed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Store, Clock]]:
    clock = Clock(100.0)
    s = MemoryStore(clock=clock) if request.param == "memory" else LmdbStore(tmp_path / "store", clock=clock)
    yield s, clock
    s.close()


def test_a_lease_expires_exactly_at_its_expiry(timed: tuple[Store, Clock]) -> None:
    store, clock = timed
    g0, g1 = fresh(0), fresh(1)
    store.admit([g0, g1], cursor_after(2), owner="p1", lease_seconds=10.0)
    assert store.lease(g0.group_id) == Lease("p1", 110.0)
    prefix = generated(g0, 0)
    store.put_partial(prefix, owner="p1")
    assert store.lease(g0.group_id) is None  # a lease lives only while RUNNING
    assert store.claim_partial(1, owner="p1", lease_seconds=10.0) == [prefix]
    clock.now = 103.0
    store.admit([fresh(2)], cursor_after(3), owner="p1", lease_seconds=10.0)  # expires at 113

    just_before = math.nextafter(110.0, 0.0)
    assert store.reclaim_expired(just_before) == 0
    assert store.count(RUNNING) == 3 and store.lease(g1.group_id) == Lease("p1", 110.0)
    assert store.reclaim_expired(110.0) == 2  # g0 (claimed at 100) and g1 (admitted at 100)
    assert store.get(g0.group_id) == (PARTIAL, prefix)  # the prefix survived the lost lease
    assert store.get(g1.group_id) == (PARTIAL, g1)
    assert store.lease(g0.group_id) is None and store.lease(fresh(2).group_id) == Lease("p1", 113.0)
    clock.now = math.nextafter(113.0, 0.0)
    assert store.reclaim_expired() == 0  # now defaults to the store's clock
    clock.now = 113.0
    assert store.reclaim_expired() == 1
    # Claimable again, in serving order (all version 0: FIFO), by another owner.
    assert ids(store.claim_partial(5, owner="p2", lease_seconds=1.0)) == [g0.group_id, g1.group_id, fresh(2).group_id]
    assert store.lease(g0.group_id) == Lease("p2", 114.0)


def test_a_producer_that_lost_its_lease_cannot_write(timed: tuple[Store, Clock]) -> None:
    store, clock = timed
    g0 = fresh(0)
    store.admit([g0], cursor_after(1), owner="p1", lease_seconds=5.0)
    clock.now = 105.0
    assert store.reclaim_expired() == 1
    with pytest.raises(StoreError, match="is partial, not running"):  # reclaimed, not yet re-claimed
        store.put_ready(finished(g0, 0), owner="p1")
    (again,) = store.claim_partial(1, owner="p2", lease_seconds=5.0)
    before = store.statistics().transactions
    with pytest.raises(StoreError, match="leased to 'p2', not 'p1'"):
        store.put_ready(finished(again, 0), owner="p1")
    assert store.get(g0.group_id) == (RUNNING, g0) and store.statistics().transactions == before
    store.put_ready(finished(again, 0), owner="p2")
    assert store.get(g0.group_id)[0] is READY


def test_renew_leases_extends_one_owners_leases_only(timed: tuple[Store, Clock]) -> None:
    store, clock = timed
    store.admit([fresh(0), fresh(1)], cursor_after(2), owner="p1", lease_seconds=10.0)
    store.admit([fresh(2)], cursor_after(3), owner="p2", lease_seconds=10.0)
    clock.now = 105.0
    assert store.renew_leases("p1", 10.0) == 2
    assert store.renew_leases("nobody", 10.0) == 0
    assert store.lease(fresh(0).group_id) == Lease("p1", 115.0)
    assert store.lease(fresh(2).group_id) == Lease("p2", 110.0)
    clock.now = 112.0
    assert store.reclaim_expired() == 1
    assert ids(store.groups(PARTIAL)) == [fresh(2).group_id]
    assert store.count(RUNNING) == 2


def test_hand_over_moves_a_lease_only_from_its_holder(timed: tuple[Store, Clock]) -> None:
    store, clock = timed
    g0 = fresh(0)
    store.admit([g0], cursor_after(1))  # the controller's lease: never expires
    store.hand_over(g0.group_id, owner="controller", to="p1", lease_seconds=5.0)
    assert store.lease(g0.group_id) == Lease("p1", 105.0) and store.get(g0.group_id) == (RUNNING, g0)
    before = store.statistics().transactions
    with pytest.raises(StoreError, match="leased to 'p1', not 'p2'; it cannot be handed to 'controller'"):
        store.hand_over(g0.group_id, owner="p2", to="controller", lease_seconds=math.inf)
    assert store.lease(g0.group_id) == Lease("p1", 105.0) and store.statistics().transactions == before
    clock.now = 105.0
    assert store.reclaim_expired() == 1
    # A result from p1 after its lease was reclaimed is fenced: the group stays partial.
    with pytest.raises(StoreError, match="is partial, not running"):
        store.hand_over(g0.group_id, owner="p1", to="controller", lease_seconds=math.inf)
    with pytest.raises(StoreError, match="not in the store"):
        store.hand_over(fresh(9).group_id, owner="p1", to="controller", lease_seconds=1.0)
    (again,) = store.claim_partial(1, owner="p2", lease_seconds=5.0)
    store.hand_over(again.group_id, owner="p2", to="controller", lease_seconds=math.inf)
    clock.now = 1e12
    assert store.reclaim_expired() == 0  # the controller's lease never expires
    with pytest.raises(ValueError, match="> 0"):
        store.hand_over(again.group_id, owner="controller", to="p3", lease_seconds=0.0)
    store.put_ready(finished(again, 0), owner="controller")
    assert store.get(g0.group_id)[0] is READY


def test_default_leases_never_expire_and_recover_ends_every_lease(timed: tuple[Store, Clock]) -> None:
    store, _ = timed
    store.admit([fresh(0)], cursor_after(1))
    store.admit([fresh(1)], cursor_after(2), owner="p1", lease_seconds=1.0)
    assert store.lease(fresh(0).group_id) == Lease("controller", math.inf)
    assert store.reclaim_expired(1e300) == 1  # only p1's
    store.claim_partial(1)
    assert store.lease(fresh(1).group_id) == Lease("controller", math.inf)
    assert store.recover() == RecoveryReport(running_to_partial=2, batched_to_ready=0)
    assert store.lease(fresh(0).group_id) is None and store.lease(fresh(1).group_id) is None
    assert store.reclaim_expired(1e300) == 0


def test_bad_lease_arguments_are_refused_and_store_nothing(timed: tuple[Store, Clock]) -> None:
    store, _ = timed
    for kw, match in (
        ({"lease_seconds": 0.0}, "lease_seconds must be > 0, got 0.0"),
        ({"lease_seconds": math.nan}, "got nan"),
        ({"owner": ""}, "non-empty string, got ''"),
    ):
        with pytest.raises(ValueError, match=match):
            store.admit([fresh(0)], cursor_after(1), **kw)
        with pytest.raises(ValueError, match=match):
            store.claim_partial(1, **kw)
    with pytest.raises(ValueError, match="> 0"):
        store.renew_leases("p1", -1.0)
    assert store.get(fresh(0).group_id) is None and store.cursor() == Cursor()


@pytest.mark.anyio
async def test_async_store_passes_lease_arguments_only_when_given(timed: tuple[Store, Clock]) -> None:
    store, clock = timed
    astore = AsyncStore(store)
    await astore.admit([fresh(0)], cursor_after(1), owner="p1", lease_seconds=2.0)
    await astore.put_partial(generated(fresh(0), 0), owner="p1")
    await astore.claim_partial(1, owner="p2", lease_seconds=3.0)
    assert await astore.lease(fresh(0).group_id) == Lease("p2", 103.0)
    clock.now = 102.0
    assert await astore.renew_leases("p2", 3.0) == 1
    assert await astore.reclaim_expired(104.0) == 0
    assert await astore.reclaim_expired(105.0) == 1
    await astore.claim_partial(1, owner="p2", lease_seconds=3.0)
    await astore.hand_over(fresh(0).group_id, owner="p2", to="p3", lease_seconds=4.0)
    assert await astore.lease(fresh(0).group_id) == Lease("p3", 106.0)

    class OldSignatures(MemoryStore):  # a store written before leases: no lease keywords at all
        def admit(self, groups, cursor):
            super().admit(groups, cursor)

        def put_ready(self, group):
            super().put_ready(group)

    old = AsyncStore(OldSignatures())
    await old.admit([fresh(0)], cursor_after(1))
    await old.put_ready(finished(fresh(0), 0))
    assert await old.count(READY) == 1


# --- collect_garbage --------------------------------------------------------------------------


def _trained_steps(store: Store) -> list[Batch]:
    """Six groups: steps 0 and 1 trained (2 groups each), step 2 taken, not trained."""
    _staged(store, "ready")
    batches = [store.take_batch(step, 2) for step in range(3)]
    store.finish_batch(0)
    store.finish_batch(1)
    return batches


def test_collect_garbage_deletes_trained_groups_and_keeps_their_ids_refused(store: Store) -> None:
    b0, b1, b2 = _trained_steps(store)
    with pytest.raises(StoreError, match="cannot collect up to step 2: only steps up to 1 are trained"):
        store.collect_garbage(2)
    assert store.collect_garbage(0) == 2
    assert store.count(TRAINED) == 2 and store.batch(0) is None and store.batch(1) == b1
    for g in b0.groups:
        assert store.get(g.group_id) is None
        with pytest.raises(StoreError, match=rf"{g.group_id}' already exists \(trained at step 0, then collected"):
            store.admit([fresh(99), g], cursor_after(100))
    assert store.get(fresh(99).group_id) is None  # the refused admit stored nothing
    assert store.collect_garbage(0) == 0 and store.collect_garbage(-1) == 0  # nothing more
    assert store.collect_garbage(1) == 2
    stats = store.statistics()
    assert (stats.collected, stats.collected_step) == (4, 1)
    assert stats.counts == {**dict.fromkeys(GroupState, 0), BATCHED: 2}
    assert list(store.groups(TRAINED)) == []
    store.finish_batch(1)  # a late retry of a collected step is still harmless
    with pytest.raises(StoreError, match="already trained"):
        store.take_batch(1, 2)
    assert store.batch(2) == b2
    store.finish_batch(2)
    assert store.count(TRAINED) == 2 and store.trained_step() == 2
    assert store.recover() == RecoveryReport(0, 0)


# --- open_store -------------------------------------------------------------------------------


def test_open_store(tmp_path: Path) -> None:
    assert isinstance(open_store("memory", None), MemoryStore)
    with open_store("lmdb", str(tmp_path / "s"), sync=False) as s:
        assert isinstance(s, LmdbStore)
    with pytest.raises(ValueError, match=r"'redis'.*memory, lmdb"):
        open_store("redis", None)
    with pytest.raises(ValueError, match="needs a directory"):
        open_store("lmdb", None)


# --- AsyncStore -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_async_store_drives_both_stores(store: Store) -> None:
    astore = AsyncStore(store)
    g0, g1 = fresh(0), fresh(1)
    await astore.admit([g0, g1], cursor_after(2))
    await astore.put_partial(generated(g0, 0))
    (claimed,) = await astore.claim_partial(3)
    assert claimed.group_id == g0.group_id
    await astore.put_ready(finished(g1, 1))
    await astore.put_ready(finished(claimed, 1))  # its prefix is from version 0: served first
    assert await astore.count(READY) == 2
    assert ids(await astore.groups(READY)) == [g0.group_id, g1.group_id]
    batch = await astore.take_batch(0, 2)
    assert batch is not None and await astore.batch(0) == batch
    await astore.finish_batch(0)
    assert await astore.trained_step() == 0
    assert await astore.cursor() == cursor_after(2)
    assert (await astore.get(g0.group_id))[0] is TRAINED
    assert await astore.recover() == RecoveryReport(0, 0)
    assert astore.statistics().counts[TRAINED] == 2
    await astore.aclose()
    with pytest.raises(StoreError):
        await astore.count(READY)


class _Watched:
    """An LmdbStore seen through a window: which thread runs each call, and how many at once."""

    def __init__(self, inner: LmdbStore) -> None:
        self.inner = inner
        self.threads: set[int] = set()
        self.running = 0
        self.most = 0
        self.gate = threading.Event()
        self.gate.set()
        self.entered: anyio.Event | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        method = getattr(self.inner, name)

        def call(*args):
            with self._lock:
                self.threads.add(threading.get_ident())
                self.running += 1
                self.most = max(self.most, self.running)
            try:
                if self.entered is not None:
                    anyio.from_thread.run_sync(self.entered.set)
                self.gate.wait(timeout=10)
                return method(*args)
            finally:
                with self._lock:
                    self.running -= 1

        return call


@pytest.mark.anyio
async def test_async_lmdb_calls_run_one_at_a_time_off_the_event_loop(tmp_path: Path) -> None:
    watched = _Watched(LmdbStore(tmp_path / "s", sync=False))
    astore = AsyncStore(watched)  # not a MemoryStore: every call goes to the worker thread
    groups = [fresh(i) for i in range(20)]
    await astore.admit(groups, cursor_after(20))
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for g in groups:
                tg.start_soon(astore.put_ready, finished(g, 0))
    assert watched.most == 1
    assert threading.get_ident() not in watched.threads
    assert await astore.count(READY) == 20
    await astore.aclose()


@pytest.mark.anyio
async def test_a_cancelled_call_still_completes_and_is_not_abandoned(tmp_path: Path) -> None:
    watched = _Watched(LmdbStore(tmp_path / "s", sync=False))
    astore = AsyncStore(watched)
    await astore.admit([fresh(0)], cursor_after(1))
    await astore.put_partial(generated(fresh(0), 0))
    watched.gate.clear()
    watched.entered = anyio.Event()
    returned = anyio.Event()

    async def claim(scope_ready: anyio.Event) -> None:
        with anyio.CancelScope() as scope:
            holder.append(scope)
            scope_ready.set()
            await astore.claim_partial(1)
        returned.set()

    holder: list[anyio.CancelScope] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            ready = anyio.Event()
            tg.start_soon(claim, ready)
            await ready.wait()
            await watched.entered.wait()  # the transaction is under way in the worker
            holder[0].cancel()
            await anyio.wait_all_tasks_blocked()
            assert not returned.is_set()  # the caller waits for the thread, it does not abandon it
            watched.entered = None
            watched.gate.set()
    assert returned.is_set()
    assert watched.inner.count(RUNNING) == 1  # the claim happened in full
    await astore.aclose()


@pytest.mark.anyio
async def test_memory_calls_run_inline_on_the_loop_thread() -> None:
    store = MemoryStore()
    astore = AsyncStore(store)
    seen: list[int] = []
    original = store.count

    def count(state: GroupState) -> int:
        seen.append(threading.get_ident())
        return original(state)

    store.count = count  # type: ignore[method-assign]
    assert await astore.count(READY) == 0
    assert seen == [threading.get_ident()]
    await astore.aclose()


# --- LMDB only --------------------------------------------------------------------------------


def _populate(store: LmdbStore) -> None:
    store.write_meta(RunMeta("run-a", "ds:1", "tok:1", 2))
    g = [fresh(i) for i in range(6)]
    store.admit(g, cursor_after(6))
    for x in g[:3]:
        store.put_ready(finished(x, 0))
    store.put_partial(generated(g[3], 0))
    store.put_rejected(dataclasses.replace(finished(g[4], 0), rejected_reason="same rewards"))
    store.take_batch(0, 2)
    store.finish_batch(0)
    store.take_batch(1, 1)


def _snapshot(store: Store) -> dict:
    return {
        "meta": store.read_meta(),
        "cursor": store.cursor(),
        "trained": store.trained_step(),
        "counts": counts(store),
        "groups": {s: list(store.groups(s)) for s in GroupState},
        "batches": [store.batch(i) for i in range(3)],
    }


def test_reopen_after_close_keeps_everything(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "s") as store:
        _populate(store)
        before = _snapshot(store)
    with LmdbStore(tmp_path / "s") as store:
        assert _snapshot(store) == before
        assert store.statistics().transactions == 0  # counted per opening, not stored


def test_a_second_writer_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first = LmdbStore(tmp_path / "s")
    with pytest.raises(StoreLockedError) as info:
        LmdbStore(tmp_path / "s")
    assert f"pid {os.getpid()}" in info.value.holder
    assert socket.gethostname() in info.value.holder
    assert str(tmp_path / "s") in str(info.value)
    # Another process is refused the same way.
    code = f"from storage import LmdbStore\nLmdbStore({str(tmp_path / 's')!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "StoreLockedError" in proc.stderr and f"pid {os.getpid()}" in proc.stderr
    first.close()
    LmdbStore(tmp_path / "s").close()  # free again once the holder closed


def test_readonly_changes_nothing_and_refuses_writes(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with LmdbStore(path) as store:
        _populate(store)
        before = _snapshot(store)
    data = path / "data.mdb"
    content, mtime = data.read_bytes(), data.stat().st_mtime_ns
    # A writer holding the lock (another process, here simulated by our own flock) does not stop a reader.
    import fcntl

    fd = os.open(path / "writer.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with LmdbStore(path, readonly=True) as ro:
            assert _snapshot(ro) == before
            assert ro.statistics().counts == before["counts"]
            for call in (
                lambda: ro.admit([fresh(50)], cursor_after(51)),
                lambda: ro.put_ready(finished(fresh(5), 0)),
                lambda: ro.claim_partial(1),
                lambda: ro.take_batch(2, 1),
                lambda: ro.recover(),
                lambda: ro.write_meta(RunMeta("x", "y", "z", 1)),
            ):
                with pytest.raises(StoreError, match="read-only"):
                    call()
    finally:
        os.close(fd)
    assert data.read_bytes() == content
    assert data.stat().st_mtime_ns == mtime
    with pytest.raises(StoreError, match="no rollout store"):
        LmdbStore(tmp_path / "nothing-here", readonly=True)


def test_a_tiny_map_grows_instead_of_failing(tmp_path: Path) -> None:
    big = [generated(fresh(i), 0, tokens=600) for i in range(30)]  # ~30 x 2 x 600 x 13 B, far over 64 KiB
    with LmdbStore(tmp_path / "s", map_size=64 * 1024, sync=False) as store:
        store.admit([fresh(i) for i in range(30)], cursor_after(30))
        for g in big:
            store.put_partial(g)
        assert store.statistics().bytes_used > 64 * 1024
        assert store.count(PARTIAL) == 30
    with LmdbStore(tmp_path / "s", map_size=64 * 1024) as store:
        assert list(store.groups(PARTIAL)) == big


def test_a_corrupt_record_names_its_key(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with LmdbStore(path) as store:
        store.admit([fresh(0), fresh(1)], cursor_after(2))
        store.put_ready(finished(fresh(0), 0))
        store.put_ready(finished(fresh(1), 0))
    victim = fresh(1).group_id
    env = lmdb.open(str(path), max_dbs=len(keys.DATABASES))
    with env.begin(write=True) as txn:
        txn.put(victim.encode(), b"\x93garbage", db=env.open_db(keys.GROUPS, txn=txn))
    env.close()
    with LmdbStore(path) as store:
        with pytest.raises(CorruptRecordError) as info:
            store.get(victim)
        assert info.value.key == f"groups/{victim}"
        with pytest.raises(CorruptRecordError, match=victim):
            list(store.groups(READY))
        assert "layout version byte 147" in str(info.value)  # the seal caught it, not a decoder
        assert store.take_batch(0, 2) is None  # one READY group is damaged: too few are left
        assert store.count(READY) == 1 and store.count(GroupState.QUARANTINED) == 1 and store.batch(0) is None
        assert store.get(fresh(0).group_id)[0] is READY
        # the damaged group is never served; its prompt comes back under a new id, once
        assert store.requeue_quarantined(lambda gid: fresh(1) if gid == victim else None) == 1
        assert store.requeue_quarantined(lambda gid: fresh(1)) == 0
        [again] = store.claim_partial(5)
        assert again.group_id == f"{victim}.requeued" and again.task == fresh(1).task
        assert store.count(GroupState.QUARANTINED) == 1
    with LmdbStore(path, readonly=True) as store:  # kept, as it was
        with pytest.raises(CorruptRecordError, match="layout version byte 147"):
            store.get(victim)


def test_a_damaged_partial_group_is_quarantined_and_the_next_one_served(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with LmdbStore(path) as store:
        store.admit([fresh(0), fresh(1)], cursor_after(2))
        store.put_partial(fresh(0))
        store.put_partial(fresh(1))
    env = lmdb.open(str(path), max_dbs=len(keys.DATABASES))
    with env.begin(write=True) as txn:
        db = env.open_db(keys.GROUPS, txn=txn)
        value = bytearray(txn.get(fresh(0).group_id.encode(), db=db))
        value[-3] ^= 0x10  # one flipped bit in the payload: it still decodes, but the checksum fails
        txn.put(fresh(0).group_id.encode(), bytes(value), db=db)
    env.close()
    with LmdbStore(path) as store:
        assert [g.group_id for g in store.claim_partial(2)] == [fresh(1).group_id]
        assert store.count(GroupState.QUARANTINED) == 1 and store.count(PARTIAL) == 0


def test_a_store_of_another_layout_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s"
    LmdbStore(path).close()
    env = lmdb.open(str(path), max_dbs=len(keys.DATABASES))
    with env.begin(write=True) as txn:
        txn.put(keys.META_LAYOUT, layout_value(99), db=env.open_db(keys.META, txn=txn))
    env.close()
    with pytest.raises(IncompatibleStoreError, match="newer .* layout 99.*reads layouts 1 to 2"):
        LmdbStore(path)
    with pytest.raises(IncompatibleStoreError, match="layout 99"):
        LmdbStore(path, readonly=True)
    with pytest.raises(IncompatibleStoreError):  # not StoreLockedError: the failed opener let go of the lock
        LmdbStore(path)


def test_lmdb_errors_become_store_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(StoreError, match="cannot create"):
        LmdbStore(tmp_path / "file")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "data.mdb").write_bytes(b"\0junk" * 4096)
    with pytest.raises(StoreCorruptionError, match="damaged at .*junk/data.mdb: neither meta page") as info:
        LmdbStore(tmp_path / "junk")
    assert info.value.where == str(tmp_path / "junk" / "data.mdb")
    with pytest.raises(StoreCorruptionError):  # and the failed opener released the lock
        LmdbStore(tmp_path / "junk")


# --- random operation sequences: both stores and a reference model agree --------------------


class Model:
    """The contract in its plainest form: dicts, and sorting on every take."""

    def __init__(self, now: list[float]) -> None:
        self.state: dict[str, GroupState] = {}
        self.group: dict[str, Group] = {}
        self.batches: dict[int, list[str]] = {}
        self.cursor = Cursor()
        self.trained = -1
        self.transactions = 0
        self.now = now  # the clock the stores read too
        self.leases: dict[str, Lease] = {}
        self.tombstones: set[str] = set()
        self.collected = 0
        self.collected_step = -1

    def served(self, state: GroupState) -> list[str]:
        members = [gid for gid, s in self.state.items() if s is state]
        return sorted(members, key=lambda gid: (self.group[gid].oldest_version, self.group[gid].seq, gid))

    def admit(self, groups: list[Group], cursor: Cursor, owner: str, secs: float) -> None:
        gids = [g.group_id for g in groups]
        if len(set(gids)) != len(gids) or any(gid in self.state or gid in self.tombstones for gid in gids):
            raise StoreError("duplicate")
        for g in groups:
            self.state[g.group_id], self.group[g.group_id] = RUNNING, g
            self.leases[g.group_id] = Lease(owner, self.now[0] + secs)
        self.cursor = cursor
        self.transactions += 1

    def claim_partial(self, limit: int, owner: str, secs: float) -> list[Group]:
        out = self.served(PARTIAL)[: max(limit, 0)]
        for gid in out:
            self.state[gid] = RUNNING
            self.leases[gid] = Lease(owner, self.now[0] + secs)
        self.transactions += 1
        return [self.group[gid] for gid in out]

    def put(self, group: Group, to: GroupState, owner: str | None) -> None:
        if self.state.get(group.group_id) is not RUNNING:
            raise StoreError("not running")
        if owner is not None and self.leases[group.group_id].owner != owner:
            raise StoreError("lease lost")
        self.state[group.group_id], self.group[group.group_id] = to, group
        del self.leases[group.group_id]
        self.transactions += 1

    def renew(self, owner: str, secs: float) -> int:
        mine = [gid for gid, lease in self.leases.items() if lease.owner == owner]
        for gid in mine:
            self.leases[gid] = Lease(owner, self.now[0] + secs)
        self.transactions += 1
        return len(mine)

    def reclaim(self) -> int:
        expired = [gid for gid, lease in self.leases.items() if lease.expires_at <= self.now[0]]
        for gid in expired:
            self.state[gid] = PARTIAL
            del self.leases[gid]
        self.transactions += 1
        return len(expired)

    def collect(self, up_to: int) -> int:
        if up_to > self.trained:
            raise StoreError("not trained")
        self.transactions += 1
        if up_to <= self.collected_step:
            return 0
        deleted = 0
        for step in [s for s in self.batches if s <= up_to]:
            for gid in self.batches.pop(step):
                del self.state[gid], self.group[gid]
                self.tombstones.add(gid)
                deleted += 1
        self.collected += deleted
        self.collected_step = up_to
        return deleted

    def take_batch(self, step: int, size: int) -> Batch | None:
        if step in self.batches:
            self.transactions += 1
            return Batch(step, tuple(self.group[g] for g in self.batches[step]))
        if step <= self.trained:
            raise StoreError("trained")
        self.transactions += 1
        ready = self.served(READY)
        if len(ready) < size:
            return None
        self.batches[step] = ready[:size]
        for gid in ready[:size]:
            self.state[gid] = BATCHED
        return Batch(step, tuple(self.group[g] for g in ready[:size]))

    def finish_batch(self, step: int) -> None:
        if step not in self.batches and 0 <= step <= self.collected_step:
            self.transactions += 1
            return
        if step not in self.batches:
            raise StoreError("no batch")
        if step > self.trained:
            if any(self.trained < s < step for s in self.batches):
                raise StoreError("order")
            for gid in self.batches[step]:
                self.state[gid] = TRAINED
            self.trained = step
        self.transactions += 1

    def recover(self) -> RecoveryReport:
        running = [gid for gid, s in self.state.items() if s is RUNNING]
        for gid in running:
            self.state[gid] = PARTIAL
        self.leases.clear()
        requeued = 0
        for step in [s for s in self.batches if s > self.trained]:
            for gid in self.batches.pop(step):
                self.state[gid] = READY
                requeued += 1
        self.transactions += 1
        return RecoveryReport(len(running), requeued)


owners = st.sampled_from(["a", "b"])
lease_times = st.sampled_from([1.0, 5.0, math.inf])
admits = st.tuples(st.just("admit"), st.integers(1, 4), st.booleans(), owners, lease_times)
claims = st.tuples(st.just("claim"), st.integers(0, 3), owners, lease_times)
puts = st.tuples(
    st.just("put"),
    st.sampled_from([PARTIAL, PARTIAL, READY, READY, READY, REJECTED, FAILED]),
    st.integers(0, 50),
    st.integers(0, 3),
    st.sampled_from([None, None, "a", "b"]),
)
takes = st.tuples(st.just("take"), st.integers(-1, 2), st.integers(1, 2))
finishes = st.tuples(st.just("finish"), st.integers(0, 3))
leasing = st.one_of(
    st.tuples(st.just("tick"), st.sampled_from([0.5, 1.0, 4.0])),
    st.tuples(st.just("renew"), owners, lease_times),
    st.just(("reclaim",)),
)
collects = st.tuples(st.just("collect"), st.sampled_from([-1, 0, 0, 1]))
operations = st.lists(
    st.one_of(
        admits,
        claims,
        puts,
        puts,
        puts,
        puts,
        takes,
        takes,
        finishes,
        finishes,
        leasing,
        leasing,
        collects,
        st.just(("recover",)),
    ),
    min_size=15,
    max_size=50,
)


def _outcome(fn):
    try:
        result = fn()
    except StoreError as exc:
        return ("error", type(exc))
    if isinstance(result, Batch):
        return ("batch", result.step, ids(result.groups))
    if isinstance(result, list):
        return ("groups", ids(result))
    return ("ok", result)


def _assert_served_oldest_first(model: Model, taken: list[str], rest_state: GroupState) -> None:
    """A take is in (version, seq) order, and nothing left behind is older than what it took."""
    order = [(model.group[g].oldest_version, model.group[g].seq) for g in taken]
    assert order == sorted(order)
    rest = [(model.group[g].oldest_version, model.group[g].seq) for g in model.served(rest_state)]
    assert not order or not rest or max(order) <= min(rest)


def _run(op: tuple, model: Model, stores: list[Store], next_index: list[int]) -> None:
    kind = op[0]
    if kind == "admit":
        _, n, dup, owner, secs = op
        start = next_index[0]
        new = [fresh(i, version=model.trained + 1) for i in range(start, start + n)]
        if dup and model.tombstones and n % 2:
            new.append(fresh(int(min(model.tombstones).rsplit("p", 1)[1])))  # a collected id
        elif dup and model.group:
            new.append(model.group[min(model.group)])
        cursor = cursor_after(start + n)
        calls = [lambda s=s: s.admit(new, cursor, owner=owner, lease_seconds=secs) for s in stores]
        expected = _outcome(lambda: model.admit(new, cursor, owner, secs))
        if expected[0] == "ok":
            next_index[0] = start + n
    elif kind == "claim":
        _, limit, owner, secs = op
        calls = [lambda s=s: s.claim_partial(limit, owner=owner, lease_seconds=secs) for s in stores]
        expected = _outcome(lambda: model.claim_partial(limit, owner, secs))
        _assert_served_oldest_first(model, expected[1], PARTIAL)
    elif kind == "tick":
        model.now[0] += op[1]
        return
    elif kind == "renew":
        calls = [lambda s=s: s.renew_leases(op[1], op[2]) for s in stores]
        expected = _outcome(lambda: model.renew(op[1], op[2]))
    elif kind == "reclaim":
        calls = [s.reclaim_expired for s in stores]
        expected = _outcome(model.reclaim)
    elif kind == "collect":
        up_to = model.trained + op[1]
        calls = [lambda s=s: s.collect_garbage(up_to) for s in stores]
        expected = _outcome(lambda: model.collect(up_to))
    elif kind == "put":
        _, to, pick, version, owner = op
        known = sorted(model.group)
        running = [gid for gid in known if model.state[gid] is RUNNING]
        if pick % 7 == 0 or not known:
            base = fresh(900 + pick)  # never admitted
        elif pick % 4 and running:
            base = model.group[running[pick % len(running)]]
        else:  # any state: mostly illegal
            base = model.group[known[pick % len(known)]]
        group = generated(base, version) if to is PARTIAL else finished(base, version)
        method = {PARTIAL: "put_partial", READY: "put_ready", REJECTED: "put_rejected", FAILED: "put_failed"}[to]
        calls = [lambda s=s: getattr(s, method)(group, owner=owner) for s in stores]
        expected = _outcome(lambda: model.put(group, to, owner))
    elif kind == "take":
        _, offset, size = op
        step = model.trained + 1 + offset
        new_step = step not in model.batches
        calls = [lambda s=s: s.take_batch(step, size) for s in stores]
        expected = _outcome(lambda: model.take_batch(step, size))
        if expected[0] == "batch" and new_step:
            _assert_served_oldest_first(model, expected[2], READY)
    elif kind == "finish":
        # Mostly a batch that is open (some out of order); 0: the trained step again (a retry).
        open_steps = sorted(s for s in model.batches if s > model.trained)
        pick = op[1]
        step = open_steps[(pick - 1) % len(open_steps)] if pick and open_steps else model.trained + pick
        calls = [lambda s=s: s.finish_batch(step) for s in stores]
        expected = _outcome(lambda: model.finish_batch(step))
    else:
        calls = [s.recover for s in stores]
        expected = _outcome(model.recover)
    event(f"{kind}: {expected[0]}")
    if expected[0] == "ok" and isinstance(expected[1], int) and expected[1] > 0:
        event(f"{kind}: changed {expected[1] > 0}")
    for s, call in zip(stores, calls, strict=True):
        assert _outcome(call) == expected, (type(s).__name__, op)


def _observe(store: Store) -> dict:
    return {
        "cursor": store.cursor(),
        "trained": store.trained_step(),
        "counts": counts(store),
        "partial": ids(store.groups(PARTIAL)),
        "ready": ids(store.groups(READY)),
        "others": {s: sorted(ids(store.groups(s))) for s in (RUNNING, BATCHED, TRAINED, REJECTED, FAILED)},
        "leases": {g.group_id: store.lease(g.group_id) for g in store.groups(RUNNING)},
        "collected": (store.statistics().collected, store.statistics().collected_step),
    }


def _model_view(model: Model) -> dict:
    return {
        "cursor": model.cursor,
        "trained": model.trained,
        "counts": {s: sum(1 for x in model.state.values() if x is s) for s in GroupState},
        "partial": model.served(PARTIAL),
        "ready": model.served(READY),
        "others": {s: sorted(model.served(s)) for s in (RUNNING, BATCHED, TRAINED, REJECTED, FAILED)},
        "leases": {gid: model.leases[gid] for gid in sorted(model.served(RUNNING))},
        "collected": (model.collected, model.collected_step),
    }


def _warm_up(model: Model, stores: list[Store]) -> None:
    groups = [fresh(i) for i in range(4)]
    model.admit(groups, cursor_after(4), "a", math.inf)
    for g in groups:
        model.put(finished(g, 0), READY, None)
    for store in stores:
        store.admit(groups, cursor_after(4), owner="a")
        for g in groups:
            store.put_ready(finished(g, 0))
    for target in (model, *stores):
        target.take_batch(0, 2)
        target.finish_batch(0)
        target.take_batch(1, 1)


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=operations, warm=st.booleans())
def test_random_operations_agree_across_stores_and_the_model(ops: list[tuple], warm: bool, tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("prop")
    now = [1000.0]
    model = Model(now)
    memory, durable = MemoryStore(clock=lambda: now[0]), LmdbStore(path, sync=False, clock=lambda: now[0])
    stores: list[Store] = [memory, durable]
    next_index = [0]
    try:
        if warm:  # a trained step and an open batch, so that collect, finish and take have work
            _warm_up(model, stores)
            next_index[0] = 4
        for op in ops:
            _run(op, model, stores, next_index)
            view = _model_view(model)
            for s in stores:
                assert _observe(s) == view, (type(s).__name__, op)
                assert s.statistics().transactions == model.transactions
        for gid, group in model.group.items():
            for s in stores:
                assert s.get(gid) == (model.state[gid], group)
        for gid in model.tombstones:
            for s in stores:
                assert s.get(gid) is None
        for step in range(-1, model.trained + 4):
            expected = model.batches.get(step)
            for s in stores:
                b = s.batch(step)
                assert (None if b is None else ids(b.groups)) == expected
    finally:
        durable.close()
    with LmdbStore(path, readonly=True) as reopened:  # everything survived the close
        assert _observe(reopened) == _model_view(model)


def test_readonly_opens_a_store_whose_lock_file_it_cannot_use(tmp_path: Path) -> None:
    """An archived store (read-only media, or a lock file we may not write) is still readable."""
    path = tmp_path / "s"
    with LmdbStore(path) as store:
        _populate(store)
        before = _snapshot(store)
    (path / "lock.mdb").unlink()
    (path / "lock.mdb").mkdir()  # LMDB cannot open it as its lock file, even as root
    with LmdbStore(path, readonly=True) as ro:
        assert _snapshot(ro) == before
    with pytest.raises(StoreError, match="cannot open"):  # a writer never runs without LMDB's lock
        LmdbStore(path)


# --- the one transition table ------------------------------------------------------------------


def test_the_transition_table_refuses_what_the_state_machine_lacks() -> None:
    from storage import transitions

    transitions.check_move("g", READY, BATCHED)
    transitions.check_move("g", PARTIAL, GroupState.QUARANTINED)
    with pytest.raises(StoreError, match="'g' cannot move from trained to ready: no such transition"):
        transitions.check_move("g", TRAINED, READY)
    with pytest.raises(StoreError, match="from absent to batched"):
        transitions.check_move("g", None, BATCHED)
    # Only `seed` makes a group TRAINED without training it: a salvaged batch to train again.
    assert transitions.TRANSITIONS[(None, TRAINED)] is transitions.Move.SEED
    with pytest.raises(StoreError, match="from trained to quarantined"):  # trained is final: never taken back
        transitions.check_move("g", TRAINED, GroupState.QUARANTINED)


def test_both_stores_refuse_a_put_with_the_same_words(tmp_path: Path) -> None:
    messages = []
    for store in (MemoryStore(), LmdbStore(tmp_path / "s", sync=False)):
        with store:
            store.admit([fresh(0)], cursor_after(1), owner="p1", lease_seconds=60.0)
            store.put_ready(finished(fresh(0), 0))
            found = []
            puts = (
                lambda store=store: store.put_partial(fresh(0), owner="p1"),
                lambda store=store: store.put_ready(fresh(1)),
            )
            for put in puts:
                with pytest.raises(StoreError) as info:
                    put()
                found.append(str(info.value))
            messages.append(found)
    assert messages[0] == messages[1]
    assert messages[0][0] == "group 'e0000-p000000000' is ready, not running; it cannot become partial"


def test_coverage_names_the_groups_a_step_did_not_settle(store: Store) -> None:
    """What a checkpoint of a step records: every group below the cursor is settled by it except
    those running, partial, ready, or in a later step's batch."""
    store.admit([fresh(i) for i in range(8)], cursor_after(8))
    for i in range(5):
        store.put_ready(finished(fresh(i), 0))
    store.put_partial(generated(fresh(5), 0))
    store.put_rejected(finished(fresh(6), 0))  # filtered out: settled, nothing to generate again
    step_0 = ids(store.take_batch(0, 2).groups)
    assert store.coverage(0) == store.coverage(0)  # a read: nothing changes
    covered = store.coverage(0)  # taken while step 0 trains: its batch is what the checkpoint learns
    assert (covered.step, covered.cursor) == (0, cursor_after(8))
    assert sorted(covered.unsettled) == sorted(ids(fresh(i) for i in (2, 3, 4, 5, 7)))
    store.finish_batch(0)
    step_1 = ids(store.take_batch(1, 2).groups)
    store.finish_batch(1)
    assert not set(step_0) & set(store.coverage(0).unsettled)
    assert set(step_1) <= set(store.coverage(0).unsettled)  # trained after step 0: not its checkpoint's
    assert not set(step_1) & set(store.coverage(1).unsettled)


def test_requeue_trained_generates_a_trained_groups_prompt_again_once(store: Store) -> None:
    store.admit([fresh(0), fresh(1)], cursor_after(2))
    store.put_ready(finished(fresh(0), 0))
    store.put_ready(finished(fresh(1), 0))
    store.take_batch(0, 2)
    store.finish_batch(0)
    victim = fresh(1).group_id
    assert store.requeue_trained([victim], lambda gid: fresh(1)) == [f"{victim}.requeued"]
    assert store.requeue_trained([victim], lambda gid: fresh(1)) == []  # once
    assert store.get(victim)[0] is TRAINED and store.get(f"{victim}.requeued")[0] is PARTIAL
    with pytest.raises(StoreError, match="indexed as trained"):
        store.requeue_trained([f"{victim}.requeued"], lambda gid: fresh(1))

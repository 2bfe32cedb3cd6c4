"""Group commit: calls queued while the LMDB store commits share the next transaction and its fsync.

Each call keeps its own result or error; a call that fails after writing part of itself aborts
only itself; a caller's await returns only after its transaction is on disk, so a process killed
in the middle of a group loses nothing that was acknowledged. A caller cancelled by `Task.cancel()`
(how a SIGTERM stops a run) while its call runs is cancelled, not failed, once the call has ended.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import anyio.from_thread
import pytest

from core.errors import StoreError
from storage import AsyncStore, GroupState, LmdbStore

from .test_store import cursor_after, finished, fresh, generated

RUNNING, PARTIAL, READY = GroupState.RUNNING, GroupState.PARTIAL, GroupState.READY
ROOT = Path(__file__).resolve().parent.parent


class GatedStore(LmdbStore):
    """An LmdbStore whose groups wait at a gate before they run, and that records their sizes."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, sync=True)
        self.gate = threading.Event()
        self.gate.set()
        self.entered: anyio.Event | None = None
        self.sizes: list[int] = []

    def run_grouped(self, calls):  # type: ignore[no-untyped-def]
        self.sizes.append(len(calls))
        if self.entered is not None:
            anyio.from_thread.run_sync(self.entered.set)
        self.gate.wait(timeout=10)
        return super().run_grouped(calls)


async def _hold_first_group(store: GatedStore, astore: AsyncStore, tg: anyio.abc.TaskGroup, first) -> None:  # type: ignore[no-untyped-def]
    """Start `first` and wait until its group is in the worker thread, held at the gate."""
    store.gate.clear()
    store.entered = anyio.Event()
    tg.start_soon(first)
    await store.entered.wait()
    store.entered = None


@pytest.mark.anyio
async def test_concurrent_puts_share_one_transaction(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "s")
    astore = AsyncStore(store)
    groups = [fresh(i) for i in range(33)]
    await astore.admit(groups, cursor_after(33))
    before = astore.statistics().transactions
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await _hold_first_group(store, astore, tg, lambda: astore.put_ready(finished(groups[0], 0)))
            for g in groups[1:]:
                tg.start_soon(astore.put_ready, finished(g, 0))
            await anyio.wait_all_tasks_blocked()  # all 32 queued behind the held group
            store.gate.set()
    assert store.sizes[-2:] == [1, 32]
    assert astore.statistics().transactions - before == 2  # 33 puts, 2 commits (2 fsyncs)
    assert await astore.count(READY) == 33
    await astore.aclose()
    with LmdbStore(tmp_path / "s") as reopened:
        assert reopened.count(READY) == 33
        assert reopened.get(groups[7].group_id) == (READY, finished(groups[7], 0))


@pytest.mark.anyio
async def test_each_caller_gets_its_own_result_or_error(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "s")
    astore = AsyncStore(store)
    g = [fresh(i) for i in range(6)]
    await astore.admit(g[:4], cursor_after(4))
    await astore.put_partial(generated(g[0], 0))
    outcomes: dict[str, object] = {}

    async def record(name: str, call) -> None:  # type: ignore[no-untyped-def]
        try:
            outcomes[name] = await call()
        except StoreError as exc:
            outcomes[name] = exc

    before = astore.statistics().transactions
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await _hold_first_group(
                store, astore, tg, lambda: record("first", lambda: astore.put_ready(finished(g[1], 0)))
            )
            tg.start_soon(record, "claim", lambda: astore.claim_partial(5))
            # Fails after writing g[4]: aborts itself only, g[4] must not appear.
            tg.start_soon(record, "admit", lambda: astore.admit([g[4], g[2]], cursor_after(6)))
            tg.start_soon(record, "ready", lambda: astore.put_ready(finished(g[2], 0)))
            tg.start_soon(record, "twice", lambda: astore.put_ready(finished(g[1], 0)))  # already READY
            tg.start_soon(record, "count", lambda: astore.count(READY))  # sees the puts queued before it
            tg.start_soon(record, "partial", lambda: astore.put_partial(generated(g[3], 0)))
            await anyio.wait_all_tasks_blocked()
            store.gate.set()
    assert store.sizes[-1] == 6
    assert astore.statistics().transactions - before == 2
    assert [x.group_id for x in outcomes["claim"]] == [g[0].group_id]  # type: ignore[attr-defined]
    assert isinstance(outcomes["admit"], StoreError) and g[2].group_id in str(outcomes["admit"])
    assert isinstance(outcomes["twice"], StoreError) and "ready" in str(outcomes["twice"])
    assert outcomes["first"] is None and outcomes["ready"] is None and outcomes["partial"] is None
    assert outcomes["count"] == 2
    await astore.aclose()
    with LmdbStore(tmp_path / "s") as reopened:
        assert reopened.get(g[4].group_id) is None
        assert reopened.cursor() == cursor_after(4)  # the failed admit's cursor is not stored either
        assert {gid: reopened.get(gid)[0] for gid in (x.group_id for x in g[:4])} == {  # type: ignore[index]
            g[0].group_id: RUNNING,
            g[1].group_id: READY,
            g[2].group_id: READY,
            g[3].group_id: PARTIAL,
        }
        assert reopened.count(READY) == 2 and reopened.count(RUNNING) == 1


def test_run_grouped_reruns_the_others_when_one_fails_after_writing(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "s", sync=False) as store:
        g = [fresh(i) for i in range(4)]
        store.admit(g[:2], cursor_after(2))
        before = store.statistics().transactions
        outcomes = store.run_grouped(
            [
                lambda: store.put_partial(generated(g[0], 0)),
                lambda: store.admit([g[2], g[1]], cursor_after(4)),  # writes g[2], then fails on g[1]
                lambda: store.claim_partial(1),
                lambda: store.admit([g[3]], cursor_after(4)),
            ]
        )
        assert outcomes[0] == (None, None)
        assert outcomes[1][0] is None and isinstance(outcomes[1][1], StoreError)
        assert outcomes[2] == ([generated(g[0], 0)], None)
        assert outcomes[3] == (None, None)
        assert store.statistics().transactions - before == 1
        assert store.get(g[2].group_id) is None
        assert store.get(g[3].group_id) == (RUNNING, g[3])
        assert store.cursor() == cursor_after(4)
        assert store.statistics().counts[RUNNING] == 3  # counters agree with the records
    with LmdbStore(tmp_path / "s") as reopened:
        assert reopened.statistics().counts[RUNNING] == 3


@pytest.mark.anyio
async def test_a_queued_call_cancelled_does_nothing_and_a_started_one_completes(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "s")
    astore = AsyncStore(store)
    g = [fresh(i) for i in range(3)]
    await astore.admit(g, cursor_after(3))
    returned: list[str] = []

    async def put(i: int, scope_box: list[anyio.CancelScope]) -> None:
        with anyio.CancelScope() as scope:
            scope_box.append(scope)
            await astore.put_ready(finished(g[i], 0))
            returned.append(g[i].group_id)

    first: list[anyio.CancelScope] = []
    queued: list[anyio.CancelScope] = []
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await _hold_first_group(store, astore, tg, lambda: put(0, first))
            tg.start_soon(put, 1, queued)
            tg.start_soon(astore.put_ready, finished(g[2], 0))
            await anyio.wait_all_tasks_blocked()
            first[0].cancel()  # started: runs to the end, its caller gets the result
            queued[0].cancel()  # still queued: never runs
            await anyio.wait_all_tasks_blocked()
            assert returned == []
            store.gate.set()
    assert returned == [g[0].group_id]
    assert store.sizes[-1] == 1  # only g[2]'s put went in the second group
    assert await astore.count(READY) == 2
    assert (await astore.get(g[1].group_id))[0] is RUNNING  # type: ignore[index]
    await astore.aclose()


def test_a_kill_inside_a_group_loses_nothing_acknowledged(tmp_path: Path) -> None:
    """The process dies in the middle of a group (its third call is running): every put whose
    await had returned is on disk after a reopen, and the group that died left nothing half-done."""
    path = tmp_path / "s"
    code = f"""
import os, sys
import anyio
from storage import AsyncStore, LmdbStore
from tests.test_store import cursor_after, fresh, generated

N, KILL_AT = 40, 23
put_partial = LmdbStore.put_partial
calls = 0
def dying_put_partial(self, group, **kw):
    global calls
    calls += 1
    if calls == KILL_AT:
        os._exit(0)  # no close, no flush: as a SIGKILL would leave it
    return put_partial(self, group, **kw)
LmdbStore.put_partial = dying_put_partial

async def main():
    astore = AsyncStore(LmdbStore({str(path)!r}, sync=True))
    groups = [fresh(i) for i in range(N)]
    await astore.admit(groups, cursor_after(N))
    async def put(g):
        await astore.put_partial(generated(g, 0))
        sys.stdout.write(g.group_id + "\\n")
        sys.stdout.flush()
    async with anyio.create_task_group() as tg:
        for g in groups:
            tg.start_soon(put, g)
anyio.run(main)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    acknowledged = proc.stdout.split()
    assert 0 < len(acknowledged) < 40  # it died part way, after some groups were acknowledged
    with LmdbStore(path) as store:
        states = {g.group_id: store.get(g.group_id)[0] for g in map(fresh, range(40))}  # type: ignore[index]
        assert all(states[gid] is PARTIAL for gid in acknowledged)
        assert set(states.values()) <= {RUNNING, PARTIAL}
        assert store.count(PARTIAL) + store.count(RUNNING) == 40
        assert store.get(fresh(3).group_id) in ((RUNNING, fresh(3)), (PARTIAL, generated(fresh(3), 0)))


@pytest.mark.anyio
async def test_a_claim_with_nothing_partial_is_answered_without_a_transaction(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "s")
    astore = AsyncStore(store)
    g = [fresh(i) for i in range(2)]
    await astore.admit(g, cursor_after(2))
    groups_before = len(store.sizes)
    assert await astore.claim_partial(4) == []
    assert len(store.sizes) == groups_before  # never went to the writer thread
    await astore.put_partial(generated(g[1], 0))  # acknowledged: the next claim must see it
    assert await astore.claim_partial(4) == [generated(g[1], 0)]
    assert await astore.claim_partial(4, owner="p", lease_seconds=5.0) == []  # with a lease: asks the store
    assert len(store.sizes) == groups_before + 3
    await astore.aclose()


@pytest.mark.anyio
async def test_a_group_that_fails_as_a_whole_fails_each_of_its_callers_and_the_next_group_runs(
    tmp_path: Path,
) -> None:
    class Failing(GatedStore):
        fail_next = False

        def run_grouped(self, calls):  # type: ignore[no-untyped-def]
            if self.fail_next and len(calls) > 1:
                self.fail_next = False
                raise RuntimeError("the disk went away")
            return super().run_grouped(calls)

    store = Failing(tmp_path / "s")
    astore = AsyncStore(store)
    g = [fresh(i) for i in range(4)]
    await astore.admit(g, cursor_after(4))
    errors: list[str] = []

    async def put(i: int) -> None:
        try:
            await astore.put_ready(finished(g[i], 0))
        except RuntimeError as exc:
            errors.append(f"{i}: {exc}")

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await _hold_first_group(store, astore, tg, lambda: put(0))
            store.fail_next = True
            for i in (1, 2, 3):
                tg.start_soon(put, i)
            await anyio.wait_all_tasks_blocked()
            store.gate.set()
    assert sorted(errors) == [f"{i}: the disk went away" for i in (1, 2, 3)]
    await astore.put_ready(finished(g[1], 0))  # the writer goes on with the next group
    assert await astore.count(READY) == 2
    await astore.aclose()


# --- a Task.cancel() while a call runs: how a SIGTERM stops the run (pipeline.run.end) ----------------


class HeldStore(LmdbStore):
    """An LmdbStore whose `put_ready` says it started (`waiting`) and then waits for a turn the test
    hands out (`turns`); `entered` counts the calls that got that far."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, sync=False)
        self.turns = threading.Semaphore(0)
        self.waiting: anyio.Event | None = None
        self.entered = 0

    def put_ready(self, group, **kwargs):  # type: ignore[no-untyped-def]
        self.entered += 1
        if self.waiting is not None:
            anyio.from_thread.run_sync(self.waiting.set)
        assert self.turns.acquire(timeout=10)
        return super().put_ready(group, **kwargs)


async def _put_recording(astore: AsyncStore, group, outcome: dict, tasks: dict, key: int) -> None:  # type: ignore[no-untyped-def]
    tasks[key] = asyncio.current_task()
    try:
        await astore.put_ready(group)
        outcome[key] = "returned"
    except BaseException as exc:  # recorded, not raised: the test looks at what the caller got
        outcome[key] = exc


@pytest.mark.anyio
@pytest.mark.parametrize("group_commit", [True, False], ids=["group-commit", "a-transaction-a-call"])
async def test_a_task_cancel_while_a_call_runs_cancels_its_caller_once_the_call_has_committed(
    tmp_path: Path, group_commit: bool
) -> None:
    """The caller is natively cancelled while its put runs in the worker thread: the put commits, the
    writer's turn stays taken until it has (the next call waits), and the caller gets the
    cancellation, never a StoreError (issue 46: `error: CancelledError()` after a SIGTERM)."""
    store = HeldStore(tmp_path / "s")
    astore = AsyncStore(store, group_commit=group_commit)
    g = [fresh(i) for i in range(2)]
    await astore.admit(g, cursor_after(2))
    outcome: dict[int, object] = {}
    tasks: dict[int, asyncio.Task] = {}
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            store.waiting = anyio.Event()
            tg.start_soon(_put_recording, astore, finished(g[0], 0), outcome, tasks, 0)
            await store.waiting.wait()  # its put is in the worker thread
            store.waiting = None
            tasks[0].cancel()  # what StopOnSigterm does to the run's main task
            tg.start_soon(astore.put_ready, finished(g[1], 0))
            await anyio.wait_all_tasks_blocked()
            assert outcome == {}, outcome  # the caller waits for its call to end
            assert store.entered == 1  # and the next call for the writer's turn
            store.turns.release(2)
    assert isinstance(outcome[0], asyncio.CancelledError), outcome
    assert await astore.count(READY) == 2  # the cancelled caller's put committed, and the next one ran
    await astore.aclose()


@pytest.mark.anyio
async def test_a_task_cancel_of_a_caller_whose_call_another_one_drives_is_not_swallowed(tmp_path: Path) -> None:
    """Calls 1 and 2 share a group that call 1 drives; call 2's task is natively cancelled while the
    group runs. A cancel scope would deliver the cancellation again at its next checkpoint; a
    Task.cancel() is delivered once, so the caller must get it when its call ends, not its result."""
    store = HeldStore(tmp_path / "s")
    astore = AsyncStore(store)
    g = [fresh(i) for i in range(3)]
    await astore.admit(g, cursor_after(3))
    outcome: dict[int, object] = {}
    tasks: dict[int, asyncio.Task] = {}
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            store.waiting = anyio.Event()
            tg.start_soon(_put_recording, astore, finished(g[0], 0), outcome, tasks, 0)
            await store.waiting.wait()  # the first group, [0], runs
            for i in (1, 2):
                tg.start_soon(_put_recording, astore, finished(g[i], 0), outcome, tasks, i)
            await anyio.wait_all_tasks_blocked()  # 1 and 2 queued behind it
            store.waiting = anyio.Event()
            store.turns.release()
            await store.waiting.wait()  # the second group, [1, 2], runs, driven by 1
            store.waiting = None
            tasks[2].cancel()
            await anyio.wait_all_tasks_blocked()
            assert 2 not in outcome  # its call runs on
            store.turns.release(2)
    assert outcome[0] == outcome[1] == "returned"
    assert isinstance(outcome[2], asyncio.CancelledError), outcome
    assert await astore.count(READY) == 3
    await astore.aclose()

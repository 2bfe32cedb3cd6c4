"""The stages store in batches what is already waiting, and never wait for more.

Real parts: the LMDB store behind `AsyncStore` (group commit on), anyio memory streams, the real
stages. Store calls are counted as LMDB transactions.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from core.clock import VersionClock
from core.types import Group
from stages.admission import Admission, Outcome
from stages.collector import Collector
from stages.dispenser import Dispenser
from stages.filter import FilterStage
from stages.streams import drain_nowait
from storage import AsyncStore, Cursor, GroupState, LmdbStore, MemoryStore
from tests.test_store import finished, fresh

pytestmark = pytest.mark.anyio


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[AsyncStore]:
    async with AsyncStore(LmdbStore(tmp_path / "store", sync=False)) as astore:
        yield astore


def _transactions(store: AsyncStore) -> int:
    return store.statistics().transactions


async def _running(store: AsyncStore, n: int, admission: Admission) -> list[Group]:
    """`n` groups admitted under `n` admission tickets, then finished (not stored so yet)."""
    groups = [fresh(i) for i in range(n)]
    admission.grant(n)
    assert await admission.take_tickets(n) == n
    await store.admit(groups, Cursor(0, n, n))
    return [finished(g, 0) for g in groups]


async def test_take_tickets_takes_what_is_granted_up_to_the_limit() -> None:
    adm = Admission()
    adm.grant(5)
    assert await adm.take_tickets(3) == 3
    assert await adm.take_tickets(3) == 2
    assert adm.tickets == 0 and adm.outstanding == 5
    with pytest.raises(ValueError, match=r"take_tickets\(limit=0\)"):
        await adm.take_tickets(0)
    async with anyio.create_task_group() as tg:
        taken: list[int] = []

        async def take() -> None:
            taken.append(await adm.take_tickets(8))

        tg.start_soon(take)
        await anyio.wait_all_tasks_blocked()
        assert taken == []  # no ticket: it waits
        adm.grant(2)
    assert taken == [2]


async def _dispensed(dispenser: Dispenser, n: int) -> list[Group]:
    send, receive = anyio.create_memory_object_stream[Group](0)
    out: list[Group] = []
    async with anyio.create_task_group() as tg:
        await tg.start(dispenser.run, send)
        async with receive:
            for _ in range(n):
                with anyio.fail_after(5):
                    out.append(await receive.receive())
        tg.cancel_scope.cancel()
    return out


@pytest.mark.parametrize("batch", [1, 4])
async def test_the_dispenser_admits_the_free_tickets_in_one_call(store: AsyncStore, batch: int) -> None:
    admission = Admission()
    prompts = [fresh(i).task for i in range(10)]
    dispenser = Dispenser(store, prompts, n_samples=2, clock=VersionClock(), admission=admission, batch=batch)
    admission.grant(6)
    before = _transactions(store)
    groups = await _dispensed(dispenser, 6)
    # Six tickets: one admit each, or 4 + 2 in two; the same groups, in the same order, either way.
    assert _transactions(store) - before == (6 if batch == 1 else 2)
    assert [g.task.index for g in groups] == list(range(6)) and [g.seq for g in groups] == list(range(6))
    assert await store.cursor() == Cursor(0, 6, 6)
    assert await store.count(GroupState.RUNNING) == 6


async def test_the_dispenser_serves_partial_groups_first_then_admits_the_rest_together(store: AsyncStore) -> None:
    admission = Admission()
    prompts = [fresh(i).task for i in range(10)]
    await store.admit([fresh(0)], Cursor(0, 1, 1))
    await store.put_partial(fresh(0))
    dispenser = Dispenser(store, prompts, n_samples=2, clock=VersionClock(), admission=admission, batch=8)
    admission.grant(4)
    groups = await _dispensed(dispenser, 4)
    assert [g.task.index for g in groups] == [0, 1, 2, 3]  # the partial one first, then three new ones
    assert dispenser.statistics().resumed_groups == 1 and dispenser.statistics().new_groups == 3
    assert await store.cursor() == Cursor(0, 4, 4)


async def test_the_collector_stores_what_is_waiting_in_one_call_up_to_its_batch(store: AsyncStore) -> None:
    admission = Admission()
    groups = await _running(store, 5, admission)
    collector = Collector(store=store, admission=admission, capacity=math.inf, batch=3)
    send, receive = anyio.create_memory_object_stream[Group](8)
    for g in groups:
        send.send_nowait(g)
    before = _transactions(store)
    async with anyio.create_task_group() as tg:
        await tg.start(collector.run, receive)
        with anyio.fail_after(5):
            await collector.wait_ready(5)
        send.close()
    assert _transactions(store) - before == 2  # 3 + 2, not 5
    assert [g.group_id for g in await store.groups(GroupState.READY)] == [g.group_id for g in groups]
    assert admission.count(Outcome.READY) == 5 and admission.outstanding == 0


async def test_the_collector_never_waits_for_more_and_never_passes_its_bound(store: AsyncStore) -> None:
    admission = Admission()
    groups = await _running(store, 4, admission)
    collector = Collector(store=store, admission=admission, capacity=2, batch=64)
    send, receive = anyio.create_memory_object_stream[Group](8)
    async with anyio.create_task_group() as tg:
        await tg.start(collector.run, receive)
        send.send_nowait(groups[0])
        with anyio.fail_after(5):
            await collector.wait_ready(1)  # alone, at once: nothing else came
        for g in groups[1:]:
            send.send_nowait(g)
        with anyio.fail_after(5):
            await collector.wait_ready(2)
        await anyio.wait_all_tasks_blocked()
        assert collector.ready == 2 and await store.count(GroupState.READY) == 2  # the bound holds
        collector.taken(2)
        with anyio.fail_after(5):
            await collector.wait_ready(2)
        send.close()
    assert await store.count(GroupState.READY) == 4


async def test_the_filter_stores_the_rejected_that_came_together_in_one_call(store: AsyncStore) -> None:
    admission = Admission()
    groups = await _running(store, 6, admission)
    gate = FilterStage(lambda g: g.task.index % 2 == 1, store=store, admission=admission, batch=64)
    send, receive = anyio.create_memory_object_stream[Group](8)
    out_send, out = anyio.create_memory_object_stream[Group](8)
    for g in groups:
        send.send_nowait(g)
    send.close()
    before = _transactions(store)
    async with anyio.create_task_group() as tg:
        await tg.start(gate.run, receive, out_send)
    assert _transactions(store) - before == 1  # three rejected groups, one store call
    rejected = sorted(await store.groups(GroupState.REJECTED), key=lambda g: g.task.index)
    assert [g.task.index for g in rejected] == [0, 2, 4]
    assert all(g.rejected_reason == "rejected" for g in rejected)
    async with out:
        assert [g.task.index for g in drain_nowait(out, 10)] == [1, 3, 5]  # accepted, in order
    assert admission.count(Outcome.REJECTED) == 3 and admission.outstanding == 3


def test_drain_nowait_takes_only_what_is_there() -> None:
    send, receive = anyio.create_memory_object_stream[int](4)
    for i in range(3):
        send.send_nowait(i)
    assert drain_nowait(receive, 2) == [0, 1]
    assert drain_nowait(receive, 5) == [2]
    assert drain_nowait(receive, 5) == []
    send.close()
    assert drain_nowait(receive, 5) == []  # the end of the stream: empty, the next receive raises
    with pytest.raises(anyio.EndOfStream):
        receive.receive_nowait()
    receive.close()


def test_a_store_batch_below_one_is_refused_naming_the_value() -> None:
    from pipeline import RolloutPlan

    assert RolloutPlan(mode="sync", batch_size=2, n_samples=2, num_steps=1).store_batch == 64  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"store_batch=0: must be an integer >= 1"):
        RolloutPlan(mode="sync", batch_size=2, n_samples=2, num_steps=1, store_batch=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the collector's batch is at least 1 group, got 0"):
        Collector(store=AsyncStore(MemoryStore()), admission=Admission(), capacity=1, batch=0)


def test_the_store_batch_flag_reaches_the_plan() -> None:
    from core.errors import ConfigError
    from pipeline.config import load_config
    from pipeline.run.cli import _plan

    assert _plan(load_config([])).store_batch == 64
    assert _plan(load_config(["--rollout-store-batch", "1"])).store_batch == 1
    with pytest.raises(ConfigError, match="--rollout-store-batch"):
        load_config(["--rollout-store-batch", "0"])

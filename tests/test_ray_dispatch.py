"""How `RayProducers` batches its Ray calls, without Ray: a fake actor handle (`.remote` returns an
awaitable, as Ray's does) whose submit calls park on a gate, the real dispatcher and a memory store.

One submit call is in flight per producer; the groups leased to it meanwhile go in its next call,
together, up to `store_batch` a call (group commit, for Ray calls). Ordering comes from the gate
and the dispatcher's own notifications, never from sleeps.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
import pytest

from core.types import Group, PromptTask
from launch.ray_producers import ProducerHandle, RayProducers
from stages.admission import Admission
from storage import AsyncStore, Cursor, MemoryStore
from storage.codec import decode_group

pytestmark = pytest.mark.anyio

G = 2


class _Method:
    def __init__(self, fn: Callable[..., Awaitable[Any]]) -> None:
        self.remote = fn


class FakeActor:
    """A producer actor handle: submit calls are recorded and each waits for `gate`; results never come."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.gate = anyio.Event()
        self.called = anyio.Event()
        self.submit_many = _Method(self._submit_many)
        self.take_results = _Method(self._never)
        self.heartbeat = _Method(self._heartbeat)

    async def _submit_many(self, data: list[bytes]) -> None:
        self.calls.append([decode_group(d).group_id for d in data])
        self.called.set()
        self.called = anyio.Event()
        await self.gate.wait()

    async def _never(self, *args: object) -> Any:
        await anyio.Event().wait()

    async def _heartbeat(self) -> bytes:
        return orjson.dumps({})


def group(i: int) -> Group:
    return Group.fresh(PromptTask(index=i, prompt_ids=(5, 100 + i)), epoch=0, n_samples=G, version=0, seq=i)


@pytest.mark.parametrize(
    ("store_batch", "expected"), [(64, [[0], [1, 2, 3, 4]]), (2, [[0], [1, 2], [3, 4]]), (1, [[i] for i in range(5)])]
)
async def test_groups_leased_while_a_submit_is_in_flight_go_in_the_next_call(
    store_batch: int, expected: list[list[int]]
) -> None:
    actor = FakeActor()
    store = AsyncStore(MemoryStore())
    groups = [group(i) for i in range(5)]
    await store.admit(groups, Cursor(0, 5, 5))
    admission = Admission()
    rp = RayProducers(
        [ProducerHandle("producer-0", actor, "here", group_slots=8)],
        admission=admission,
        store=store,
        n_samples=G,
        lease_seconds=60.0,
        deadline_seconds=30.0,
        store_batch=store_batch,
    )
    (p,) = rp.producers
    to_send, to_receive = anyio.create_memory_object_stream[Group](0)  # as the controller's: no buffer
    out_send, out = anyio.create_memory_object_stream[Group](8)
    with anyio.fail_after(10):
        async with to_send, out, anyio.create_task_group() as tg:
            await tg.start(rp.run, to_receive, out_send)
            await to_send.send(groups[0])
            if not actor.calls:
                await actor.called.wait()  # the first call is in flight, alone
            for g in groups[1:]:
                await to_send.send(g)
            while p.handed < 5:
                await rp.wait_slot_freed()
            assert actor.calls == [[groups[0].group_id]] and len(p.outbox) == 4  # leased, waiting for the call
            assert all(store.store.lease(g.group_id).owner == "producer-0" for g in groups)  # type: ignore[union-attr]
            actor.gate.set()
            while len(actor.calls) < len(expected):
                await actor.called.wait()
            tg.cancel_scope.cancel()
    assert actor.calls == [[groups[i].group_id for i in call] for call in expected]
    assert rp.metrics()["producers/groups_per_submit"] == 5 / len(expected)


class EagerActor(FakeActor):
    """A producer that always has results ready: each take answers at once (with none, which the
    controller handles as any batch) and records when it was asked."""

    def __init__(self) -> None:
        super().__init__()
        self.takes: list[float] = []
        self.took = anyio.Event()
        self.take_results = _Method(self._take)

    async def _take(self, limit: int) -> tuple[list[tuple[str, bytes]], bytes]:
        self.takes.append(anyio.current_time())
        self.took.set()
        self.took = anyio.Event()
        return [], orjson.dumps({})


def producers_of(actors: list[Any], takes_per_second: float) -> RayProducers:
    return RayProducers(
        [ProducerHandle(f"producer-{i}", a, "here", group_slots=8) for i, a in enumerate(actors)],
        admission=Admission(),
        store=AsyncStore(MemoryStore()),
        n_samples=G,
        lease_seconds=60.0,
        deadline_seconds=30.0,
        takes_per_second=takes_per_second,
    )


@pytest.mark.parametrize("producers", [1, 2])
async def test_results_are_taken_back_at_most_takes_per_second_in_all(producers: int) -> None:
    """With results always ready, each producer's takes are W/rate apart at the least: the
    controller's Ray calls stay at `takes_per_second` in all however many producers share them."""
    actors = [EagerActor() for _ in range(producers)]
    rp = producers_of(actors, takes_per_second=40.0)
    turn = producers / 40.0
    out_send, out = anyio.create_memory_object_stream[Group](8)
    with anyio.fail_after(10):
        async with out, out_send, anyio.create_task_group() as tg:
            for p in rp.producers:
                tg.start_soon(rp._receive_results, p, out_send.clone())
            for a in actors:
                while len(a.takes) < 4:
                    await a.took.wait()
            tg.cancel_scope.cancel()
    for a in actors:
        gaps = [b - a_ for a_, b in zip(a.takes, a.takes[1:], strict=False)]
        assert min(gaps) >= turn * 0.999, (gaps, turn)


def test_the_pause_is_the_turn_left_and_nothing_after_a_wait() -> None:
    rp = producers_of([FakeActor(), FakeActor()], takes_per_second=100.0)
    assert rp._take_pause(0.005) == pytest.approx(0.015)  # two producers share 100 takes a second
    assert rp._take_pause(0.5) == 0.0  # a take that waited for its first result used its turn up
    rp.producers[1].lost = "gone"
    assert rp._take_pause(0.0) == pytest.approx(0.01)  # the live ones share the rate
    assert producers_of([FakeActor()], takes_per_second=float("inf"))._take_pause(0.0) == 0.0
    with pytest.raises(ValueError, match="takes_per_second=0"):
        producers_of([FakeActor()], takes_per_second=0)

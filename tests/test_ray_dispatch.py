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

from launch.ray_producers import ProducerHandle, RayProducers
from pipeline.types import Group, PromptTask
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

"""The producers' mailbox (`launch.ray_mailbox`) and the controller's side of it in `RayProducers`,
without Ray: the real `Mailbox` class behind a handle whose methods have `.remote` (returning an
awaitable, as Ray's do), fake producers played by the test, and a memory store.

What is checked: groups go out and results come back for every producer in one call each way;
each producer's results are committed under its own lease (a result whose lease was reassigned is
fenced, the others go on); a producer the controller gave up on gets nothing more and its late
deliveries are dropped; a producer whose stages failed is given up at the next take. Ordering comes
from the mailbox's own waits and `wait_all_tasks_blocked`, never from sleeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import orjson
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream

from core.errors import PipelineError
from core.types import Group, PromptTask, SampleStatus
from launch.ray_mailbox import Mailbox
from launch.ray_producers import ProducerHandle, RayProducers
from stages.admission import Admission
from storage import AsyncStore, Cursor, GroupState, MemoryStore
from storage.codec import decode_group, encode_group

pytestmark = pytest.mark.anyio

G = 2


def group(i: int) -> Group:
    return Group.fresh(PromptTask(index=i, prompt_ids=(5, 100 + i)), epoch=0, n_samples=G, version=0, seq=i)


def finished(g: Group) -> Group:
    """`g` as a producer sends it back accepted: every sample answered and rewarded."""
    return dataclasses.replace(
        g, samples=tuple(dataclasses.replace(s, status=SampleStatus.COMPLETED, reward=1.0) for s in g.samples)
    )


# -- the mailbox alone --------------------------------------------------------------------------


async def answer_of(call: Callable[[], Awaitable[Any]], meanwhile: Callable[[], Awaitable[None]]) -> Any:
    """Start `call` and let it wait; run `meanwhile`, which must make it answer; return the answer."""
    got: list[Any] = []
    async with anyio.create_task_group() as tg:

        async def one() -> None:
            got.append(await call())

        tg.start_soon(one)
        await anyio.wait_all_tasks_blocked()
        assert got == []  # it waited
        await meanwhile()
    (answer,) = got
    return answer


async def test_a_collect_waits_for_its_own_parcels_and_takes_them_all_in_order() -> None:
    box = Mailbox()

    async def post() -> None:
        await box.post({"b": [b"b1"]})  # someone else's: the collect of "a" keeps waiting
        await anyio.wait_all_tasks_blocked()
        await box.post({"a": [b"a1", b"a2"]})

    assert await answer_of(lambda: box.collect("a"), post) == [b"a1", b"a2"]
    await box.post({"a": [b"a3"]})
    await box.post({"a": [b"a4"]})
    assert await box.collect("a") == [b"a3", b"a4"]
    assert await box.collect("b") == [b"b1"]


async def test_one_take_returns_every_producers_results_and_their_statistics() -> None:
    box = Mailbox()

    async def deliver() -> None:
        await box.deliver("a", [("accepted", b"g1")], b'{"n": 1}')
        await box.deliver("b", [("partial", b"g2"), ("failed", b"g3")], b'{"n": 2}')

    # The take woke at the first delivery; the second was queued by the time it ran (one event loop).
    results, statistics, failures = await answer_of(box.take, deliver)
    assert results == [("a", "accepted", b"g1"), ("b", "partial", b"g2"), ("b", "failed", b"g3")]
    assert statistics == {"a": b'{"n": 1}', "b": b'{"n": 2}'} and failures == {}
    await box.deliver("a", [], None, "RuntimeError: the reward stage failed")
    assert await box.take() == ([], {}, {"a": "RuntimeError: the reward stage failed"})


async def test_a_dropped_producer_gets_nothing_more_and_what_it_delivers_is_dropped() -> None:
    box = Mailbox()
    assert await answer_of(lambda: box.collect("a"), lambda: box.drop("a")) == []  # the collect in flight
    await box.post({"a": [b"late"], "b": [b"b1"]})
    assert await box.collect("a") == []
    await box.deliver("a", [("accepted", b"zombie")], b"{}")
    await box.deliver("b", [("accepted", b"ok")], b"{}")
    assert (await box.take())[0] == [("b", "accepted", b"ok")]


# -- the controller's side ----------------------------------------------------------------------


class _Remote:
    def __init__(self, fn: Callable[..., Awaitable[Any]], calls: list[str], name: str) -> None:
        self._fn, self._calls, self._name = fn, calls, name

    def remote(self, *args: Any) -> Awaitable[Any]:
        self._calls.append(self._name)
        return self._fn(*args)


class MailboxHandle:
    """The real mailbox behind Ray-like method handles, counting the controller's calls."""

    def __init__(self) -> None:
        self.box = Mailbox()
        self.calls: list[str] = []
        for name in ("post", "take", "drop"):
            setattr(self, name, _Remote(getattr(self.box, name), self.calls, name))


class QuietActor:
    """A producer actor handle for what the controller still calls directly: heartbeats."""

    def __init__(self) -> None:
        self.heartbeat = _Remote(self._heartbeat, [], "heartbeat")

    async def _heartbeat(self) -> bytes:
        return orjson.dumps({})


@dataclass
class Harness:
    """A running `RayProducers` over the mailbox, with `groups` handed out to its producers."""

    handle: MailboxHandle
    store: AsyncStore
    groups: list[Group]
    rp: RayProducers
    admission: Admission
    out: MemoryObjectReceiveStream[Group]  # accepted groups, on their way to the collector

    @property
    def leases(self) -> MemoryStore:
        return self.store.store  # type: ignore[return-value]


@asynccontextmanager
async def running(
    producers: int, groups: int, handle: MailboxHandle | None = None, **kw: Any
) -> AsyncIterator[Harness]:
    """Start the controller's side over `producers` producers, hand it `groups` groups and wait
    until they are leased; cancel everything when the test is done with it."""
    handle = handle or MailboxHandle()
    store = AsyncStore(MemoryStore())
    admitted = [group(i) for i in range(groups)]
    if admitted:
        await store.admit(admitted, Cursor(0, groups, groups))
    admission = Admission()
    rp = RayProducers(
        [ProducerHandle(f"producer-{i}", QuietActor(), "here", group_slots=4) for i in range(producers)],
        admission=admission,
        store=store,
        n_samples=G,
        lease_seconds=60.0,
        deadline_seconds=30.0,
        mailbox=handle,
        **kw,
    )
    to_send, to_receive = anyio.create_memory_object_stream[Group](0)
    out_send, out = anyio.create_memory_object_stream[Group](16)
    with anyio.fail_after(10), to_send, out:
        async with anyio.create_task_group() as tg:
            await tg.start(rp.run, to_receive, out_send)
            admission.grant(groups)
            for g in admitted:
                await admission.take_ticket()
                await to_send.send(g)
            while sum(p.handed for p in rp.producers) < groups:
                await rp.wait_slot_freed()
            yield Harness(handle, store, admitted, rp, admission, out)
            tg.cancel_scope.cancel()


async def test_the_results_of_every_producer_come_back_in_one_take_each_under_its_own_lease() -> None:
    async with running(2, 4, takes_per_second=1e6) as h:
        # Each producer collects its share (spread over both, least loaded first).
        parcels = {p.name: [decode_group(d) for d in await h.handle.box.collect(p.name)] for p in h.rp.producers}
        assert sorted(len(v) for v in parcels.values()) == [2, 2]
        for name, mine in parcels.items():
            assert all(h.leases.lease(g.group_id).owner == name for g in mine)  # type: ignore[union-attr]
        await anyio.wait_all_tasks_blocked()
        takes_before = h.handle.calls.count("take")
        # Both deliver before the controller's take runs: their results come back in that one take.
        for name, mine in parcels.items():
            await h.handle.box.deliver(name, [("accepted", encode_group(finished(g))) for g in mine], b'{"x": 1}')
        came = sorted([(await h.out.receive()).group_id for _ in range(4)])
        await anyio.wait_all_tasks_blocked()
        # The take that was waiting carried all four; the loop has made one call since, which waits.
        assert h.handle.calls.count("take") - takes_before == 1
    assert came == sorted(g.group_id for g in h.groups)
    assert all(h.leases.lease(g.group_id).owner == "controller" for g in h.groups)  # type: ignore[union-attr]
    assert all(p.stats == {"x": 1} and not p.in_hand for p in h.rp.producers)
    metrics = h.rp.metrics()
    assert metrics["producers/results_per_take"] == 4 and metrics["producers/fenced_results"] == 0
    assert metrics["producers/groups_per_submit"] == 4 / h.handle.calls.count("post")


async def test_a_result_whose_lease_was_reassigned_is_fenced_and_the_rest_of_the_take_goes_on() -> None:
    async with running(1, 2) as h:
        (p,) = h.rp.producers
        first, second = h.groups
        mine = [decode_group(d) for d in await h.handle.box.collect(p.name)]
        await h.store.hand_over(second.group_id, owner=p.name, to="someone-else", lease_seconds=1e6)
        await h.handle.box.deliver(p.name, [("accepted", encode_group(finished(g))) for g in mine], b"{}")
        came = (await h.out.receive()).group_id
        while not h.rp.metrics()["producers/fenced_results"]:
            await h.rp.wait_slot_freed()
    assert came == first.group_id
    assert h.leases.get(second.group_id) == (GroupState.RUNNING, second)
    assert h.leases.lease(second.group_id).owner == "someone-else"  # type: ignore[union-attr]


async def test_a_producer_whose_stages_failed_is_given_up_at_the_next_take_and_its_mail_dropped() -> None:
    async with running(2, 2) as h:
        failing, other = h.rp.producers
        await h.handle.box.deliver(failing.name, [], None, "ValueError: the reward stage failed")
        while failing.lost is None:
            await h.rp.wait_slot_freed()
        assert "the reward stage failed" in failing.lost and other.lost is None
        # Its leases end at once and its group is settled as partial, to be served again.
        while failing.in_hand:
            await h.rp.wait_slot_freed()
        assert await h.handle.box.collect(failing.name) == []  # dropped: nothing more goes to it
    assert h.rp.metrics()["producers/reclaimed_groups"] == 1
    assert h.admission.outstanding == 1  # the other producer's group, still in hand


async def test_a_mailbox_that_fails_stops_the_run_with_an_error_naming_it() -> None:
    class Broken(MailboxHandle):
        def __init__(self) -> None:
            super().__init__()
            self.take = _Remote(self._fail, self.calls, "take")

        async def _fail(self) -> Any:
            raise ConnectionError("the actor died")

    with pytest.raises(ExceptionGroup) as caught:
        async with running(1, 0, handle=Broken()):
            await anyio.sleep_forever()
    errors = caught.value.exceptions
    while len(errors) == 1 and isinstance(errors[0], ExceptionGroup):
        errors = errors[0].exceptions
    (error,) = errors
    assert isinstance(error, PipelineError) and "producers' mailbox failed" in str(error)
    assert "the actor died" in str(error)

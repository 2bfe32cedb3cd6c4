"""The stages' store ports (`stages.store_ports`): each stage is typed by the store calls it makes,
`AsyncStore` has every one of them, and the Ray producer's outbox has those of the producer set
and nothing more. The real stages run against stand-ins that have only their port's calls, so a
stage that called anything else fails here (AttributeError), not only under mypy."""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import typing
from pathlib import Path
from typing import Any, Protocol

import anyio
import pytest

import stages.collector
import stages.dispenser
import stages.filter
import stages.generator
import stages.reward
from core.clock import VersionClock
from core.types import Group, PromptTask, SampleStatus
from launch.ray_producer import ProducerCore, ProducerSpec, ResultKind, _Outbox
from stages.admission import Admission
from stages.collector import Collector
from stages.dispenser import Dispenser
from stages.filter import FilterStage
from stages.generator import GeneratorPool
from stages.reward import RewardStage
from stages.selection import PromptSelection
from stages.store_ports import (
    CollectorStore,
    DispenserStore,
    FilterStore,
    PoolStore,
    ProducerStore,
    RewardStore,
)
from storage import AsyncStore, Cursor, GroupState, MemoryStore
from storage.codec import decode_group, encode_group
from tests.fakes import FakeSGLang
from tests.test_store import finished, fresh

pytestmark = pytest.mark.anyio

G = 2
PORTS: list[tuple[type, type, Any]] = [
    (Dispenser, DispenserStore, stages.dispenser),
    (GeneratorPool, PoolStore, stages.generator),
    (RewardStage, RewardStore, stages.reward),
    (FilterStage, FilterStore, stages.filter),
    (Collector, CollectorStore, stages.collector),
]


def members(port: type) -> set[str]:
    """The calls a Protocol names, its bases' included (typing.get_protocol_members is 3.13+)."""
    return {
        name
        for cls in port.__mro__
        if getattr(cls, "_is_protocol", False) and cls is not Protocol
        for name in vars(cls)
        if not name.startswith("_")
    }


class Only:
    """`store` seen through `port`: the port's calls reach it, any other is an AttributeError."""

    def __init__(self, port: type, store: object) -> None:
        self._port, self._names, self._store = port, members(port), store
        self.called: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        if name not in self._names:
            raise AttributeError(f"{name!r} is not a call of {self._port.__name__}")
        self.called.add(name)
        return getattr(self._store, name)


def test_the_outbox_has_the_producer_sets_calls_and_nothing_more() -> None:
    public = {name for name in dir(_Outbox) if not name.startswith("_")}
    assert public == members(ProducerStore) == members(PoolStore) | members(RewardStore) | members(FilterStore)
    assert public == {"put_partial", "put_failed", "put_rejected_groups"}
    assert not issubclass(_Outbox, AsyncStore)


@pytest.mark.parametrize(("stage", "port", "module"), PORTS, ids=lambda x: getattr(x, "__name__", ""))
def test_each_stage_is_typed_by_its_port_and_calls_only_it(stage: type, port: type, module: Any) -> None:
    assert typing.get_type_hints(stage.__init__)["store"] is port
    called = set(re.findall(r"self\._store\.(\w+)", Path(module.__file__).read_text()))
    assert called and called <= members(port), f"{stage.__name__} calls {sorted(called - members(port))}"


@pytest.mark.parametrize("port", [p for _, p, _ in PORTS], ids=lambda p: p.__name__)
def test_async_store_has_every_port_call_with_its_parameters(port: type) -> None:
    for name in members(port):
        theirs, ours = getattr(AsyncStore, name), getattr(port, name)
        assert inspect.iscoroutinefunction(theirs) and inspect.iscoroutinefunction(ours), name
        wanted = list(inspect.signature(ours).parameters)
        assert list(inspect.signature(theirs).parameters)[: len(wanted)] == wanted, name


async def test_the_dispenser_and_the_collector_run_through_their_ports_alone() -> None:
    async with AsyncStore(MemoryStore()) as store:
        await store.admit([fresh(0)], Cursor(0, 1, 1))
        await store.put_partial(fresh(0))
        admission = Admission()
        dispensing = Only(DispenserStore, store)
        prompts = [fresh(i).task for i in range(6)]
        # Reading the histories (for length-aware order) is one of its calls too.
        selection = PromptSelection(longest_first=True)
        dispenser = Dispenser(
            dispensing, prompts, n_samples=2, clock=VersionClock(), admission=admission, batch=4, selection=selection
        )
        admission.grant(3)
        send, receive = anyio.create_memory_object_stream[Group](0)
        async with receive, anyio.create_task_group() as tg:
            await tg.start(dispenser.run, send)
            with anyio.fail_after(5):
                got = [await receive.receive() for _ in range(3)]
            tg.cancel_scope.cancel()
        assert [g.task.index for g in got] == [0, 1, 2]  # the partial one first
        assert dispensing.called == members(DispenserStore)

        collecting = Only(CollectorStore, store)
        collector = Collector(store=collecting, admission=admission, capacity=math.inf, batch=4)
        send, receive = anyio.create_memory_object_stream[Group](4)
        for g in got:
            send.send_nowait(finished(g, 0))
        async with anyio.create_task_group() as tg:
            await tg.start(collector.run, receive)
            with anyio.fail_after(5):
                await collector.wait_ready(3)
            send.close()
        assert collecting.called == members(CollectorStore)
        assert await store.count(GroupState.READY) == 3


def reward(task: PromptTask, sample: object) -> float:
    if task.index == 1:
        raise RuntimeError("no reward for prompt 1")
    return float(task.index)


def keep(group: Group) -> bool:
    return group.task.index != 2


def group(i: int) -> Group:
    return Group.fresh(PromptTask(index=i, prompt_ids=(5, 100 + i)), epoch=0, n_samples=G, version=0, seq=i)


async def test_the_producers_real_stages_leave_every_way_through_the_outbox_alone() -> None:
    """Accepted (stream), failed (reward), rejected (filter) and partial (pool, at an abort-mode
    publish) each come back as their kind: the pool, reward and filter ran against an outbox that
    has only `ProducerStore`'s calls, so a stage reaching for anything else would end the run."""
    spec = ProducerSpec(
        name="producer-0",
        engine_urls=(),
        router_url=None,
        group_slots=3,
        n_samples=G,
        sampling_params={},
        max_response_len=6,
        reward_path="tests.test_store_ports:reward",
        filter_path="tests.test_store_ports:keep",
    )
    async with FakeSGLang(weight_version="0") as fake:
        core = ProducerCore(dataclasses.replace(spec, engine_urls=(fake.url,)), node="here")
        async with anyio.create_task_group() as tg:
            await tg.start(core.run)
            await core.submit_many([encode_group(group(i)) for i in range(3)])
            taken: dict[str, Group] = {}
            with anyio.fail_after(10):
                while len(taken) < 3:
                    for kind, data in await core.take_results(8):
                        taken[kind] = decode_group(data)
            assert {k: g.task.index for k, g in taken.items()} == {
                ResultKind.ACCEPTED.value: 0,
                ResultKind.FAILED.value: 1,
                ResultKind.REJECTED.value: 2,
            }
            assert any(s.status is SampleStatus.FAILED for s in taken[ResultKind.FAILED.value].samples)

            fake.hold(2)  # the next group parks after two tokens: the publish finds it running
            await core.submit(encode_group(group(3)))
            with anyio.fail_after(10):
                await fake.wait_until(lambda: fake.held == G)
                ((kind, data),) = await core.begin_publish(1, "abort", False)
            assert kind == ResultKind.PARTIAL.value and decode_group(data).task.index == 3
            fake.release()
            tg.cancel_scope.cancel()

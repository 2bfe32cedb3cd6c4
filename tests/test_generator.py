"""The generator pool on its own, with an in-process engine that speaks the client's result type."""

from __future__ import annotations

import anyio
import pytest

from core.clock import VersionClock
from core.errors import EngineError
from core.types import Group, PromptTask, SampleStatus
from stages.admission import Admission, Outcome
from stages.generator import SAMPLE_ATTEMPTS, GeneratorPool
from stages.sglang_client import GenerateResult
from storage import AsyncStore, Cursor, GroupState, MemoryStore

pytestmark = pytest.mark.anyio

POISON = 99


class PoisonPromptEngine:
    """Answers every request with three tokens, except prompts starting with POISON: those get a
    500, as an engine that crashes on one input would answer."""

    def __init__(self) -> None:
        self.calls: dict[int, int] = {}

    async def generate(self, input_ids, sampling_params, *, rid):
        self.calls[input_ids[0]] = self.calls.get(input_ids[0], 0) + 1
        if input_ids[0] == POISON:
            raise EngineError("http://engine", "internal error", status=500)
        payload = {
            "meta_info": {
                "id": rid,
                "finish_reason": {"type": "stop", "matched": 0},
                "weight_version": "0",
                "output_token_logprobs": [[-0.5, 7, None], [-0.5, 8, None], [-0.1, 0, None]],
            }
        }
        return GenerateResult.from_response(payload, url="http://engine", rid=rid)

    async def abort_all(self):
        pass


async def test_a_request_that_never_gets_an_answer_fails_its_sample_visibly():
    store = AsyncStore(MemoryStore())
    admission, clock, engine = Admission(), VersionClock(), PoisonPromptEngine()
    pool = GeneratorPool(
        engine, slots=16, sampling_params={}, max_response_len=8, clock=clock, store=store, admission=admission
    )
    poison = Group.fresh(PromptTask(0, (POISON, 1)), epoch=0, n_samples=1, version=0, seq=0)
    healthy = Group.fresh(PromptTask(1, (5, 1)), epoch=0, n_samples=2, version=0, seq=1)
    await store.admit([poison, healthy], Cursor(0, 2, 2))
    admission.grant(2)
    to_pool_send, to_pool = anyio.create_memory_object_stream(0)
    out_send, out = anyio.create_memory_object_stream(4)
    with anyio.fail_after(10), to_pool_send, out:
        async with anyio.create_task_group() as tg:
            await tg.start(pool.run, to_pool, out_send)
            for g in (poison, healthy):
                await admission.take_ticket()
                await to_pool_send.send(g)
            done = await out.receive()  # the healthy group goes downstream
            assert done.group_id == healthy.group_id and done.finished
            admission.settle(Outcome.READY)
            await admission.wait_settled()  # the poison group is settled as failed
            tg.cancel_scope.cancel()
    state, failed = await store.get(poison.group_id)
    assert state is GroupState.FAILED
    sample = failed.samples[0]
    assert sample.status is SampleStatus.FAILED and "no answer after" in sample.error
    assert engine.calls[POISON] == SAMPLE_ATTEMPTS + 1  # bounded, not retried forever


class OverloadedRouterEngine(PoisonPromptEngine):
    """A router over its concurrency limit: the first `busy` requests get 429 (after the client's
    own retries), the rest an answer."""

    def __init__(self, busy: int) -> None:
        super().__init__()
        self.busy = busy

    async def generate(self, input_ids, sampling_params, *, rid):
        if self.busy > 0:
            self.busy -= 1
            raise EngineError("http://router", "request q: (empty body)", status=429)
        return await super().generate(input_ids, sampling_params, rid=rid)


async def test_an_overloaded_router_is_no_fault_of_the_sample():
    """429 and 408 say the router is saturated, not that the request is bad: the sample is tried
    again like one that found no engine, rather than failed at once as a refused request is."""
    store = AsyncStore(MemoryStore())
    admission, clock, engine = Admission(), VersionClock(), OverloadedRouterEngine(busy=SAMPLE_ATTEMPTS)
    pool = GeneratorPool(
        engine, slots=16, sampling_params={}, max_response_len=8, clock=clock, store=store, admission=admission
    )
    group = Group.fresh(PromptTask(1, (5, 1)), epoch=0, n_samples=1, version=0, seq=0)
    await store.admit([group], Cursor(0, 1, 1))
    admission.grant(1)
    to_pool_send, to_pool = anyio.create_memory_object_stream(0)
    out_send, out = anyio.create_memory_object_stream(4)
    with anyio.fail_after(10), to_pool_send, out:
        async with anyio.create_task_group() as tg:
            await tg.start(pool.run, to_pool, out_send)
            await admission.take_ticket()
            await to_pool_send.send(group)
            done = await out.receive()
            tg.cancel_scope.cancel()
    assert done.finished and done.samples[0].status is SampleStatus.COMPLETED
    assert pool.statistics().failed_samples == 0

"""Multi-turn agents in the generator pool, against the real built-in engine (a tiny Qwen3 over real
HTTP): transcript alignment (tokens, log-probs, masks, spans), aborts mid-turn and between turns that
the agent continues rather than restarts, agent state through LMDB, and agent failures recorded on
the sample. Ordering comes from the engine's own state and from events the agent waits on.
"""

from __future__ import annotations

import functools
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from core.clock import VersionClock
from core.types import Group, PromptTask, Sample, SampleStatus
from engines.builtin import open_server
from pipeline.tasks.tiny_model import make_model_folder
from pipeline.tasks.toy import encode
from stages.admission import Admission
from stages.agent import AGENT_KEY, Agent, AgentContext
from stages.collector import Collector
from stages.dispenser import Dispenser
from stages.generator import GeneratorPool
from stages.sglang_client import EngineFleet, GenerateResult
from storage import AsyncStore, GroupState, LmdbStore, MemoryStore

pytestmark = pytest.mark.anyio

TURN_LEN = 6  # model tokens per turn (ignore_eos: every turn ends on its budget)
TOOL = encode("=42.")  # what the scripted tool answers
STEPS = 5  # model, tool, model, tool, model
N_SAMPLES = 2
PROMPT = encode("ask:")
PARAMS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_folder(tmp_path_factory.mktemp("agents") / "v0", hidden_size=32, num_layers=2, seed=0)


class Recording:
    """The fleet, keeping each request's input and answer (what the samples are checked against)."""

    def __init__(self, fleet: EngineFleet) -> None:
        self.fleet = fleet
        self.requests: list[tuple[str, tuple[int, ...], GenerateResult]] = []

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], *, rid: str) -> Any:
        result = await self.fleet.generate(input_ids, sampling_params, rid=rid)
        self.requests.append((rid, tuple(input_ids), result))
        return result

    async def abort_all(self) -> None:
        await self.fleet.abort_all()


class ToolGate:
    """Holds the scripted agent inside its tool call until the test lets it go."""

    def __init__(self) -> None:
        self.entered = anyio.Event()
        self.release = anyio.Event()
        self.closed = False

    async def call(self) -> None:
        if self.closed:
            return
        self.entered.set()
        await self.release.wait()


GATE: ToolGate | None = None


async def scripted(ctx: AgentContext, sample: Sample) -> None:
    """model turn, tool answer, model turn, tool answer, model turn: a state machine over ctx.state,
    so a resumed sample continues where it stopped."""
    ctx.state["entries"] = ctx.state.get("entries", 0) + 1
    while (step := ctx.state.get("step", 0)) < STEPS:
        if step % 2 == 0:
            await ctx.generate(max_new_tokens=TURN_LEN)
        else:
            if GATE is not None and sample.index == 0:
                await GATE.call()
            ctx.append(TOOL)
        ctx.state["step"] = step + 1
        ctx.state.setdefault("done", []).append(step)


@dataclass
class Rig:
    pool: GeneratorPool
    admission: Admission
    engine: Recording
    server: Any
    store: AsyncStore


@asynccontextmanager
async def rig(model_dir: Path, store: AsyncStore, agent: Agent, n_prompts: int = 1) -> AsyncIterator[Rig]:
    clock, admission = VersionClock(), Admission()
    dataset = [PromptTask(index=k, prompt_ids=PROMPT + encode("abcd"[k])) for k in range(n_prompts)]
    async with (
        open_server(model_dir, port=0, weight_version="0", health_check_timeout=0.5) as server,
        EngineFleet([server.url], concurrency=8) as fleet,
        anyio.create_task_group() as tg,
    ):
        engine = Recording(fleet)
        pool = GeneratorPool(
            engine,
            slots=8,
            sampling_params=PARAMS,
            max_response_len=64,
            clock=clock,
            store=store,
            admission=admission,
            agent=agent,
        )
        to_pool_send, to_pool = anyio.create_memory_object_stream[Group](0)
        to_collect_send, to_collect = anyio.create_memory_object_stream[Group](4)
        await tg.start(
            Dispenser(store, dataset, n_samples=N_SAMPLES, clock=clock, admission=admission).run, to_pool_send
        )
        await tg.start(pool.run, to_pool, to_collect_send)
        await tg.start(Collector(store=store, admission=admission, capacity=math.inf).run, to_collect)
        yield Rig(pool, admission, engine, server, store)
        tg.cancel_scope.cancel()


def check_alignment(sample: Sample) -> None:
    """Model turns: mask 1 and the engine's log-probs; tool answers: mask 0, log-prob 0.0, in place."""
    turn = TURN_LEN
    expected_mask = (1,) * turn + (0,) * len(TOOL) + (1,) * turn + (0,) * len(TOOL) + (1,) * turn
    assert sample.loss_mask == expected_mask
    tool_at = [turn, 2 * turn + len(TOOL)]
    for at in tool_at:
        assert sample.response_ids[at : at + len(TOOL)] == TOOL
        assert sample.logprobs[at : at + len(TOOL)] == (0.0,) * len(TOOL)
    assert all(lp < 0 for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if m)
    assert sample.spans and sample.spans[0].start == 0 and sample.spans[-1].end == sample.response_len


async def run_uninterrupted(model_dir: Path) -> tuple[Group, Recording]:
    global GATE
    GATE = None
    store = MemoryStore()
    async with rig(model_dir, AsyncStore(store), scripted) as r:
        with anyio.fail_after(120):
            r.admission.grant(1)
            await r.admission.wait_settled()
    [group] = store.groups(GroupState.READY)
    return group, r.engine


async def test_a_multi_turn_transcript_keeps_every_model_token_and_masks_the_tools(model_dir: Path) -> None:
    group, engine = await run_uninterrupted(model_dir)
    answers = {rid: (ids, res) for rid, ids, res in engine.requests}
    for sample in group.samples:
        assert sample.status is SampleStatus.COMPLETED
        check_alignment(sample)
        assert sample.metadata[AGENT_KEY]["state"] == {"entries": 1, "step": STEPS, "done": list(range(STEPS))}
        assert sample.metadata[AGENT_KEY]["turns"] == 3
        # Each model turn was one request on the whole transcript so far, and its answer is what
        # the sample holds, log-prob for log-prob.
        for start in (0, TURN_LEN + len(TOOL), 2 * (TURN_LEN + len(TOOL))):
            ids, res = answers[f"{group.group_id}-s{sample.index}-{start}"]
            assert ids == sample.prompt_ids + sample.response_ids[:start]
            assert sample.response_ids[start : start + TURN_LEN] == tuple(res.token_ids)
            assert sample.logprobs[start : start + TURN_LEN] == tuple(res.logprobs)


async def stop_mid_turn(r: Rig, lmdb: LmdbStore) -> Group:
    """Admit one group and stop the pool once both samples' first turns are decoding; the partial
    group it stored, each sample part way through its turn or before it."""
    r.admission.grant(1)
    while r.server.core.statistics().num_running < N_SAMPLES:
        await r.server.core.wait_step()
    await r.server.core.wait_step()
    await r.pool.stop()
    await r.admission.wait_settled()
    [partial] = lmdb.groups(GroupState.PARTIAL)
    assert any(0 < s.response_len < TURN_LEN for s in partial.samples)
    return partial


async def test_aborts_mid_turn_and_between_turns_continue_the_same_conversation(
    model_dir: Path, tmp_path: Path
) -> None:
    reference, _ = await run_uninterrupted(model_dir)
    global GATE
    GATE = ToolGate()
    lmdb = LmdbStore(tmp_path / "store")
    store = AsyncStore(lmdb)
    try:
        async with rig(model_dir, store, scripted) as r:
            with anyio.fail_after(120):
                # 1. mid-turn.
                partial = await stop_mid_turn(r, lmdb)
                # 2. between turns: sample 0 stops inside its tool call.
                r.pool.resume()
                r.admission.grant(1)
                await GATE.entered.wait()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(r.pool.stop)
                    while not r.pool.statistics().aborted_requests and r.pool.statistics().running_requests:
                        await r.server.core.wait_step()
                    GATE.release.set()
                await r.admission.wait_settled()
                state, between = lmdb.get(partial.group_id)
                assert state is GroupState.PARTIAL
                first = between.samples[0]
                assert first.response_ids[TURN_LEN:] == TOOL  # the tool answer was kept, not redone
                assert first.metadata[AGENT_KEY]["state"]["step"] == 2
                # 3. run to the end.
                GATE.closed = True
                r.pool.resume()
                r.admission.grant(1)
                await r.admission.wait_settled()
        [group] = lmdb.groups(GroupState.READY)
    finally:
        GATE = None
        await store.aclose()
    for sample, ref in zip(group.samples, reference.samples, strict=True):
        assert sample.status is SampleStatus.COMPLETED
        check_alignment(sample)
        assert sample.response_ids == ref.response_ids  # the same conversation, not a new one
        assert sample.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        state = sample.metadata[AGENT_KEY]["state"]
        assert state["done"] == list(range(STEPS)) and state["entries"] >= 2  # re-entered, never redone
    assert any(s.resumed_at for s in group.samples)  # a turn was continued mid-way


async def careless(ctx: AgentContext, sample: Sample) -> None:
    """`scripted`, with every step in an `except Exception`, as tool-calling code often has it; and
    the second sample runs its model turns in a task group of its own."""
    while (step := ctx.state.get("step", 0)) < STEPS:
        try:
            if step % 2 == 1:
                ctx.append(TOOL)
            elif sample.index == 0:
                await ctx.generate(max_new_tokens=TURN_LEN)
            else:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(functools.partial(ctx.generate, max_new_tokens=TURN_LEN))
        except Exception:
            ctx.state["swallowed"] = ctx.state.get("swallowed", 0) + 1
            continue
        ctx.state["step"] = step + 1


async def test_an_interruption_gets_through_an_agents_except_exception_and_its_task_groups(
    model_dir: Path, tmp_path: Path
) -> None:
    """Were `AgentInterrupted` an Exception, the careless agent would catch it, call `ctx.generate`
    again, be interrupted again, and the stop would never end."""
    lmdb = LmdbStore(tmp_path / "store")
    store = AsyncStore(lmdb)
    try:
        async with rig(model_dir, store, careless) as r:
            with anyio.fail_after(60):
                await stop_mid_turn(r, lmdb)
                r.pool.resume()
                r.admission.grant(1)
                await r.admission.wait_settled()
        [group] = lmdb.groups(GroupState.READY)
    finally:
        await store.aclose()
    for sample in group.samples:
        assert sample.status is SampleStatus.COMPLETED
        check_alignment(sample)
        assert "swallowed" not in sample.metadata[AGENT_KEY]["state"]


async def broken(ctx: AgentContext, sample: Sample) -> None:
    await ctx.generate(max_new_tokens=2)
    if ctx.group.task.index == 1 and sample.index == 0:
        raise ValueError("the tool is down")
    if ctx.group.task.index == 2 and sample.index == 0:
        ctx.state["handle"] = object()
        ctx.append(TOOL)
    if ctx.group.task.index == 3 and sample.index == 0:
        await ctx.generate(max_new_tokens=2, n=2)  # SGLang would answer a list of two


async def test_agent_failures_are_recorded_on_the_sample_and_the_pool_keeps_going(model_dir: Path) -> None:
    store = MemoryStore()
    async with rig(model_dir, AsyncStore(store), broken, n_prompts=4) as r:
        with anyio.fail_after(120):
            r.admission.grant(4)
            await r.admission.wait_settled()
    [ready] = store.groups(GroupState.READY)
    assert ready.task.index == 0 and all(s.status is SampleStatus.COMPLETED for s in ready.samples)
    failed = {g.task.index: g.samples[0] for g in store.groups(GroupState.FAILED)}
    assert set(failed) == {1, 2, 3}
    assert "{'n': 2}" in failed[3].error and "must be 1" in failed[3].error and failed[3].response_len == 2
    assert "tests.test_agents:broken" in failed[1].error and "ValueError: the tool is down" in failed[1].error
    assert "tests.test_agents:broken" in failed[2].error and "ctx.state['handle']" in failed[2].error
    assert "<object object" in failed[2].error
    # What the failing agent generated is kept on the sample for inspection.
    assert failed[1].response_len == 2 and failed[1].loss_mask == (1, 1)


def test_the_agent_flag_resolves_at_config_load_and_a_bad_path_names_the_flag() -> None:
    from core.errors import ConfigError
    from pipeline.config import load_config

    config = load_config(["--custom-generate-function-path", "tests.test_agents:scripted"])
    assert config.data.agent_fn is scripted
    assert load_config(["--task", "tool"]).data.task == "tool"
    with pytest.raises(ConfigError) as caught:
        load_config(["--custom-generate-function-path", "tests.test_agents:no_such_agent", "--task", "chess"])
    message = str(caught.value)
    assert "--custom-generate-function-path" in message and "no_such_agent" in message
    assert "--task" in message and "chess" in message

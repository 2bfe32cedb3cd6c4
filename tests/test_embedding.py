"""`pipeline.Rollout` in a loop the user owns, stopped and opened again on the same store: what a
user embedding the pipeline relies on (docs/agents-and-embedding.md, "Embedding"). Real parts: the LMDB store, real HTTP
to the protocol-speaking fake engine, the real stage graph."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from core.types import Group, PromptTask, Sample
from pipeline import (
    Agent,
    AgentContext,
    AsyncStore,
    EngineError,
    EngineFleet,
    LmdbStore,
    MemoryStore,
    Rollout,
    RolloutMode,
    RolloutPlan,
)
from storage import Cursor, GroupState
from tests.fakes import FakeSGLang

pytestmark = pytest.mark.anyio

DATASET = [PromptTask(index=i, prompt_ids=(5, 6, 7), label=i) for i in range(32)]


def reward(task: PromptTask, sample: Sample) -> float:
    return float(sample.response_len % 2)


def plan(steps: int) -> RolloutPlan:
    return RolloutPlan(mode=RolloutMode.SYNC, batch_size=2, n_samples=2, num_steps=steps, slots=8, max_response_len=4)


async def train(path: Path, steps: int, *, start_version: str) -> tuple[list[int], int]:
    """Open a Rollout over the LMDB store at `path` and train up to `steps`; (trained prompt
    indices, the version served at the start)."""
    trained: list[int] = []
    async with FakeSGLang(weight_version=start_version) as fake:
        async with (
            EngineFleet([fake.url], concurrency=8) as fleet,
            AsyncStore(LmdbStore(path)) as store,
            Rollout(plan(steps), engines=fleet, store=store, dataset=DATASET, reward_fn=reward) as rollout,
        ):
            first_version = rollout.version
            with anyio.fail_after(10):
                while rollout.next_step < steps:
                    batch = await rollout.next_batch()
                    trained += [g.task.index for g in batch.groups]
                    folder = path.parent / f"v{rollout.version + 1}"
                    folder.mkdir(exist_ok=True)
                    await rollout.commit(batch, {"loss": 0.0})
                    await rollout.publish(folder)
    return trained, first_version


async def test_a_rollout_opened_after_an_unclean_stop_continues_the_groups_it_left_running(tmp_path: Path) -> None:
    # What a process killed mid-round leaves: prompts 0 and 1 admitted and RUNNING, no step trained.
    with LmdbStore(tmp_path / "state") as store:
        store.admit([Group.fresh(DATASET[i], epoch=0, n_samples=2, version=0, seq=i) for i in (0, 1)], Cursor(0, 2, 2))
    trained, _ = await train(tmp_path / "state", 2, start_version="0")
    # No prompt skipped: the groups the dead process held are trained first, not left RUNNING forever.
    assert sorted(trained) == [0, 1, 2, 3]
    with LmdbStore(tmp_path / "state", readonly=True) as store:
        assert store.count(GroupState.RUNNING) == 0


async def test_a_rollout_opened_again_serves_the_version_after_the_last_trained_step(tmp_path: Path) -> None:
    trained, first = await train(tmp_path / "state", 2, start_version="0")
    assert (first, sorted(trained)) == (0, [0, 1, 2, 3])
    # The user's engines serve the weights of step 1 (version 2) again; the clock must agree, or
    # every answer is "a version the clock did not publish" (and new weights would overwrite v1).
    trained, first = await train(tmp_path / "state", 4, start_version="2")
    assert (first, sorted(trained)) == (2, [4, 5, 6, 7])
    assert (tmp_path / "v4").is_dir() and not (tmp_path / "v5").exists()


async def test_engines_that_report_another_version_are_refused_on_entry_with_the_fix(tmp_path: Path) -> None:
    # A fresh real SGLang says "default"; a resumed loop that forgot to load its weights says "0".
    # Either way every answer would be refused as "from an unpublished version", forever.
    await train(tmp_path / "state", 1, start_version="0")
    for reported, expected in (("default", "--weight-version 1"), ("0", "weight_version='1'")):
        async with FakeSGLang(weight_version=reported) as fake, EngineFleet([fake.url]) as fleet:
            async with AsyncStore(LmdbStore(tmp_path / "state")) as store:
                rollout = Rollout(plan(2), engines=fleet, store=store, dataset=DATASET, reward_fn=reward)
                with pytest.raises(EngineError, match=f"weight_version {reported!r}.*version 1") as err:
                    await rollout.__aenter__()
            assert fake.url in str(err.value) and expected in str(err.value)
            assert not fake.finished, "a request went out before the versions were checked"


async def test_the_fix_named_for_a_first_start_is_a_load_never_a_relabel() -> None:
    """Issue 45.1: the fix named was `update_weight_version('0')`, which labels whatever weights the
    engine holds (a reused engine's: another run's) as the base model's."""
    for reported in ("default", "3"):
        async with FakeSGLang(weight_version=reported) as fake, EngineFleet([fake.url]) as fleet:
            async with AsyncStore(MemoryStore()) as store:
                rollout = Rollout(plan(1), engines=fleet, store=store, dataset=DATASET, reward_fn=reward)
                with pytest.raises(EngineError, match=f"weight_version {reported!r}.*version 0") as err:
                    await rollout.__aenter__()
            said = str(err.value)
            assert "update_weights_from_disk(base_model_folder, weight_version='0')" in said
            assert "`await engines.update_weight_version" not in said


async def first_failed_group(agent: Agent) -> Group:
    """Run `agent` until a group fails; that group, as stored."""
    async with (
        FakeSGLang(weight_version="0") as fake,
        EngineFleet([fake.url]) as fleet,
        AsyncStore(MemoryStore()) as store,
        Rollout(plan(1), engines=fleet, store=store, dataset=DATASET, reward_fn=reward, agent=agent) as rollout,
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(rollout.next_batch)  # a batch never fills: every sample fails
            with anyio.fail_after(10):
                while rollout.statistics()["groups/failed_total"] < 1:
                    await rollout.graph.admission.wait_change()
            tg.cancel_scope.cancel()
        first, *_ = await store.groups(GroupState.FAILED)
    return first


async def test_an_agent_that_keeps_generating_past_its_budget_fails_its_sample_not_the_pool() -> None:
    calls = 0

    async def greedy(ctx: AgentContext, sample: Sample) -> None:
        nonlocal calls
        while True:  # a bug: no `ctx.remaining` check; a turn at no budget returned at once, forever
            calls += 1
            if calls > 10_000:  # before the fix this agent held the event loop forever: end the test
                raise RuntimeError("still looping")
            await ctx.generate(max_new_tokens=3)

    failed = await first_failed_group(greedy)
    errors = {s.error for s in failed.samples}
    assert len(errors) == 1 and "no token budget left" in str(errors.pop())
    assert calls < 100


async def test_an_agent_that_appends_text_is_told_to_tokenize_it() -> None:
    async def chatty(ctx: AgentContext, sample: Sample) -> None:
        ctx.append("the tool says 42")  # type: ignore[arg-type]

    failed = await first_failed_group(chatty)
    assert all("ctx.append takes token ids, not text" in str(s.error) for s in failed.samples)

"""The controller's rollout policies over real HTTP to a protocol-speaking fake engine.

The fake decodes one token per event-loop turn for every running request, so short responses
finish long before long ones: the long tail that partial rollout is for. Its tokens are a pure
function of (seed, context), which lets each trained response be checked token for token against
what an uninterrupted request would have produced.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import anyio
import pytest

from core.types import Batch, PromptTask, SampleStatus
from pipeline import RolloutPlan, run_pipeline
from pipeline.metrics import MetricsSink
from stages.sglang_client import EngineFleet
from storage import AsyncStore, GroupState, LmdbStore, MemoryStore
from tests.fakes import FakeSGLang

pytestmark = pytest.mark.anyio

EOS = 0
SHORT, LONG = 3, 40
MAX_LEN = 48


def lengths_by_prompt(context, seed):
    """A response's length is chosen by its prompt's first token: SHORT or LONG, then EOS."""
    prompt_len = 2
    want = context[0]
    produced = len(context) - prompt_len
    if produced >= want:
        return EOS
    return 1 + (hash((seed, len(context))) % 50)


def dataset(n):
    # Even rows want short answers, odd rows long ones.
    return [PromptTask(index=i, prompt_ids=(SHORT if i % 2 == 0 else LONG, 100 + i), label=i) for i in range(n)]


class RecordingTrainer:
    def __init__(self):
        self.batches: list[Batch] = []

    def train_step(self, batch):
        self.batches.append(batch)
        return {"loss": 0.0}

    def save_weights(self, path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        return path


def reward(task, sample):
    return float(sample.response_len % 3)


def expected_response(prompt_ids, seed):
    context = list(prompt_ids)
    out = []
    while len(out) < MAX_LEN:
        tok = lengths_by_prompt(context, seed)
        out.append(tok)
        context.append(tok)
        if tok == EOS:
            break
    return out


@pytest.fixture(params=["memory", "lmdb"])
def store(request, tmp_path):
    s = MemoryStore() if request.param == "memory" else LmdbStore(tmp_path / "rollout")
    yield s
    s.close()


async def drive_long_tail(fake, step=4):
    """Let parked requests decode `step` more tokens only when nothing else can move.

    Short responses finish below the first hold; long ones advance a few tokens each time the
    whole pipeline is otherwise blocked. So the long tail is still running whenever a round has
    enough groups, whatever the timing of threads and sockets.
    """
    fake.hold(step)
    while True:
        await fake.wait_until(lambda: fake.running > 0 and fake.held == fake.running)
        await anyio.wait_all_tasks_blocked()
        if fake.running > 0 and fake.held == fake.running:
            fake.hold(fake.hold_at + step)


async def run(plan, store, tmp_path, fake, sink=None):
    trainer = RecordingTrainer()
    async with EngineFleet([fake.url], concurrency=plan.slots) as fleet, anyio.create_task_group() as tg:
        tg.start_soon(drive_long_tail, fake)
        await fleet.update_weight_version("0")
        with anyio.fail_after(60):
            summary = await run_pipeline(
                plan,
                engines=fleet,
                store=AsyncStore(store),
                trainer=trainer,
                dataset=dataset(64),
                reward_fn=reward,
                filter_fn=None,
                weights_dir=tmp_path / "w",
                metrics=sink or MetricsSink(None),
            )
        tg.cancel_scope.cancel()
    return trainer, summary


def plan(**kw):
    base = dict(mode="sync", batch_size=2, n_samples=2, num_steps=4, slots=16, max_response_len=MAX_LEN, seed=7)
    base.update(kw)
    return RolloutPlan(**base)


def check_batches(trainer, store, fake_seed_of):
    ids = [g.group_id for b in trainer.batches for g in b.groups]
    assert len(ids) == len(set(ids)), "a group was trained twice"
    for b in trainer.batches:
        assert len(b.groups) == 2
        for g in b.groups:
            for s in g.samples:
                assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
                # token-exact across every abort and continuation
                assert list(s.response_ids) == expected_response(s.prompt_ids, fake_seed_of[(g.group_id, s.index)])
    counts = {st: store.count(st) for st in GroupState}
    assert counts[GroupState.TRAINED] == len(ids)
    assert counts[GroupState.RUNNING] == 0  # everything ended somewhere when the run stopped


async def test_sync_trains_full_batches_of_finished_groups(store, tmp_path):
    async with FakeSGLang(token_fn=lengths_by_prompt, eos_token_id=EOS) as fake:
        trainer, summary = await run(plan(), store, tmp_path, fake)
        seeds = {(r.rid.rsplit("-s", 1)[0], int(r.rid.rsplit("-s", 1)[1].split("-")[0])): r.seed for r in fake.finished}
    assert summary.final_version == 4 and len(trainer.batches) == 4
    # sync waits for stragglers: nothing is ever aborted, so nothing is partial
    assert all(not s.resumed_at for b in trainer.batches for s in b.samples)
    assert store.count(GroupState.PARTIAL) == 0
    assert [b.groups[0].samples[0].spans[0].version for b in trainer.batches] == [0, 1, 2, 3]
    check_batches(trainer, store, seeds)


async def test_partial_rollout_aborts_the_tail_and_resumes_it_token_exact(store, tmp_path):
    async with FakeSGLang(token_fn=lengths_by_prompt, eos_token_id=EOS) as fake:
        trainer, _summary = await run(plan(partial=True, over_sampling=4, num_steps=6), store, tmp_path, fake)
        seeds = {(r.rid.rsplit("-s", 1)[0], int(r.rid.rsplit("-s", 1)[1].split("-")[0])): r.seed for r in fake.finished}
    assert len(trainer.batches) == 6
    aborted = [r for r in fake.finished if r.aborted]
    assert aborted, "the long tail was never aborted"
    resumed = [s for b in trainer.batches for s in b.samples if s.resumed_at]
    assert resumed, "no aborted prefix was ever continued"
    # A continued sample carries both versions, each token its own.
    assert any(len(s.versions) > 1 for s in resumed)
    # Partial groups are served before new prompts: every long group aborted in a round is
    # trained before any long prompt admitted after it.
    check_batches(trainer, store, seeds)


async def test_surplus_groups_finished_during_the_drain_are_kept(tmp_path):
    store = MemoryStore()
    async with FakeSGLang(token_fn=lengths_by_prompt, eos_token_id=EOS) as fake:
        # over-sample 6 groups for a batch of 2: three short groups can be ready at once
        trainer, _ = await run(plan(partial=True, over_sampling=6, num_steps=3), store, tmp_path, fake)
    trained = Counter(g.task.index % 2 for b in trainer.batches for g in b.groups)
    admitted = store.statistics().cursor.index
    accounted = sum(store.count(s) for s in GroupState)
    assert accounted == admitted, "an admitted group is missing from the store"
    assert trained[0] >= 2


async def test_step_metrics_split_time_and_count_throughput(tmp_path):
    sink = MetricsSink(None)
    async with FakeSGLang(token_fn=lengths_by_prompt, eos_token_id=EOS) as fake:
        await run(plan(num_steps=3), MemoryStore(), tmp_path, fake, sink)
    for r in sink.records:
        assert 0.0 <= r["trainer/idle_frac"] <= 1.0
        assert 0.0 < r["engine/busy_frac"] <= 1.0
        assert r["groups/per_second"] > 0 and r["perf/step_time"] >= r["perf/train_wait_time"]
        # sync: every group of a batch was admitted and finished within its own step
        assert 0.0 < r["time/group_in_flight_mean"] <= r["perf/step_time"]
        assert r["time/group_queued_mean"] >= 0.0
    # Without a checkpoint policy every step saves a full checkpoint, so the newest checkpoint is
    # the step itself: the garbage collector's bound (it never collects past it) moves with it.
    assert [r["checkpoint/step"] for r in sink.records] == [r["step"] for r in sink.records] == [0, 1, 2]


async def test_idle_slots_take_more_groups_while_a_partial_round_waits(tmp_path):
    admitted = {}
    for fill in (False, True):
        store = MemoryStore()
        async with FakeSGLang(token_fn=lengths_by_prompt, eos_token_id=EOS) as fake:
            trainer, _ = await run(
                plan(partial=True, over_sampling=2, num_steps=3, fill_idle_slots=fill),
                store,
                tmp_path / str(fill),
                fake,
            )
        admitted[fill] = store.statistics().cursor.index
        check_batches(
            trainer,
            store,
            {(r.rid.rsplit("-s", 1)[0], int(r.rid.rsplit("-s", 1)[1].split("-")[0])): r.seed for r in fake.finished},
        )
        # still nothing lost: every admitted group is somewhere in the store
        assert sum(store.count(s) for s in GroupState) == admitted[fill]
    # slime's rule stops admitting once ready + in flight covers the batch; idle slots do not
    assert admitted[True] > admitted[False]

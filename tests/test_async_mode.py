"""Async mode and the publish protocol, over real HTTP to the protocol-speaking fake engine.

The stages are the real ones (dispenser, generator pool, collector, `publish_weights`, the
controller); only the engine is the fake. Ordering comes from the fake's hold gate and
`wait_until`, from anyio events, and from `wait_all_tasks_blocked()` at points where nothing is on
the wire; nothing sleeps.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from core.clock import VersionClock
from core.errors import EngineUnavailableError, PublishError, StoreError
from core.types import PromptTask, SampleStatus, VersionSpan
from pipeline import RolloutPlan, run_pipeline
from pipeline.metrics import MetricsSink
from stages.publisher import publish_weights
from stages.sglang_client import EngineFleet
from storage import AsyncStore, GroupState, MemoryStore
from tests.conftest import PoolRig
from tests.fakes import FakeSGLang
from tests.fakes.fake_sglang import default_token_fn
from tests.test_controller import EOS, drive_long_tail, lengths_by_prompt
from tests.test_controller import dataset as long_tail_dataset

pytestmark = pytest.mark.anyio

MAX_LEN = 6  # the fake's default tokens never hit EOS: every response is exactly MAX_LEN long
N_SAMPLES = 2


def dataset(n=64):
    return [PromptTask(index=i, prompt_ids=(5, 100 + i), label=i) for i in range(n)]


def seeds_by_sample(fake):
    """(group_id, sample index) -> the sampling seed the pool sent for it."""
    out = {}
    for r in fake.finished:
        group_id, rest = r.rid.rsplit("-s", 1)
        out[(group_id, int(rest.split("-")[0]))] = r.seed
    return out


def uninterrupted(fake, prompt_ids, seed, n=MAX_LEN):
    context, out = list(prompt_ids), []
    for _ in range(n):
        tok = fake.token_fn(context, seed)
        out.append(tok)
        context.append(tok)
    return out


def leaves(exc):
    """Every non-group exception inside `exc` (anyio task groups raise ExceptionGroups)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in leaves(e)]
    return [exc]


async def run_rewarding_all(
    plan, fleet, store, trainer, tmp_path, *, tasks=None, filter_fn=None, metrics=None, clock=None
):
    """`run_pipeline` on `fleet` and `store` with every sample rewarded 1.0 and no filter unless
    one is given: what these tests vary is the plan, the trainer and the engine."""
    return await run_pipeline(
        plan,
        engines=fleet,
        store=AsyncStore(store),
        trainer=trainer,
        dataset=dataset() if tasks is None else tasks,
        reward_fn=lambda task, sample: 1.0,
        filter_fn=filter_fn,
        weights_dir=tmp_path / "w",
        metrics=metrics or MetricsSink(None),
        clock=clock,
    )


class Rig(PoolRig):
    """`PoolRig` on this file's tasks: 16 slots, no token payloads."""

    def __init__(self, fleet, store: MemoryStore, clock: VersionClock):
        super().__init__(fleet, store, clock, tasks=dataset(), n_samples=N_SAMPLES, max_len=MAX_LEN, slots=16)


# -- 1. publish under load --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_publish_under_load_loses_nothing_and_stamps_engine_versions(mode, tmp_path):
    store, clock = MemoryStore(), VersionClock()
    async with FakeSGLang(weight_version="0") as fake, EngineFleet([fake.url], concurrency=16) as fleet:
        async with anyio.create_task_group() as tg:
            rig = Rig(fleet, store, clock)
            await rig.start(tg)
            with anyio.fail_after(10):
                # Every request parks after 2 tokens: all 4 are mid-generation at the publish.
                await rig.park_granted(fake, groups=2)
                report = await publish_weights(clock, fleet, tmp_path / "v1", pause_mode=mode)
                if mode == "abort":
                    # The aborted prefixes resumed on the new weights (and park again at the hold).
                    await fake.wait_until(lambda: fake.held == 2 * N_SAMPLES)
                fake.release()
                await rig.admission.wait_settled()
            tg.cancel_scope.cancel()
        seeds = seeds_by_sample(fake)

    assert report.version == 1
    assert clock.version == 1 and clock.statistics().publishes == 1 and clock.statistics().failed_publishes == 0
    assert fake.loaded_paths == [str(tmp_path / "v1")] and fake.paused is None
    # Nothing lost: every admitted group is ready, with every sample complete and token-exact.
    groups = rig.ready_groups()
    assert rig.admitted == 2 and len(groups) == 2 and store.count(GroupState.RUNNING) == 0
    for g in groups:
        assert g.admitted_version == 0
        for s in g.samples:
            assert s.status is SampleStatus.TRUNCATED and s.response_len == MAX_LEN
            assert list(s.response_ids) == uninterrupted(fake, s.prompt_ids, seeds[(g.group_id, s.index)])
            # Generated 2 tokens under v0, the rest under v1: each token carries its own version,
            # whether the request was aborted and continued or kept in the engine across the update
            # (then the engine's per-token spans say where the version changed).
            assert s.spans == (VersionSpan(0, 2, 0), VersionSpan(2, MAX_LEN, 1))
            assert bool(s.resumed_at) == (mode == "abort")
    aborted = [r for r in fake.finished if r.aborted]
    assert len(aborted) == (2 * N_SAMPLES if mode == "abort" else 0)
    # Only an abort pause empties the engines, so only then is the cache flushed.
    assert fake.calls["/flush_cache"] == (1 if mode == "abort" else 0)
    assert fake.calls["/continue_generation"] == 1


# -- 2. the gate ------------------------------------------------------------------------------


class HeldUpdate:
    """The fleet, with `update_weights_from_disk` parked until `go` is set."""

    def __init__(self, fleet):
        self._fleet = fleet
        self.entered, self.go = anyio.Event(), anyio.Event()

    async def pause(self, mode):
        await self._fleet.pause(mode)

    async def continue_generation(self):
        await self._fleet.continue_generation()

    async def flush_cache(self, deadline):
        await self._fleet.flush_cache(deadline)

    async def update_weights_from_disk(self, path, *, weight_version, flush_cache=True):
        self.entered.set()
        await self.go.wait()
        await self._fleet.update_weights_from_disk(path, weight_version=weight_version, flush_cache=flush_cache)


async def test_the_gate_admits_nothing_while_publishing(tmp_path):
    store, clock = MemoryStore(), VersionClock()
    async with FakeSGLang(weight_version="0") as fake, EngineFleet([fake.url], concurrency=16) as fleet:
        async with anyio.create_task_group() as tg:
            rig = Rig(fleet, store, clock)
            await rig.start(tg)
            target = HeldUpdate(fleet)
            published = anyio.Event()

            async def publish():
                await publish_weights(clock, target, tmp_path / "v1", pause_mode="abort")
                published.set()

            with anyio.fail_after(10):
                tg.start_soon(publish)
                await target.entered.wait()
                rig.admission.grant(3)
                await anyio.wait_all_tasks_blocked()
                # Tickets were granted, but the gate is closed: no group is made, no request sent.
                assert clock.publishing
                assert rig.admitted == 0 and fake.calls["/generate"] == 0
                assert rig.admission.statistics().tickets == 2  # the dispenser holds one, waiting
                target.go.set()
                await published.wait()
                await rig.admission.wait_settled()
            tg.cancel_scope.cancel()

    assert clock.version == 1
    groups = rig.ready_groups()
    assert rig.admitted == 3 and len(groups) == 3 and fake.calls["/generate"] == 3 * N_SAMPLES
    # Admitted after the commit: stamped with the new version, generated entirely under it.
    assert all(g.admitted_version == 1 for g in groups)
    assert {sp.version for g in groups for s in g.samples for sp in s.spans} == {1}


# -- 3. a failed publish ----------------------------------------------------------------------


async def test_a_failed_publish_keeps_the_old_version_serving_and_continues_the_engines(tmp_path):
    store, clock = MemoryStore(), VersionClock()
    async with FakeSGLang(weight_version="0") as fake, EngineFleet([fake.url], concurrency=16) as fleet:
        async with anyio.create_task_group() as tg:
            rig = Rig(fleet, store, clock)
            await rig.start(tg)
            with anyio.fail_after(10):
                await rig.park_granted(fake)
                fake.weight_update_error = "disk full writing /ckpt/v1"
                with pytest.raises(PublishError, match="disk full writing /ckpt/v1") as info:
                    await publish_weights(clock, fleet, tmp_path / "v1", pause_mode="abort")
                # The aborted samples resume on the old weights.
                await fake.wait_until(lambda: fake.held == N_SAMPLES)
                fake.release()
                await rig.admission.wait_settled()
            tg.cancel_scope.cancel()

    assert info.value.version == 1 and "version 0 keeps serving" in str(info.value)
    stats = clock.statistics()
    assert clock.version == 0 and not clock.publishing and stats.publishes == 0 and stats.failed_publishes == 1
    assert fake.weight_version == "0" and fake.loaded_paths == []
    assert fake.calls["/continue_generation"] == 1 and fake.paused is None
    (group,) = rig.ready_groups()
    for s in group.samples:
        assert s.response_len == MAX_LEN and s.resumed_at
        assert s.spans == (VersionSpan(0, MAX_LEN, 0),)


# -- 4. the staleness bound in async mode -----------------------------------------------------


class WatchedStore(MemoryStore):
    """A memory store that tells the test about every state change, and records how many groups
    were admitted but not yet trained at each admission."""

    def __init__(self):
        super().__init__()
        self.changed = anyio.Event()
        self.max_ahead = 0

    def _untrained(self):
        states = (GroupState.RUNNING, GroupState.PARTIAL, GroupState.READY, GroupState.BATCHED)
        return sum(self.count(s) for s in states)

    def _notify(self):
        self.changed.set()
        self.changed = anyio.Event()

    def admit(self, groups, cursor):
        super().admit(groups, cursor)
        self.max_ahead = max(self.max_ahead, self._untrained())
        self._notify()

    def put_ready(self, group):
        super().put_ready(group)
        self._notify()

    def put_ready_groups(self, groups):  # the collector stores what arrived together in one call
        super().put_ready_groups(groups)
        self._notify()

    def put_failed(self, group):
        super().put_failed(group)
        self._notify()


class GatedTrainer:
    """Each train_step tells the test it started, then blocks until the test lets it go."""

    def __init__(self, clock):
        self.clock = clock
        self.started_send, self.started = anyio.create_memory_object_stream(8)
        self.go, self.go_recv = anyio.create_memory_object_stream(8)
        self.trained = []  # (version trained at, batch)

    def train_step(self, batch):
        self.trained.append((self.clock.version, batch))
        anyio.from_thread.run_sync(self.started_send.send_nowait, batch.step)
        anyio.from_thread.run(self.go_recv.receive)
        return {"loss": 0.0}

    def save_weights(self, path: Path) -> Path:
        return path

    def close(self):
        for end in (self.started_send, self.started, self.go, self.go_recv):
            end.close()


async def quiesce(store: WatchedStore):
    """Return once no admitted group is generating and nothing more can be admitted without I/O:
    admission and dispatch are pure event-loop work, so once every task is blocked with no group
    running, the feeder has granted and the dispenser admitted everything they are going to."""
    while True:
        changed = store.changed
        await anyio.wait_all_tasks_blocked()
        if store.count(GroupState.RUNNING) == 0:
            return
        await changed.wait()


async def run_gated(plan, tmp_path, metrics=None):
    """Run `plan` against the fake engine with a gated trainer. Each step the trainer waits until
    the pipeline is quiet, so every admitted group finishes while it trains: the engine is never
    the bottleneck. Returns the summary, the store, the trainer and the groups not yet trained at
    each such moment (the one in training included)."""
    store, clock = WatchedStore(), VersionClock()
    trainer = GatedTrainer(clock)
    ahead_while_training = []
    async with FakeSGLang(weight_version="0") as fake, EngineFleet([fake.url], concurrency=32) as fleet:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:

                async def drive():
                    for _ in range(plan.num_steps):
                        await trainer.started.receive()
                        await quiesce(store)
                        ahead_while_training.append(store._untrained())
                        await trainer.go.send(None)

                tg.start_soon(drive)
                summary = await run_rewarding_all(plan, fleet, store, trainer, tmp_path, metrics=metrics, clock=clock)
    trainer.close()
    return summary, store, trainer, ahead_while_training


def gated_plan(*, steps, batch=2, **changes):
    return RolloutPlan(
        mode="async",
        batch_size=batch,
        n_samples=N_SAMPLES,
        num_steps=steps,
        prefetch=2 * batch,
        slots=32,
        max_response_len=MAX_LEN,
        seed=3,
        **changes,
    )


@pytest.mark.parametrize("staleness", [0, 1, 2])
async def test_async_staleness_bound_is_exact(staleness, tmp_path):
    batch, steps = 2, 4
    # The bound alone: pacing would hold this trainer-bound run tighter still.
    plan = gated_plan(steps=steps, batch=batch, max_staleness=staleness, pace_async=False)
    summary, store, trainer, ahead_while_training = await run_gated(plan, tmp_path)

    assert summary.final_version == steps and len(trainer.trained) == steps
    # With the trainer busy on one batch, exactly N more batches are admitted ahead of it:
    # N = 0 admits nothing during training, and each step of N admits exactly one batch more.
    assert ahead_while_training == [(staleness + 1) * batch] * steps
    assert store.max_ahead == (staleness + 1) * batch
    staleness_seen = [version - g.oldest_version for version, b in trainer.trained for g in b.groups]
    assert max(staleness_seen) == staleness  # the bound holds, and it is reached


@pytest.mark.parametrize("paced", [True, False])
async def test_a_trainer_bound_async_run_is_paced_to_one_batch_ahead(paced, tmp_path):
    """The engines here are far faster than the gated trainer: every group admitted finishes before
    the trainer asks again. Unpaced, the feeder keeps the staleness bound's 3 batches ahead of the
    one in training; paced, the surplus it sees each time it asks shrinks its window to one batch,
    so the last steps train groups exactly 1 version stale, with no step waiting for the engine."""
    batch, steps = 2, 7
    sink = MetricsSink(None)
    plan = gated_plan(steps=steps, batch=batch, max_staleness=2, pace_async=paced)
    _, _, trainer, ahead_while_training = await run_gated(plan, tmp_path, sink)

    staleness = [[version - g.oldest_version for g in b.groups] for version, b in trainer.trained]
    windows = [r.get("queue/window") for r in sink.records]
    if not paced:
        assert ahead_while_training == [3 * batch] * steps
        assert staleness[-3:] == [[2] * batch] * 3 and windows == [None] * steps
        return
    assert ahead_while_training[0] == 3 * batch  # the window starts wide: nothing is known yet
    assert ahead_while_training[-3:] == [2 * batch] * 3
    assert staleness[-3:] == [[1] * batch] * 3
    assert windows[-3:] == [batch] * 3


# -- 5. failures propagate --------------------------------------------------------------------


class BrokenStore(MemoryStore):
    def put_ready(self, group):
        raise StoreError(f"cannot write ready group {group.group_id}: disk is read-only")

    def put_ready_groups(self, groups):
        raise StoreError(f"cannot write ready groups {[g.group_id for g in groups]}: disk is read-only")


def broken_filter(group):
    raise RuntimeError(f"filter bug on {group.group_id}")


class QuickTrainer:
    def train_step(self, batch):
        return {"loss": 0.0}

    def save_weights(self, path: Path) -> Path:
        return path


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("broken", ["store", "filter"])
async def test_a_crashed_stage_surfaces_from_run_pipeline(mode, broken, tmp_path):
    store = BrokenStore() if broken == "store" else MemoryStore()
    plan = RolloutPlan(mode=mode, batch_size=2, n_samples=N_SAMPLES, num_steps=3, slots=8, max_response_len=MAX_LEN)
    async with FakeSGLang(weight_version="0") as fake, EngineFleet([fake.url], concurrency=8) as fleet:
        with anyio.fail_after(10), pytest.raises(BaseExceptionGroup) as info:
            await run_rewarding_all(
                plan, fleet, store, QuickTrainer(), tmp_path, filter_fn=broken_filter if broken == "filter" else None
            )
    causes = leaves(info.value)
    expected = (StoreError, "disk is read-only") if broken == "store" else (RuntimeError, "filter bug")
    assert any(isinstance(e, expected[0]) and expected[1] in str(e) for e in causes), causes


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_dead_engine_fails_the_run_instead_of_hanging(mode, tmp_path):
    plan = RolloutPlan(mode=mode, batch_size=2, n_samples=N_SAMPLES, num_steps=3, slots=8, max_response_len=MAX_LEN)
    async with FakeSGLang(weight_version="0") as fake:
        url = fake.url
        fake.hold(2)
        async with EngineFleet([url], concurrency=8, max_retries=1, retry_backoff=0.01) as fleet:
            async with anyio.create_task_group() as tg:

                async def kill():
                    await fake.wait_until(lambda: fake.held > 0)
                    await fake.stop()  # aborts what it runs, then refuses connections

                tg.start_soon(kill)
                with anyio.fail_after(15), pytest.raises(BaseExceptionGroup) as info:
                    await run_rewarding_all(plan, fleet, MemoryStore(), QuickTrainer(), tmp_path)
    causes = leaves(info.value)
    assert any(isinstance(e, EngineUnavailableError) and url in str(e) for e in causes), causes


# -- the whole loop, async, in each pause mode ------------------------------------------------


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_async_run_in_each_pause_mode_accounts_for_every_group(mode, tmp_path):
    """Generation keeps running across four publishes; every group admitted ends somewhere, and
    every trained token carries a version the clock published, no newer than its training step."""

    store, clock = MemoryStore(), VersionClock()
    trained = []

    class Trainer(QuickTrainer):
        def train_step(self, batch):
            trained.append((clock.version, batch))
            return {"loss": 0.0}

    plan = RolloutPlan(
        mode="async",
        batch_size=2,
        n_samples=N_SAMPLES,
        num_steps=4,
        max_staleness=1,
        pause_mode=mode,
        slots=8,
        max_response_len=24,
        seed=5,
    )
    token_fn = default_token_fn(eos_token_id=0, eos_every=6)
    fake_engine = FakeSGLang(weight_version="0", token_fn=token_fn)
    async with fake_engine as fake, EngineFleet([fake.url], concurrency=8) as fleet:
        with anyio.fail_after(20):
            summary = await run_rewarding_all(plan, fleet, store, Trainer(), tmp_path, clock=clock)
        assert fake.calls["/flush_cache"] == (4 if mode == "abort" else 0)
    assert summary.final_version == 4 == clock.statistics().publishes
    admitted = store.statistics().cursor.index
    counts = {s: store.count(s) for s in GroupState}
    assert sum(counts.values()) == admitted and counts[GroupState.RUNNING] == 0
    assert counts[GroupState.TRAINED] == 8 == sum(len(b.groups) for _, b in trained)
    for version, b in trained:
        for g in b.groups:
            # (No staleness bound asserted here: with varied lengths a long group can be overtaken,
            # which the admission rule does not cover; see test_async_staleness_bound_is_exact.)
            for s in g.samples:
                assert s.status.finished and all(0 <= sp.version <= version for sp in s.spans)


async def test_async_run_ends_with_the_long_tail_stored_as_partial(tmp_path):
    """At the end of an async run the long tail is still generating: the stop must return it to the
    store as partial groups once, not hand each one back to the still-running feeder forever."""
    store = MemoryStore()
    plan = RolloutPlan(
        mode="async",
        batch_size=2,
        n_samples=N_SAMPLES,
        num_steps=3,
        slots=16,
        max_response_len=48,
        seed=7,
    )
    async with FakeSGLang(weight_version="0", token_fn=lengths_by_prompt, eos_token_id=EOS) as fake:
        async with EngineFleet([fake.url], concurrency=16) as fleet, anyio.create_task_group() as tg:
            tg.start_soon(drive_long_tail, fake)
            with anyio.fail_after(15):
                summary = await run_rewarding_all(
                    plan, fleet, store, QuickTrainer(), tmp_path, tasks=long_tail_dataset(64)
                )
            tg.cancel_scope.cancel()
    assert summary.final_version == 3
    counts = {s: store.count(s) for s in GroupState}
    assert counts[GroupState.PARTIAL] > 0, "the long tail was not running at the end"
    assert counts[GroupState.RUNNING] == 0 and sum(counts.values()) == store.statistics().cursor.index
    # The aborted tail keeps what it generated (a group the dispenser handed over during the stop
    # may come back untouched, with no prefix: it is simply first in line next time).
    assert any(s.response_len for g in store.groups(GroupState.PARTIAL) for s in g.samples)


async def test_async_run_ends_with_a_full_collector(tmp_path):
    """Groups keep finishing after the ready set is full (no prefetch room); when the run ends they
    must still land as ready, not wait for a batch that will never be taken."""
    store = MemoryStore()
    plan = RolloutPlan(
        mode="async",
        batch_size=2,
        n_samples=N_SAMPLES,
        num_steps=2,
        prefetch=0,
        slots=16,
        max_response_len=MAX_LEN,
    )
    async with FakeSGLang(weight_version="0") as fake, EngineFleet([fake.url], concurrency=16) as fleet:
        with anyio.fail_after(10):
            await run_rewarding_all(plan, fleet, store, QuickTrainer(), tmp_path)
    counts = {s: store.count(s) for s in GroupState}
    assert counts[GroupState.RUNNING] == 0 and sum(counts.values()) == store.statistics().cursor.index
    assert counts[GroupState.TRAINED] == 4 and counts[GroupState.READY] > 2  # past the bound, kept

"""Producers on Ray (issue 13): a real local Ray cluster of three logical nodes, one producer actor
on each, the simulated engine over real HTTP, the real controller and an LMDB store.

What is checked is exactly-once: every admitted group ends trained once or stored, never trained
twice, whatever happens to a producer (killed mid-run, frozen through a publish, late with a
result its lease no longer covers). Ordering comes from events (`wait_slot_freed`, the fake
engine's hold gate, the step callback), never from sleeps.

One module-scoped cluster (`ray.cluster_utils.Cluster`, about 1 GB and 5 s to start); the runs
are a few steps each, sized for two cores.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from core.clock import VersionClock
from core.errors import PipelineError
from core.types import Group, PauseMode, PromptTask, RolloutMode
from engines.sim import open_sim_server
from engines.sim_model import DecodeTimeModel
from launch.ray_cluster import RaySettings, engine_shares, group_slots, open_ray_producers
from launch.ray_producer import ProducerSpec
from launch.ray_producers import RayProducers
from pipeline import RolloutPlan, run_pipeline
from pipeline.metrics import MetricsSink
from stages.admission import Admission
from stages.publisher import publish_weights
from stages.sglang_client import EngineFleet
from storage import AsyncStore, Cursor, GroupState, LmdbStore
from tests.fakes import FakeSGLang
from tests.test_async_mode import leaves
from tests.test_controller import RecordingTrainer

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.anyio]

NODES = 3
G = 4  # samples per group
LEASE, DEADLINE = 2.0, 4.0


def reward(task: PromptTask, sample) -> float:
    """Imported by path on every producer: `tests.test_ray_producers:reward`."""
    return float(sample.response_len % 3)


REWARD_PATH = "tests.test_ray_producers:reward"


def exploding_filter(group: Group) -> bool:
    """Imported by path on every producer: its filter stage fails at the first group it judges."""
    raise RuntimeError("the filter exploded")


def dataset(n: int = 256) -> list[PromptTask]:
    return [PromptTask(index=i, prompt_ids=(1000 + i, 2000 + 7 * i, 3000 + i % 5)) for i in range(n)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(NODES - 1):
        c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


def spec_for(url: str, plan: RolloutPlan, reward_path: str = REWARD_PATH, filter_path: str | None = None):
    def make(i: int, count: int) -> ProducerSpec:
        return ProducerSpec(
            name=f"producer-{i}",
            engine_urls=(url,),
            router_url=None,
            group_slots=group_slots(plan.slots, plan.n_samples, count)[i],
            n_samples=plan.n_samples,
            sampling_params={},
            max_response_len=plan.max_response_len,
            reward_path=reward_path,
            filter_path=filter_path,
            seed=plan.seed,
        )

    return make


def settings(**kw) -> RaySettings:
    return RaySettings(
        address=None,
        num_producers=kw.get("num_producers"),
        lease_seconds=kw.get("lease_seconds", LEASE),
        deadline_seconds=DEADLINE,
        mailbox=kw.get("mailbox", True),
    )


def plan_for(mode: str, *, partial: bool = False, steps: int = 4) -> RolloutPlan:
    return RolloutPlan(
        mode=RolloutMode(mode),
        batch_size=4,
        n_samples=G,
        num_steps=steps,
        partial=partial,
        over_sampling=2 if partial else None,
        slots=32,  # C*E: K = 8 group slots over 3 producers -> 3, 3, 2
        max_response_len=48,
        seed=7,
    )


class Run:
    """One run through the real controller with Ray producers; keeps what the checks need."""

    def __init__(self, tmp_path: Path) -> None:
        self.store = LmdbStore(tmp_path / "rollout")
        self.astore = AsyncStore(self.store)
        self.trainer = RecordingTrainer()
        self.tmp = tmp_path
        self.producers: RayProducers | None = None
        self.stepped = anyio.Event()
        self.steps = 0

    def on_step(self, record: dict) -> None:
        self.steps += 1
        self.stepped.set()
        self.stepped = anyio.Event()

    async def go(
        self, plan: RolloutPlan, *, time_scale: float = 0.3, during=None, mailbox: bool = True, **ray_kw
    ) -> None:
        timing = DecodeTimeModel(weight_update=0.05)
        async with (
            open_sim_server(time_scale=time_scale, timing=timing, max_running_requests=64) as engine,
            EngineFleet([engine.url], concurrency=plan.slots) as fleet,
            open_ray_producers(
                settings(mailbox=mailbox, **ray_kw),
                spec_for(engine.url, plan, filter_path=ray_kw.get("filter_path")),
                store=self.astore,
                n_samples=G,
            ) as make,
        ):

            def factory(admission: Admission) -> RayProducers:
                self.producers = make(admission)
                return self.producers

            async with anyio.create_task_group() as tg:
                if during is not None:
                    tg.start_soon(during, self)
                sink = MetricsSink(self.tmp / "metrics.jsonl")
                with anyio.fail_after(240), contextlib.closing(sink):
                    await run_pipeline(
                        plan,
                        engines=fleet,
                        store=self.astore,
                        trainer=self.trainer,
                        dataset=dataset(),
                        reward_fn=reward,
                        filter_fn=None,
                        weights_dir=self.tmp / "weights",
                        metrics=sink,
                        on_step=self.on_step,
                        producers=factory,
                    )
                tg.cancel_scope.cancel()

    def check_exactly_once(self, plan: RolloutPlan) -> None:
        trained = [g.group_id for b in self.trainer.batches for g in b.groups]
        assert len(self.trainer.batches) == plan.num_steps
        assert len(trained) == len(set(trained)) == plan.num_steps * plan.batch_size  # none twice
        stats = self.store.statistics()
        counts = stats.counts
        # Every admitted group is somewhere: trained once, or stored to be continued or trained.
        assert counts[GroupState.RUNNING] == 0 and counts[GroupState.BATCHED] == 0
        assert sum(counts.values()) == stats.cursor.next_seq
        assert set(trained) == {g.group_id for g in self.store.groups(GroupState.TRAINED)}
        for b in self.trainer.batches:
            for g in b.groups:
                assert all(s.status.finished and s.reward is not None for s in g.samples)

    def close(self) -> None:
        self.store.close()


# -- pure helpers -------------------------------------------------------------------------------


def test_group_slots_split_by_quotient_and_remainder_and_engines_round_robin() -> None:
    assert group_slots(32, 4, 3) == [3, 3, 2]  # K = 8
    assert group_slots(30, 8, 3) == [1, 1, 1]  # K = 3
    assert engine_shares(["http://a", "http://b"], "http://r", 3) == [
        (("http://a",), None),
        (("http://b",), None),
        (("http://a",), None),
    ]
    assert (
        engine_shares(["http://a", "http://b", "http://c"], "http://r", 2)
        == [(("http://a", "http://b", "http://c"), "http://r")] * 2
    )
    assert engine_shares([], "http://r", 2) == [((), "http://r")] * 2


# -- end to end: sync, partial, async -------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "partial", "mailbox"),
    [
        ("sync", False, True),
        ("sync", True, True),
        ("async", False, True),
        # Calls to each producer instead of through the mailbox (--no-producer-mailbox).
        ("sync", True, False),
        ("async", False, False),
    ],
)
async def test_runs_end_to_end_on_three_producers(cluster, tmp_path, mode, partial, mailbox) -> None:
    plan = plan_for(mode, partial=partial)
    run = Run(tmp_path)
    try:
        await run.go(plan, mailbox=mailbox)
        run.check_exactly_once(plan)
        rp = run.producers
        assert rp is not None and len(rp.producers) == NODES
        assert len({p.node for p in rp.producers}) == NODES  # one per logical node
        assert rp.metrics()["producers/lost"] == 0 and rp.metrics()["producers/fenced_results"] == 0
        assert all(p.handed > 0 for p in rp.producers)  # work went to every producer
        assert (rp.mailbox is not None) == mailbox
    finally:
        run.close()


async def test_producers_whose_stages_fail_are_given_up_through_the_mailbox_not_a_heartbeat_later(
    cluster, tmp_path
) -> None:
    """Every producer's filter fails at its first group: each tells the mailbox why, the controller
    gives each up at its next take, and the run stops naming them, long before a heartbeat (every
    40 s with these leases) could have noticed; nothing is lost or trained."""
    plan = plan_for("sync")
    run = Run(tmp_path)
    try:
        # A hang guard, with room for a loaded machine's slow actor starts (20 s once ran out while
        # they started); what shows the mailbox gave them up, not a heartbeat, is each `lost` below.
        with anyio.fail_after(60), pytest.raises(Exception) as caught:  # wrapped by the run's task groups
            await run.go(plan, lease_seconds=120.0, filter_path="tests.test_ray_producers:exploding_filter")
        errors = leaves(caught.value)
        assert any(isinstance(e, PipelineError) and "every Ray producer is lost" in str(e) for e in errors), errors
        assert run.producers is not None
        for p in run.producers.producers:
            assert p.lost is not None and "results failed" in p.lost and "the filter exploded" in p.lost
        assert run.trainer.batches == []
        stats = run.store.statistics()
        assert sum(stats.counts.values()) == stats.cursor.next_seq  # every admitted group is stored
    finally:
        run.close()


@pytest.mark.parametrize("when", ["after a step", "inside a publish"])
async def test_a_killed_mailbox_stops_the_run_naming_it_and_loses_nothing(cluster, tmp_path, when) -> None:
    """Killed inside a publish, the run stops while the publisher's shielded end still tells the
    producers the version: a producer that fails that call is lost after the run's task group has
    ended, which must be logged, not raised over the mailbox's error."""
    plan = plan_for("async", steps=6)

    async def kill_the_mailbox(run: Run) -> None:
        while run.steps < 1:
            await run.stepped.wait()
        rp = run.producers
        assert rp is not None and rp.mailbox is not None
        if when == "after a step":
            ray.kill(rp.mailbox, no_restart=True)
            return
        close_gates = rp._close_gates

        async def close_then_kill(version: int, pause_mode: PauseMode) -> None:
            await close_gates(version, pause_mode)
            ray.kill(rp.mailbox, no_restart=True)

        rp._close_gates = close_then_kill  # type: ignore[method-assign]

    run = Run(tmp_path)
    try:
        with pytest.raises(Exception) as caught:  # wrapped by the run's task groups
            await run.go(plan, during=kill_the_mailbox)
        errors = leaves(caught.value)
        assert any(isinstance(e, PipelineError) and "producers' mailbox" in str(e) for e in errors), errors
        # A publish under way when the run stopped loses its producer after the run's task group
        # has ended: that is logged, never raised over the mailbox's error.
        assert not any(isinstance(e, RuntimeError) for e in errors), errors
        trained = [g.group_id for b in run.trainer.batches for g in b.groups]
        assert 1 <= len(run.trainer.batches) < plan.num_steps and len(trained) == len(set(trained))
        # Nothing lost: every admitted group is stored, those in flight still RUNNING under their
        # leases, which the next start's recovery turns back into PARTIAL to be served again.
        stats = run.store.statistics()
        assert sum(stats.counts.values()) == stats.cursor.next_seq
        in_flight = stats.counts[GroupState.RUNNING]
        assert run.store.recover().running_to_partial == in_flight
        assert run.store.count(GroupState.RUNNING) == 0
    finally:
        run.close()


# -- a producer killed mid-run -------------------------------------------------------------------


class PrefixRun(Run):
    """A Run that keeps, at each step's end, the stored partial groups that have a prefix: the
    next round hands them out first. Read in the step callback, while no round is running."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        self.prefixes: dict[str, Group] = {}

    def on_step(self, record: dict) -> None:
        self.prefixes = {
            g.group_id: g for g in self.store.groups(GroupState.PARTIAL) if any(s.response_len for s in g.samples)
        }
        super().on_step(record)


async def test_a_killed_producer_loses_nothing_and_its_prefixes_are_continued(cluster, tmp_path) -> None:
    plan = plan_for("sync", partial=True, steps=5)
    snapshot: dict[str, Group] = {}
    killed: list[str] = []

    async def kill_one_holding_a_prefix(run: PrefixRun) -> None:
        while run.steps < 1:
            await run.stepped.wait()
        rp = run.producers
        assert rp is not None
        # Woken by every change of the producers' hands (a dispatch notifies once the store has
        # leased the groups), and looked at with no await up to the kill: the first producer that
        # is handed a group continued from a stored prefix is killed while it holds it, before it
        # can have returned anything of it. That prefix must survive the kill.
        with anyio.fail_after(120):
            while not (holding := [p for p in rp.producers if p.in_hand & run.prefixes.keys()]):
                await rp.wait_slot_freed()
        victim = holding[0]
        snapshot.update({gid: run.prefixes[gid] for gid in victim.in_hand & run.prefixes.keys()})
        killed.append(victim.name)
        ray.kill(victim.actor, no_restart=True)

    run = PrefixRun(tmp_path)
    try:
        # Slow decoding (a 48-token answer takes about a second), so the group the victim holds at
        # the kill is still generating when the kill lands.
        await run.go(plan, time_scale=1.0, during=kill_one_holding_a_prefix)
        run.check_exactly_once(plan)
        rp = run.producers
        assert rp is not None and killed and snapshot
        metrics = rp.metrics()
        (victim,) = [p for p in rp.producers if p.name in killed]
        assert metrics["producers/lost"] == 1 and metrics["producers/live"] == NODES - 1
        assert victim.lost is not None and not victim.in_hand  # everything it held was settled
        # Each group it still held when given up on came back once, reclaimed or as a fenced result
        # (none, had the kill landed after it sent back all it held: those results were committed
        # under the leases they still had, as any producer's).
        given_back = metrics["producers/reclaimed_groups"] + metrics["producers/fenced_results"]
        assert given_back >= victim.given_up
        # The groups the dead producer held continue from the prefixes it had returned.
        for gid, before in snapshot.items():
            found = run.store.get(gid)
            assert found is not None
            for old, new in zip(before.samples, found[1].samples, strict=True):
                assert new.response_ids[: old.response_len] == old.response_ids
                assert new.response_len >= old.response_len
    finally:
        run.close()


async def test_a_producer_that_stops_answering_in_async_mode_is_given_up_and_the_run_goes_on(cluster, tmp_path) -> None:
    plan = plan_for("async", steps=6)
    frozen: list[int] = []

    async def freeze_one(run: Run) -> None:
        while run.steps < 1:
            await run.stepped.wait()
        assert run.producers is not None
        pid = await run.producers.producers[2].actor.pid.remote()
        os.kill(pid, signal.SIGSTOP)  # alive but silent: no heartbeat, no publish answer, no result
        frozen.append(pid)

    run = Run(tmp_path)
    try:
        await run.go(plan, during=freeze_one)
        run.check_exactly_once(plan)
        rp = run.producers
        assert rp is not None and frozen
        assert rp.metrics()["producers/lost"] == 1 and rp.producers[2].lost is not None
        # Given up on by whichever call missed its deadline first: a heartbeat, a submit, a publish.
        assert "TimeoutError" in rp.producers[2].lost or "not answered" in rp.producers[2].lost
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # it was killed while stopped: let it die
        run.close()


# -- a zombie's late result ----------------------------------------------------------------------


async def test_a_result_whose_lease_was_reassigned_is_fenced_and_counted(cluster, tmp_path) -> None:
    store = LmdbStore(tmp_path / "rollout")
    astore = AsyncStore(store)
    admission = Admission()
    plan = plan_for("sync")
    group = Group.fresh(dataset()[0], epoch=0, n_samples=G, version=0, seq=0)
    async with FakeSGLang(weight_version="0") as fake:
        fake.hold(2)  # the producer's requests park after two tokens
        settings1 = settings(num_producers=1)
        async with open_ray_producers(settings1, spec_for(fake.url, plan), store=astore, n_samples=G) as make:
            rp = make(admission)
            to_send, to_receive = anyio.create_memory_object_stream[Group](0)
            out_send, out = anyio.create_memory_object_stream[Group](4)
            async with anyio.create_task_group() as tg:
                await tg.start(rp.run, to_receive, out_send)
                await astore.admit([group], Cursor(0, 1, 1))
                admission.grant(1)
                await admission.take_ticket()
                await to_send.send(group)
                with anyio.fail_after(30):
                    await fake.wait_until(lambda: fake.held == G)
                # The producer's lease runs out behind its back, and another owner takes the group.
                assert await astore.reclaim_expired(time.time() + 1e6) == 1
                (taken,) = await astore.claim_partial(1, owner="someone-else", lease_seconds=1e6)
                fake.release()
                with anyio.fail_after(30):
                    while not rp.metrics()["producers/fenced_results"]:
                        await rp.wait_slot_freed()
                tg.cancel_scope.cancel()
            to_send.close()
            out.close()
    try:
        assert rp.metrics()["producers/fenced_results"] == 1
        # Refused by the store: the group is still the other owner's, its record untouched, and the
        # late result never reached the collector.
        assert store.get(group.group_id) == (GroupState.RUNNING, taken)
        assert store.lease(group.group_id).owner == "someone-else"
        assert admission.outstanding == 0 and store.count(GroupState.READY) == 0
    finally:
        store.close()


async def test_a_batch_holding_a_reassigned_group_commits_the_others_and_fences_that_one(cluster, tmp_path) -> None:
    """Three groups waiting together, handed to one producer; while they run, the lease of the middle
    one is reassigned. The producer's results come back: the two it still holds go on to the
    collector, the third is refused by the store and counted, and stays the other owner's."""
    store = LmdbStore(tmp_path / "rollout")
    astore = AsyncStore(store)
    admission = Admission()
    plan = plan_for("sync")
    groups = [Group.fresh(dataset()[i], epoch=0, n_samples=G, version=0, seq=i) for i in range(3)]
    ids = [g.group_id for g in groups]
    async with FakeSGLang(weight_version="0") as fake:
        fake.hold(2)
        async with open_ray_producers(
            settings(num_producers=1), spec_for(fake.url, plan), store=astore, n_samples=G
        ) as make:
            rp = make(admission)
            to_send, to_receive = anyio.create_memory_object_stream[Group](3)
            out_send, out = anyio.create_memory_object_stream[Group](4)
            async with anyio.create_task_group() as tg:
                await astore.admit(groups, Cursor(0, 3, 3))
                admission.grant(3)
                for g in groups:  # queued before the producers start: the dispatcher finds all three waiting
                    await admission.take_ticket()
                    await to_send.send(g)
                await tg.start(rp.run, to_receive, out_send)
                with anyio.fail_after(30):
                    await fake.wait_until(lambda: fake.held == 3 * G)
                (p,) = rp.producers
                assert p.handed == 3 and p.in_hand == set(ids)
                await astore.hand_over(ids[1], owner=p.name, to="someone-else", lease_seconds=1e6)
                fake.release()
                with anyio.fail_after(30):
                    came = sorted([(await out.receive()).group_id for _ in range(2)])
                    while not rp.metrics()["producers/fenced_results"]:
                        await rp.wait_slot_freed()
                tg.cancel_scope.cancel()
            to_send.close()
            out.close()
    try:
        assert came == sorted([ids[0], ids[2]])  # only these go on to be trained
        assert rp.metrics()["producers/fenced_results"] == 1 and not p.in_hand
        assert store.get(ids[1]) == (GroupState.RUNNING, groups[1])  # the late tokens never landed
        assert store.lease(ids[1]).owner == "someone-else"
        assert [store.lease(i).owner for i in (ids[0], ids[2])] == ["controller", "controller"]
        assert admission.outstanding == 2  # the accepted two, for the collector to settle
    finally:
        store.close()


# -- a publish with a producer that never answers ------------------------------------------------


async def test_a_publish_with_a_frozen_producer_ends_within_its_deadline(cluster, tmp_path) -> None:
    store = LmdbStore(tmp_path / "rollout")
    astore = AsyncStore(store)
    plan = plan_for("async")
    clock = VersionClock()
    frozen = None
    async with FakeSGLang(weight_version="0") as fake, EngineFleet([fake.url], concurrency=8) as fleet:
        async with open_ray_producers(settings(), spec_for(fake.url, plan), store=astore, n_samples=G) as make:
            rp = make(Admission())
            with pytest.raises(PipelineError, match="makes one producer set, for one run"):
                make(Admission())  # a second set would share this one's groups in hand and results
            to_send, to_receive = anyio.create_memory_object_stream[Group](0)
            out_send, out = anyio.create_memory_object_stream[Group](4)
            try:
                async with anyio.create_task_group() as tg:
                    await tg.start(rp.run, to_receive, out_send)
                    frozen = await rp.producers[1].actor.pid.remote()
                    os.kill(frozen, signal.SIGSTOP)  # stops answering anything, as a hung node would
                    (tmp_path / "v1").mkdir()
                    started = time.perf_counter()
                    with anyio.fail_after(DEADLINE * 3):
                        report = await publish_weights(
                            clock, fleet, tmp_path / "v1", pause_mode=PauseMode.ABORT, gates=rp.gates
                        )
                    took = time.perf_counter() - started
                    tg.cancel_scope.cancel()
            finally:
                if frozen is not None:
                    os.kill(frozen, signal.SIGCONT)
                to_send.close()
                out.close()
    store.close()
    assert report.version == 1 and clock.version == 1 and fake.loaded_paths == [str(tmp_path / "v1")]
    # Given up on at the deadline (the close), not waited on: one deadline, plus a margin.
    assert took < DEADLINE + 2.0, took
    # Given up on by the publish's own call, or by a heartbeat that went out just before it and
    # missed the same deadline first (a loaded CI machine saw that): either way within the deadline.
    lost = rp.producers[1].lost
    assert lost is not None and ("begin_publish" in lost or "no heartbeat answer" in lost), lost
    assert [p.lost for p in rp.producers if p is not rp.producers[1]] == [None] * (NODES - 1)


# -- a reward path a producer cannot import ------------------------------------------------------


async def test_a_reward_path_a_producer_cannot_import_fails_at_start_naming_it(cluster, tmp_path) -> None:
    plan = plan_for("sync")
    store = LmdbStore(tmp_path / "rollout")
    try:
        with pytest.raises(PipelineError, match=r"no_such_module:reward.*producer node"):
            async with open_ray_producers(
                settings(num_producers=1),
                spec_for("http://127.0.0.1:9", plan, reward_path="no_such_module:reward"),
                store=AsyncStore(store),
                n_samples=G,
            ):
                pass
    finally:
        store.close()


# -- the launcher ---------------------------------------------------------------------------------


def test_the_launcher_runs_async_on_ray_producers_with_the_real_trainer(cluster, tmp_path) -> None:
    """`python -m pipeline.launch --rollout-producers ray`: the built-in engine and torch trainer,
    the toy task's reward imported by path on each producer, one producer per node of the cluster
    this process already joined."""
    import json

    from pipeline.run.cli import main

    out = tmp_path / "run"
    flags = "--rollout-producers ray --rollout-mode async --num-rollout 4 --rollout-data-transport lmdb"
    code = main(["--output-dir", str(out), "--no-progress", "--log-level", "warning", *flags.split()])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["producers/live"] == NODES and r["producers/fenced_results"] == 0 for r in records)
    assert records[-1]["tokens/generated_total"] > 0  # the producers' counters reach the record
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        counts = {s: store.count(s) for s in GroupState}
        assert counts[GroupState.TRAINED] == 4 * 8 and counts[GroupState.RUNNING] == 0
        assert sum(counts.values()) == store.cursor().next_seq


def test_a_resume_on_ray_producers_trains_the_stored_batches_again_then_goes_on(cluster, tmp_path) -> None:
    """Issue 30: a run whose newest checkpoint is gone resumes from the base model, trains the four
    stored batches again (before any producer gets work), and the producers then start at the
    version the replay published."""
    import json
    import shutil

    from pipeline.run.cli import main

    out = tmp_path / "run"
    flags = "--rollout-producers ray --rollout-mode async --rollout-data-transport lmdb --save-interval 10"
    assert main(["--output-dir", str(out), "--no-progress", "--num-rollout", "4", *flags.split()]) == 0
    shutil.rmtree(out / "checkpoints" / "v4")  # only the last step's was saved (--save-interval 10)
    assert main(["--output-dir", str(out), "--no-progress", "--num-rollout", "6", *flags.split()]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(6)) and all(r["version"] == r["step"] for r in records)
    meta = json.loads((out / "checkpoints" / "v6" / "optimizer" / "state.json").read_text())
    assert meta["trainer_steps"] == 6
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        assert store.count(GroupState.TRAINED) == 6 * 8 and store.count(GroupState.RUNNING) == 0


def test_the_launcher_refuses_more_producers_than_group_slots_once_ray_says_how_many(cluster, tmp_path, capsys) -> None:
    """One producer per node: 3 nodes x 4 samples need 12 sample slots; 8 x 1 engine is refused."""
    from pipeline.run.cli import main

    flags = "--rollout-producers ray --sglang-server-concurrency 8 --n-samples-per-prompt 4 --num-rollout 1"
    code = main(["--output-dir", str(tmp_path / "run"), "--no-progress", "--log-level", "warning", *flags.split()])
    assert code == 2  # a config error, as those found when the config loads
    err = capsys.readouterr().err
    assert "--rollout-producers=ray with 3 producers" in err and "C*E >= W*G" in err and "8 x 1 = 8" in err


def test_the_tool_agent_runs_on_the_producers_through_its_path(cluster, tmp_path) -> None:
    """`--task tool`: the built-in agent, imported by its `module:function` path on every producer,
    drives multi-turn samples there; its tool turns (loss mask 0) reach the trained batches."""
    from pipeline.run.cli import main

    out = tmp_path / "run"
    flags = "--rollout-producers ray --task tool --num-rollout 2 --rollout-data-transport lmdb"
    assert main(["--output-dir", str(out), "--no-progress", "--log-level", "warning", *flags.split()]) == 0
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        samples = [s for step in range(2) for g in store.batch(step).groups for s in g.samples]
    assert len(samples) == 2 * 8 * 8
    assert any(0 in s.loss_mask for s in samples), "no tool turn in any trained sample"


# -- a node lost with its raylet (last: it changes the module's cluster, then restores its size) ----


async def test_a_node_whose_raylet_dies_loses_its_producer_and_the_run_goes_on(cluster, tmp_path) -> None:
    plan = plan_for("sync", partial=True, steps=5)
    removed: list[object] = []

    async def remove_a_worker_node(run: Run) -> None:
        while run.steps < 1:
            await run.stepped.wait()
        assert run.producers is not None
        # Not the head, nor the node this process's Ray driver is attached to (one of the logical
        # nodes, whichever Ray picked): the producers' mailbox lives there, on the controller's node,
        # and shares its fate, as on a real cluster where that node is the controller's machine.
        spared = {cluster.head_node.node_id[:8], ray.get_runtime_context().get_node_id()[:8]}
        by_id = {n.node_id: n for n in cluster.list_all_nodes()}
        victim = next(p for p in run.producers.producers if not any(s in p.node for s in spared))
        node = next(n for nid, n in by_id.items() if nid[:8] in victim.node)
        # Training waits until the controller has seen the loss: on a fast machine the remaining
        # steps could otherwise end before a heartbeat misses its deadline.
        released, train_step = threading.Event(), run.trainer.train_step

        def held(batch):
            released.wait(timeout=120)
            return train_step(batch)

        run.trainer.train_step = held
        try:
            cluster.remove_node(node, allow_graceful=False)  # the raylet and every worker on it die
            removed.append(victim)
            with anyio.fail_after(60):
                while victim.lost is None:
                    await run.producers.wait_slot_freed()  # woken by every change, a loss included
        finally:
            released.set()

    run = Run(tmp_path)
    try:
        await run.go(plan, during=remove_a_worker_node)
        run.check_exactly_once(plan)
        assert run.producers is not None and removed
        assert removed[0].lost is not None
        assert run.producers.metrics()["producers/live"] == NODES - 1
    finally:
        run.close()
        if removed:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()

"""The prompts' stored histories (issue 50): what the store remembers of each prompt, the pure
predictions read from it (skip a prompt on a zero-variance streak, order by predicted length),
a skip as a stored fact in both stores and across a SIGKILL of the LMDB writer, its metric's
name, and the switches' config rules."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import lmdb
import pytest

from core.clock import VersionClock
from core.errors import ConfigError, CorruptRecordError, StoreError
from core.types import FinishReason, Group, PromptTask
from pipeline import RolloutPlan, run_pipeline
from pipeline.config import load_config
from pipeline.metrics import MetricsSink
from pipeline.replay_report import format_history, format_summary, summarize
from stages.admission import Admission
from stages.dispenser import Dispenser
from stages.filter import reward_std_nonzero
from stages.selection import (
    SKIP_REASON,
    PromptSelection,
    longest_first,
    predicted_length,
    skip_draw,
    skip_probability,
    skips,
)
from stages.sglang_client import EngineFleet
from storage import AsyncStore, Cursor, GroupState, LmdbStore, MemoryStore, PromptHistory, Store, keys
from storage.history import (
    HISTORY_DEPTH,
    GroupOutcome,
    decode_history,
    encode_history,
    outcome_of,
    updated_history,
)
from tests import history_kill_child as child
from tests.fakes import FakeSGLang
from tests.test_controller import EOS, RecordingTrainer, lengths_by_prompt
from tests.test_store import finished, fresh, generated

ROOT = Path(__file__).resolve().parent.parent


def scored(group: Group, rewards: tuple[float, ...]) -> Group:
    """`group` finished (3 tokens a sample) and scored with `rewards`."""
    done = finished(group, 0)
    return done.with_samples([s.with_reward(r) for s, r in zip(done.samples, rewards, strict=True)])


def outcome(zero_std: bool, length: float = 3.0, epoch: int = 0) -> GroupOutcome:
    return GroupOutcome(epoch, zero_std, 1.0 if zero_std else 0.5, length, int(length), 0)


def history(index: int, *outcomes: GroupOutcome) -> PromptHistory:
    h = None
    for o in outcomes:
        h = updated_history(h, index, o)
    assert h is not None
    return h


# --- the pure pieces --------------------------------------------------------------------------


def test_a_groups_outcome_says_its_spread_lengths_and_version() -> None:
    o = outcome_of(scored(fresh(3), (1.0, 1.0)))
    assert o == GroupOutcome(epoch=0, zero_std=True, reward_mean=1.0, length_mean=3.0, length_max=3, version=0)
    o = outcome_of(scored(fresh(3), (0.0, 1.0)))
    assert o is not None and not o.zero_std and o.reward_mean == 0.5
    assert outcome_of(fresh(3)) is None  # no reward yet (a failed sample has none): says nothing


def test_the_streak_counts_the_latest_zero_variance_groups_in_a_row_and_the_history_stays_short() -> None:
    h = history(7, outcome(True), outcome(True))
    assert (h.index, h.groups, h.zero_std_streak) == (7, 2, 2)
    h = updated_history(h, 7, outcome(False))
    assert h.zero_std_streak == 0  # one group with a spread ends the streak
    for _ in range(10):
        h = updated_history(h, 7, outcome(True, length=9.0))
    assert h.groups == 13 and h.zero_std_streak == 10 and len(h.recent) == HISTORY_DEPTH
    assert decode_history(encode_history(h), key="k") == h


def test_a_record_that_is_not_a_history_is_refused_naming_its_key() -> None:
    with pytest.raises(CorruptRecordError, match="meta/history"):
        decode_history(b"\x93\x01\x02\x03", key="meta/history/x")
    with pytest.raises(CorruptRecordError, match="version"):
        decode_history(encode_history(history(1, outcome(True))).replace(b"\x01", b"\x09", 1), key="k")


def test_skip_probability_rises_with_the_streak_and_keeps_the_exploration_floor() -> None:
    floor = 0.1
    assert skip_probability(None, explore_floor=floor) == 0.0
    assert skip_probability(history(0, outcome(False)), explore_floor=floor) == 0.0
    probs = [skip_probability(history(0, *[outcome(True)] * k), explore_floor=floor) for k in range(1, 7)]
    assert probs[:3] == [0.5, 0.75, 0.875]
    assert probs == sorted(probs) and max(probs) == pytest.approx(1 - floor)  # never above 1 - floor
    assert skip_probability(history(0, *[outcome(True)] * 6), explore_floor=1.0) == 0.0  # floor 1: never skip


def test_the_skip_draw_is_the_seeds_alone_and_spreads_evenly() -> None:
    assert skip_draw(5, 2, 17) == skip_draw(5, 2, 17)
    draws = [skip_draw(5, e, i) for e in range(4) for i in range(500)]
    assert len(set(draws)) == len(draws) and all(0 <= d < 1 for d in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.03
    # At the floor, about that share of a prompt's passes generate it again.
    h = history(0, *[outcome(True)] * 8)
    kept = sum(not skips(h, seed=5, epoch=e, index=i, explore_floor=0.2) for e in range(4) for i in range(500))
    assert 0.15 < kept / 2000 < 0.25


def test_predicted_length_weighs_the_newest_group_most_and_unknown_prompts_go_first() -> None:
    assert predicted_length(None) is None
    assert predicted_length(history(0, outcome(False, 10.0))) == 10.0
    # newest 2.0 weighs 1, the one before (10.0) weighs 1/2
    assert predicted_length(history(0, outcome(False, 10.0), outcome(False, 2.0))) == pytest.approx(14 / 3)
    groups = [fresh(i) for i in range(5)]
    histories = {
        0: history(0, outcome(False, 5.0)),
        1: history(1, outcome(False, 30.0)),
        3: history(3, outcome(True, 5.0)),
    }
    order = [g.task.index for g in longest_first(groups, histories)]
    assert order == [2, 4, 1, 0, 3]  # no history first (as longest), then longest; ties keep cursor order


# --- the store keeps it -----------------------------------------------------------------------


@pytest.fixture(params=["memory", "lmdb"])
def store(request: pytest.FixtureRequest, tmp_path: Path):
    s = MemoryStore() if request.param == "memory" else LmdbStore(tmp_path / "store")
    yield s
    s.close()


def test_ready_and_rejected_groups_add_to_their_prompts_history_failed_and_partial_ones_do_not(store: Store) -> None:
    store.admit([fresh(i) for i in range(4)], Cursor(0, 4, 4))
    store.put_ready_groups([scored(fresh(0), (1.0, 1.0))])
    store.put_rejected_groups([dataclasses.replace(scored(fresh(1), (0.0, 0.0)), rejected_reason="rejected")])
    store.put_failed(fresh(2))
    store.put_partial(fresh(3))
    got = store.prompt_history([0, 1, 2, 3, 99])
    assert set(got) == {0, 1}
    assert got[0].zero_std_streak == 1 and got[0].recent[0].reward_mean == 1.0
    assert got[1].zero_std_streak == 1 and got[1].recent[0].reward_mean == 0.0


def test_a_producers_results_add_to_the_history_too(store: Store) -> None:
    store.admit([fresh(0), fresh(1)], Cursor(0, 2, 2), owner="p1", lease_seconds=60)
    refused = store.accept_results(
        "p1", [(GroupState.READY, scored(fresh(0), (0.0, 1.0))), (GroupState.PARTIAL, fresh(1))]
    )
    assert refused == {}
    assert set(store.prompt_history([0, 1])) == {0}


def test_a_skip_is_stored_rejected_with_its_reason_together_with_the_cursor(store: Store) -> None:
    skipped = dataclasses.replace(fresh(1), rejected_reason=SKIP_REASON)
    store.admit([fresh(0), fresh(2)], Cursor(0, 3, 3), skipped=[skipped])
    assert store.cursor() == Cursor(0, 3, 3)
    state, group = store.get(skipped.group_id) or (None, None)
    assert state is GroupState.REJECTED and group is not None and group.rejected_reason == SKIP_REASON
    assert store.count(GroupState.RUNNING) == 2
    assert store.prompt_history([1]) == {}  # nothing was generated: the skip adds no outcome
    # All or nothing: an id already held among the skipped refuses the whole admission.
    with pytest.raises(StoreError, match="already exists"):
        store.admit([fresh(3)], Cursor(0, 5, 5), skipped=[dataclasses.replace(fresh(0), rejected_reason=SKIP_REASON)])
    assert store.cursor() == Cursor(0, 3, 3) and store.get(fresh(3).group_id) is None
    with pytest.raises(ValueError, match="says why"):
        store.admit([], Cursor(0, 5, 5), skipped=[fresh(4)])
    with pytest.raises(ValueError, match="generated tokens"):
        store.admit([], Cursor(0, 5, 5), skipped=[dataclasses.replace(finished(fresh(4), 0), rejected_reason="x")])


def test_lmdb_keeps_histories_across_a_reopen_and_garbage_collection(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "s") as s:
        s.admit([fresh(0)], Cursor(0, 1, 1))
        s.put_ready(scored(fresh(0), (1.0, 1.0)))
        batch = s.take_batch(0, 1)
        assert batch is not None
        s.finish_batch(0)
        assert s.collect_garbage(0) == 1
        kept = s.prompt_history([0])
    with LmdbStore(tmp_path / "s", readonly=True) as r:
        assert r.prompt_history([0]) == kept and kept[0].zero_std_streak == 1
        report = r.verify()
        assert report.ok, report.damaged
        assert report.records >= 1


def test_a_damaged_history_record_is_named_by_verify(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "s") as s:
        s.admit([fresh(0)], Cursor(0, 1, 1))
        s.put_ready(scored(fresh(0), (1.0, 1.0)))
        key = keys.history_key(0)

        def damage(env: lmdb.Environment) -> None:  # under the store's own environment and lock
            with env.begin(write=True, db=s._tx.dbs[keys.HISTORY]) as txn:
                raw = bytearray(txn.get(key))
                raw[-1] ^= 0xFF
                txn.put(key, bytes(raw))

        s._tx.under_lock(damage)
        assert [d for d in s.verify().damaged if "history/000000000000" in d]
        with pytest.raises(CorruptRecordError, match="history/000000000000"):
            s.prompt_history([0])


def test_a_store_from_before_histories_reads_as_having_none(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "s") as s:
        s.admit([fresh(0)], Cursor(0, 1, 1))

        def drop(env: lmdb.Environment) -> None:  # as a store written before them
            with env.begin(write=True) as txn:
                txn.drop(s._tx.dbs[keys.HISTORY], delete=True)

        s._tx.under_lock(drop)
    with LmdbStore(tmp_path / "s", readonly=True) as r:
        assert r.prompt_history([0]) == {} and r.verify().ok
    with LmdbStore(tmp_path / "s") as w:  # a writer adds the database and fills it
        w.put_ready(scored(fresh(0), (1.0, 1.0)))
        assert w.prompt_history([0])[0].zero_std_streak == 1


# --- the dispenser decides from it ------------------------------------------------------------


async def dispense(store: Store, dataset: list[PromptTask], selection: PromptSelection, n: int) -> list[Group]:
    """`n` groups from a dispenser with `selection`, handed over in order."""
    admission = Admission()
    dispenser = Dispenser(
        AsyncStore(store), dataset, n_samples=2, clock=VersionClock(), admission=admission, batch=8, selection=selection
    )
    send, receive = anyio.create_memory_object_stream[Group](0)
    got = []
    async with receive, anyio.create_task_group() as tg:
        await tg.start(dispenser.run, send)
        admission.grant(n)
        with anyio.fail_after(10):
            got = [await receive.receive() for _ in range(n)]
        tg.cancel_scope.cancel()
    return got


def seeded(n: int, rewards: dict[int, tuple[float, float]], *, length: dict[int, int] | None = None) -> MemoryStore:
    """A memory store whose epoch 0 of `n` prompts finished with these rewards (and lengths)."""
    store = MemoryStore()
    groups = [fresh(i) for i in range(n)]
    store.admit(groups, Cursor(1, 0, n))
    store.put_ready_groups([scored(g, rewards.get(g.task.index, (0.0, 1.0))) for g in groups])
    if length:
        for i, tokens in length.items():
            g = dataclasses.replace(fresh(i), group_id=f"len-{i}")
            store.admit([g], store.cursor())
            done = generated(g, 0, reason=FinishReason.STOP, tokens=tokens)
            store.put_ready(done.with_samples([s.with_reward(float(s.index)) for s in done.samples]))
    return store


@pytest.mark.anyio
async def test_the_dispenser_skips_streaking_prompts_deterministically_and_fills_every_ticket() -> None:
    dataset = [fresh(i).task for i in range(12)]
    zero = {i: (1.0, 1.0) for i in range(0, 12, 2)}  # even rows: equal rewards
    selection = PromptSelection(seed=3, skip_zero_std=True, explore_floor=0.1)
    a, b = seeded(12, zero), seeded(12, zero)
    got_a, got_b = await dispense(a, dataset, selection, 8), await dispense(b, dataset, selection, 8)
    assert [g.group_id for g in got_a] == [g.group_id for g in got_b]  # the same store and seed decide alike
    skipped = [g for g in a.groups(GroupState.REJECTED) if g.rejected_reason == SKIP_REASON]
    hist = a.prompt_history(range(12))
    expected = [i for i in range(12) if skips(hist.get(i), seed=3, epoch=1, index=i, explore_floor=0.1)]
    passed = {g.task.index for g in got_a} | {g.task.index for g in skipped}
    assert sorted(g.task.index for g in skipped) == [i for i in expected if i in passed]
    assert skipped and all(g.task.index % 2 == 0 for g in skipped)  # only prompts on a streak
    assert len(got_a) == 8 and not {g.group_id for g in got_a} & {g.group_id for g in skipped}
    n = len(passed)  # every position the cursor passed, skipped or admitted, once each
    assert n == len(got_a) + len(skipped) and a.cursor() == Cursor(1 + n // 12, n % 12, 12 + n)


@pytest.mark.anyio
async def test_one_admission_skips_at_most_a_datasets_worth_then_admits() -> None:
    dataset = [fresh(i).task for i in range(4)]
    store = seeded(4, {i: (1.0, 1.0) for i in range(4)})
    for _ in range(40):  # a streak of 41: skipped with probability 1 - 1e-9 at this floor
        g = dataclasses.replace(fresh(0), group_id=f"x{_}")
        store.admit([g], store.cursor())
        store.put_ready(scored(g, (1.0, 1.0)))
    for i in range(1, 4):
        for k in range(40):
            g = dataclasses.replace(fresh(i), group_id=f"x{i}-{k}")
            store.admit([g], store.cursor())
            store.put_ready(scored(g, (1.0, 1.0)))
    got = await dispense(store, dataset, PromptSelection(seed=1, skip_zero_std=True, explore_floor=1e-9), 2)
    assert len(got) == 2  # every ticket got a group: the admission ended
    assert sum(g.rejected_reason == SKIP_REASON for g in store.groups(GroupState.REJECTED)) == 4


@pytest.mark.anyio
async def test_length_aware_admission_hands_the_longest_predicted_prompts_over_first() -> None:
    dataset = [fresh(i).task for i in range(6)]
    store = seeded(6, {}, length={0: 2, 1: 20, 2: 5, 3: 40, 4: 9, 5: 1})
    got = await dispense(store, dataset, PromptSelection(longest_first=True), 6)
    assert [g.task.index for g in got] == [3, 1, 4, 2, 0, 5]
    assert sorted(g.seq for g in got) == [g.seq for g in sorted(got, key=lambda g: g.task.index)]  # FIFO numbers kept
    plain = await dispense(seeded(6, {}, length={0: 2, 1: 20}), dataset, PromptSelection(), 6)
    assert [g.task.index for g in plain] == list(range(6))  # off: the cursor's order


# --- a skip across a SIGKILL of the LMDB writer (real processes) -----------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}


def _life(store: Path, life: int) -> list[str]:
    return [sys.executable, "-m", "tests.history_kill_child", str(store), str(life)]


def _skipped_ids(s: LmdbStore) -> set[str]:
    return {g.group_id for g in s.groups(GroupState.REJECTED) if g.rejected_reason == SKIP_REASON}


def test_a_skip_decided_when_the_writer_is_killed_is_lost_whole_and_decided_again_the_same(tmp_path: Path) -> None:
    path = tmp_path / "store"
    first = subprocess.Popen(_life(path, 1), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    try:
        assert first.stdout is not None
        while not lines or lines[-1] != "HELD":  # blocks until the child holds its second skipping admit
            line = first.stdout.readline()
            assert line, "the child exited before it held:\n" + "\n".join(lines)
            lines.append(line.decode().strip())
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        if first.stdout is not None:
            first.stdout.close()
    committed = [line.split()[1:] for line in lines if line.startswith("COMMITTED")]
    [decided] = [line.split()[1:] for line in lines if line.startswith("DECIDED")]
    assert len(committed) == 1
    with LmdbStore(path, readonly=True) as s:
        stored = _skipped_ids(s)
        assert stored == set(committed[0][:-2])  # the committed skips, and only them
        assert not stored & set(decided[:-2])  # the decided one was lost whole: no skip, no cursor move
        assert s.cursor().epoch == int(committed[0][-2]) and s.cursor().index == int(committed[0][-1])
        histories = s.prompt_history(range(child.ROWS))

    second = subprocess.run(_life(path, 2), cwd=ROOT, env=_env(), capture_output=True, timeout=120, check=False)
    assert second.returncode == 0 and b"DONE" in second.stdout, second.stdout + second.stderr
    with LmdbStore(path, readonly=True) as s:
        skipped = _skipped_ids(s)
        # Every skip of epochs 2 and 3 is exactly what the histories and the seed say, once each;
        # the one the killed life decided but never stored was decided again, the same.
        expected = {
            f"e{e:04d}-p{i:09d}"
            for e in (2, 3)
            for i in range(child.ROWS)
            if skips(histories.get(i), seed=child.SEED, epoch=e, index=i, explore_floor=child.FLOOR)
        }
        assert {gid for gid in skipped if gid[:5] in ("e0002", "e0003")} == expected
        assert set(decided[:-2]) <= skipped
        # Every prompt of those epochs is in the store exactly once: skipped, or admitted.
        rows = [g.group_id for st in GroupState for g in s.groups(st) if g.epoch in (2, 3)]
        assert sorted(rows) == sorted(f"e{e:04d}-p{i:09d}" for e in (2, 3) for i in range(child.ROWS))


# --- a run: metrics under the filter's names, memory mode, replay's accounting ----------------


def reward_by_row(task: PromptTask, sample) -> float:
    """Rows 0-3 score every sample alike (no spread, ever); the others score by sample."""
    return 1.0 if task.index < 4 else float(sample.index % 2)


@pytest.mark.anyio
@pytest.mark.parametrize(("mode", "transport"), [("sync", "memory"), ("sync", "lmdb"), ("async", "memory")])
async def test_a_run_skips_prompts_on_a_streak_stores_each_skip_and_counts_it_under_the_filters_name(
    mode: str, transport: str, tmp_path: Path
) -> None:
    dataset = [PromptTask(index=i, prompt_ids=(3, 100 + i), label=i) for i in range(8)]
    plan = RolloutPlan(
        mode=mode, batch_size=2, n_samples=2, num_steps=10, slots=8, max_response_len=8, seed=5,
        skip_zero_std=True, skip_explore_floor=0.1,
    )  # fmt: skip
    raw = MemoryStore() if transport == "memory" else LmdbStore(tmp_path / "rollout")
    sink = MetricsSink(None)
    async with FakeSGLang(token_fn=lengths_by_prompt, eos_token_id=EOS) as fake:
        async with EngineFleet([fake.url], concurrency=plan.slots) as fleet:
            await fleet.update_weight_version("0")
            with anyio.fail_after(60):
                await run_pipeline(
                    plan,
                    engines=fleet,
                    store=AsyncStore(raw),
                    trainer=RecordingTrainer(),
                    dataset=dataset,
                    reward_fn=reward_by_row,
                    filter_fn=reward_std_nonzero,
                    weights_dir=tmp_path / "w",
                    metrics=sink,
                )
    records = sink.records
    try:
        skipped = [g for g in raw.groups(GroupState.REJECTED) if g.rejected_reason == SKIP_REASON]
        assert skipped and all(g.task.index < 4 and g.epoch >= 1 for g in skipped)
        assert all(s.response_len == 0 for g in skipped for s in g.samples)  # never generated
        # The key is there from the first step (the key set stays fixed), under the filter's name.
        assert all("filter/rejected/skipped_zero_std" in r for r in records)
        assert records[-1]["filter/rejected/skipped_zero_std"] == len(skipped)
        assert records[-1]["filter/rejected/rejected"] > 0  # the filter's own, generated then rejected
        summary = summarize(raw, store_path="here")
        assert sum(summary.skipped_by_epoch.values()) == len(skipped)
        assert f"{SKIP_REASON} {len(skipped)}" in format_summary(summary)
        assert "zero-variance streak" in format_history(raw.prompt_history([0])[0])
    finally:
        raw.close()


# --- config -----------------------------------------------------------------------------------


def test_both_switches_are_off_by_default_and_reach_the_plan() -> None:
    config = load_config([])
    r = config.rollout
    assert (r.skip_zero_std_prompts, r.skip_explore_floor, r.length_aware_admission) == (False, 0.1, False)
    on = load_config(["--skip-zero-std-prompts", "--skip-explore-floor", "0.25", "--length-aware-admission"])
    assert on.rollout.skip_zero_std_prompts and on.rollout.skip_explore_floor == 0.25
    from pipeline.run.cli import _plan

    plan = _plan(on)
    assert (plan.skip_zero_std, plan.skip_explore_floor, plan.length_aware_admission) == (True, 0.25, True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--length-aware-admission", "--rollout-mode", "async"], "async admission has no rounds"),
        (["--skip-zero-std-prompts", "--skip-explore-floor", "1.5"], "must be in (0, 1]"),
        (["--skip-zero-std-prompts", "--skip-explore-floor", "0"], "must be > 0"),
        (["--skip-zero-std-prompts", "--n-samples-per-prompt", "1"], "a group of one always has zero reward variance"),
    ],
)
def test_refused_combinations_name_the_value_and_the_rule(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    assert message in str(info.value)
    assert argv[0] in str(info.value) or argv[-2] in str(info.value)


def test_a_floor_without_skipping_is_a_warning() -> None:
    assert any("without --skip-zero-std-prompts" in w for w in load_config(["--skip-explore-floor", "0.2"]).warnings)
    assert not load_config(["--skip-explore-floor", "0.1"]).warnings  # the default, written out: fine


def test_the_plan_refuses_length_aware_async_and_the_selection_a_zero_floor() -> None:
    with pytest.raises(ValueError, match="async admission has no rounds"):
        RolloutPlan(mode="async", batch_size=1, n_samples=2, num_steps=1, length_aware_admission=True)
    with pytest.raises(ValueError, match="never be generated again"):
        PromptSelection(skip_zero_std=True, explore_floor=0.0)

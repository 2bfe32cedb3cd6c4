"""Truthful token versions (issue 8, defects 1 and 2): the wire format's per-token spans, the
protocol fake that emits them, and the generator pool that stamps samples from them.

Everything runs over real HTTP against the protocol fake; ordering comes from the fake's hold gate,
`wait_until` and anyio events, never sleeps.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import anyio
import pytest

from core.clock import VersionClock
from core.errors import EngineError
from core.types import (
    Batch,
    FinishReason,
    Group,
    PromptTask,
    Sample,
    SampleStatus,
    Segment,
    VersionSpan,
)
from pipeline.metrics import batch_metrics
from stages.publisher import publish_weights
from stages.sglang_client import EngineClient, EngineFleet, EngineSpan, GenerateResult
from storage import GroupState, MemoryStore
from tests.fakes import FakeSGLang
from tests.test_async_mode import MAX_LEN, N_SAMPLES, Rig

pytestmark = pytest.mark.anyio

URL = "http://engine:1/generate"


def answer(spans: object, *, tokens: int = 4, weight_version: str | None = "1") -> dict:
    meta: dict = {
        "id": "r",
        "finish_reason": {"type": "length", "length": tokens},
        "completion_tokens": tokens,
        "output_token_logprobs": [[-0.5, 7, None]] * tokens,
        "weight_versions": spans,
    }
    if weight_version is not None:
        meta["weight_version"] = weight_version
    return {"text": "", "output_ids": [7] * tokens, "meta_info": meta}


def span(version: str, start: int, end: int) -> dict:
    return {"version": version, "start": start, "end": end}


# -- the wire format ---------------------------------------------------------------------------


def test_spans_are_read_into_the_result():
    result = GenerateResult.from_response(answer([span("0", 0, 1), span("1", 1, 4)]), url=URL, rid="r")
    assert result.weight_versions == (EngineSpan("0", 0, 1), EngineSpan("1", 1, 4))
    assert result.weight_version == "1"
    older = GenerateResult.from_response(answer(None), url=URL, rid="r")
    assert older.weight_versions is None and older.weight_version == "1"
    # An abort before the first token: one empty span. Without weight_version the last span says it.
    empty = GenerateResult.from_response(answer([span("3", 0, 0)], tokens=0, weight_version=None), url=URL, rid="r")
    assert empty.weight_versions == (EngineSpan("3", 0, 0),) and empty.weight_version == "3"


@pytest.mark.parametrize(
    ("spans", "problem"),
    [
        ([], "non-empty list"),
        ({"version": "1", "start": 0, "end": 4}, "non-empty list"),
        ([span("1", 1, 4)], "contiguous from 0"),
        ([span("0", 0, 2), span("1", 3, 4)], "contiguous from 0"),
        ([span("0", 0, 3), span("1", 2, 4)], "contiguous from 0"),
        ([span("1", 0, 3)], "end at 3, but the answer has completion_tokens 4"),
        ([span("1", 0, 5)], "end at 5"),
        ([{"version": "1", "start": 0, "end": True}], "int start/end"),
        ([{"start": 0, "end": 4}], "needs a version"),
        (["1"], "not an object"),
        ([span("0", 0, 4)], "is not the last span's version"),  # weight_version says "1"
    ],
)
def test_malformed_spans_are_an_engine_error_naming_the_value(spans, problem):
    with pytest.raises(EngineError, match=problem) as info:
        GenerateResult.from_response(answer(spans), url=URL, rid="r")
    assert info.value.url == URL
    named = spans[0] if isinstance(spans, list) and spans else spans
    assert repr(named) in str(info.value)  # the message shows the offending value


def test_a_segment_carries_spans_and_a_sample_stamps_each_token():
    segment = Segment(
        (1, 2, 3), (-1.0,) * 3, FinishReason.LENGTH, 1, spans=(VersionSpan(0, 1, 0), VersionSpan(1, 3, 1))
    )
    with pytest.raises(ValueError, match="cover 2 of 3"):
        Segment((1, 2, 3), (-1.0,) * 3, FinishReason.LENGTH, 1, spans=(VersionSpan(0, 2, 0),))
    sample = Sample(0, (5,)).extended(Segment((9,), (-1.0,), FinishReason.ABORT, 0), max_response_len=8)
    sample = sample.extended(segment, max_response_len=8)
    # The prefix's v0 span and the segment's first (v0) span merge; the boundary stays where it was.
    assert sample.spans == (VersionSpan(0, 2, 0), VersionSpan(2, 4, 1))
    assert sample.token_versions() == [0, 0, 1, 1]


# -- the protocol fake ---------------------------------------------------------------------------


async def _cross_a_publish(fake: FakeSGLang, mode: str, tmp_path: Path) -> GenerateResult:
    """One request generates 2 tokens under v0, a publish in `mode` moves the engine to v1, and
    the request finishes under v1."""
    results: list[GenerateResult] = []
    async with aiohttp.ClientSession() as session:
        engine = EngineClient(fake.url, session, request_timeout=10.0, control_timeout=5.0)

        async def run() -> None:
            results.append(await engine.generate([3, 4], {"max_new_tokens": 5}, rid="r-cross"))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                fake.hold(2)
                tg.start_soon(run)
                await fake.wait_until(lambda: fake.held == 1)
                await engine.pause(mode)
                await engine.update_weights_from_disk(str(tmp_path), weight_version="1", flush_cache=False)
                fake.release()
                await engine.continue_generation()
    return results[0]


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_fake_reports_two_spans_with_the_boundary_at_the_publish(mode, tmp_path):
    async with FakeSGLang(weight_version="0") as fake:
        result = await _cross_a_publish(fake, mode, tmp_path)
    assert result.finish_reason is FinishReason.LENGTH and len(result.token_ids) == 5
    assert result.weight_versions == (EngineSpan("0", 0, 2), EngineSpan("1", 2, 5))
    assert result.weight_version == "1"


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_older_fake_reports_only_the_last_version(mode, tmp_path):
    async with FakeSGLang(weight_version="0", legacy_versions=True) as fake:
        result = await _cross_a_publish(fake, mode, tmp_path)
        payload_meta = fake.finished[-1]
    assert result.weight_versions is None and result.weight_version == "1"
    assert payload_meta.version_marks == [(0, "0"), (2, "1")]  # the fake knew; it did not say


async def test_fake_records_a_version_change_without_new_weights_and_an_abort_before_any_token():
    async with FakeSGLang(weight_version="4") as fake, aiohttp.ClientSession() as session:
        engine = EngineClient(fake.url, session, request_timeout=10.0, control_timeout=5.0)
        results: list[GenerateResult] = []

        async def run(rid: str) -> None:
            results.append(await engine.generate([3], {"max_new_tokens": 4}, rid=rid))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                fake.hold(0)
                tg.start_soon(run, "r-empty")
                await fake.wait_until(lambda: fake.held == 1)
                await engine.update_weight_version("5")  # no weights moved, still a boundary
                await engine.abort_all()
    [empty] = results
    assert empty.finish_reason is FinishReason.ABORT and empty.token_ids == ()
    assert empty.weight_versions == (EngineSpan("5", 0, 0),) and empty.weight_version == "5"


# -- the generator pool stamps samples from the spans ---------------------------------------------


async def _one_group_across_a_publish(fake, clock, store, tmp_path, mode):
    async with EngineFleet([fake.url], concurrency=16) as fleet, anyio.create_task_group() as tg:
        rig = Rig(fleet, store, clock)
        await rig.start(tg)
        await rig.publish_with_one_group_held(fake, fleet, tmp_path / "v1", mode)
        tg.cancel_scope.cancel()
    return rig


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_older_engine_crossing_a_publish_is_stamped_with_the_older_version_and_counted(mode, tmp_path):
    store, clock = MemoryStore(), VersionClock()
    async with FakeSGLang(weight_version="0", legacy_versions=True) as fake:
        rig = await _one_group_across_a_publish(fake, clock, store, tmp_path, mode)
    [group] = rig.ready_groups()
    for s in group.samples:
        assert s.status is SampleStatus.TRUNCATED
        assert s.spans == (VersionSpan(0, MAX_LEN, 0),)  # never the newer version
    assert rig.pool.statistics().unknown_boundary_tokens == N_SAMPLES * MAX_LEN


async def test_engine_with_spans_leaves_no_unknown_boundary(tmp_path):
    store, clock = MemoryStore(), VersionClock()
    async with FakeSGLang(weight_version="0") as fake:
        rig = await _one_group_across_a_publish(fake, clock, store, tmp_path, "in_place")
    [group] = rig.ready_groups()
    assert all(s.spans == (VersionSpan(0, 2, 0), VersionSpan(2, MAX_LEN, 1)) for s in group.samples)
    assert rig.pool.statistics().unknown_boundary_tokens == 0
    # The group's staleness and the off-policy share read the spans: at v1, half a version stale.
    batch = Batch(0, (group,))
    metrics = batch_metrics(batch, version=1)
    assert metrics["staleness/max"] == 1 and metrics["staleness/multi_version_frac"] == 1.0
    assert metrics["off_policy_token_frac"] == pytest.approx(2 / MAX_LEN)


async def test_an_answer_processed_after_the_clock_moved_on_is_kept():
    """Defect 2: the engine assembled the answer at v0, the pool reads it after the clock moved to
    v1. That version was published; the answer is stamped v0 and the run goes on."""
    store, clock = MemoryStore(), VersionClock()
    async with (
        FakeSGLang(weight_version="0") as fake,
        EngineFleet([fake.url], concurrency=16) as fleet,
        anyio.create_task_group() as tg,
    ):
        rig = Rig(fleet, store, clock)
        await rig.start(tg)
        with anyio.fail_after(10):
            await rig.park_granted(fake, tokens=3)
            with clock.publish():  # the clock moves on; this engine is not told (yet)
                pass
            fake.release()
            await rig.admission.wait_settled()
        tg.cancel_scope.cancel()
    [group] = rig.ready_groups()
    assert clock.version == 1
    assert all(s.spans == (VersionSpan(0, MAX_LEN, 0),) for s in group.samples)


async def test_a_version_from_the_future_fails_that_request_not_the_run():
    store, clock = MemoryStore(), VersionClock()
    async with (
        FakeSGLang(weight_version="0") as fake,
        EngineFleet([fake.url], concurrency=16) as fleet,
        anyio.create_task_group() as tg,
    ):
        rig = Rig(fleet, store, clock)
        await rig.start(tg)
        with anyio.fail_after(10):
            await rig.park_granted(fake)
            fake.weight_version = "7"  # a version the clock never published
            fake.release()
            await rig.admission.wait_settled()
            fake.weight_version = "0"
            rig.admission.grant(1)  # the pool still serves
            await rig.admission.wait_settled()
        tg.cancel_scope.cancel()
    [failed] = list(store.groups(GroupState.FAILED))
    assert all(s.status is SampleStatus.FAILED and "'7'" in (s.error or "") for s in failed.samples)
    [ready] = rig.ready_groups()
    assert all(s.spans == (VersionSpan(0, MAX_LEN, 0),) for s in ready.samples)
    assert rig.pool.statistics().failed_samples == N_SAMPLES


# -- staleness, off-policy share and serving order follow the spans ----------------------------


def _group(index: int, seq: int, *parts: tuple[int, int]) -> Group:
    """A partial group whose two samples hold `parts` as (tokens, version) segments."""
    task = PromptTask(index=index, prompt_ids=(1, 2))
    group = Group.fresh(task, epoch=0, n_samples=2, version=parts[0][1], seq=seq)
    samples = []
    for s in group.samples:
        for n, version in parts:
            s = s.extended(Segment((3,) * n, (-1.0,) * n, FinishReason.ABORT, version), max_response_len=64)
        samples.append(s)
    return group.with_samples(samples)


def test_partial_groups_are_served_oldest_token_version_first():
    store = MemoryStore()
    newer = _group(0, 0, (4, 2))  # admitted first, every token at v2
    mixed = _group(1, 1, (1, 1), (4, 2))  # admitted later, one token at v1
    for g in (newer, mixed):
        store.admit([g], store.cursor())
        store.put_partial(g)
    assert [g.group_id for g in store.claim_partial(2)] == [mixed.group_id, newer.group_id]


def test_staleness_metrics_read_every_span():
    mixed = _group(1, 1, (1, 1), (3, 2))
    metrics = batch_metrics(Batch(0, (mixed,)), version=3)
    assert metrics["staleness/max"] == 2  # the v1 token, not the v2 tail
    assert metrics["off_policy_token_frac"] == 1.0
    assert batch_metrics(Batch(0, (mixed,)), version=2)["off_policy_token_frac"] == pytest.approx(1 / 4)


def test_groups_staler_than_the_bound_are_reported_as_overtaken():
    fresh = _group(0, 0, (2, 3))
    straggler = _group(1, 1, (1, 0), (3, 3))  # one token from v0, trained at v3
    batch = Batch(0, (fresh, straggler))
    assert batch_metrics(batch, version=3, max_staleness=1)["staleness/overtaken_groups"] == 1
    assert batch_metrics(batch, version=3, max_staleness=3)["staleness/overtaken_groups"] == 0
    assert batch_metrics(batch, version=3)["staleness/overtaken_groups"] == 0  # no bound, nothing overtaken


async def test_an_abort_publish_with_requests_waiting_on_an_older_engine_loses_no_sample(tmp_path):
    """SGLang up to late 2025 answers a request aborted in its waiting queue with no weight_version
    ("Abort before prefill"); such a request goes back for its turn like any aborted one."""
    store, clock = MemoryStore(), VersionClock()
    async with FakeSGLang(weight_version="0", max_running=1, legacy_waiting_abort=True) as fake:
        async with EngineFleet([fake.url], concurrency=16) as fleet, anyio.create_task_group() as tg:
            rig = Rig(fleet, store, clock)
            await rig.start(tg)
            fake.hold(1)
            rig.admission.grant(1)
            with anyio.fail_after(10):
                await fake.wait_until(lambda: fake.held == 1 and fake.waiting == N_SAMPLES - 1)
                await publish_weights(clock, fleet, tmp_path / "v1", pause_mode="abort")
                fake.release()
                await rig.admission.wait_settled()
            tg.cancel_scope.cancel()
            engine_stats = fleet.statistics()
    # An answer, not an engine error: a sample whose turn found "no engine" too often would fail.
    assert engine_stats.errors == 0 and engine_stats.aborts == N_SAMPLES
    [group] = rig.ready_groups()
    assert all(s.status is SampleStatus.TRUNCATED and s.response_len == MAX_LEN for s in group.samples)
    assert any(r.sampling_params and r.aborted and not r.output_ids for r in fake.finished)  # some waited
    stats = rig.pool.statistics()
    assert stats.failed_samples == 0 and stats.aborted_requests >= 1


class RecordingTransfer:
    """A `WeightTransfer` that announces one empty bucket to every engine, as the distributed
    sender's last bucket does, and records the flush it was told to ask for."""

    def __init__(self, fleet: EngineFleet) -> None:
        self.fleet, self.flushes = fleet, []

    async def prepare(self) -> None:
        pass

    def discard(self) -> None:
        pass

    async def send(self, weight_version: str, *, flush_cache: bool) -> None:
        self.flushes.append(flush_cache)
        await self.fleet.update_weights_from_distributed(
            [], group_name="g", weight_version=weight_version, flush_cache=flush_cache
        )


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_a_distributed_publish_asks_for_a_flush_only_when_the_engines_hold_no_request(mode, tmp_path):
    """SGLang's scheduler asserts that the flush after `update_weights_from_distributed` succeeded,
    and refuses to flush while it holds requests: a flush asked for under a retract or in_place
    pause kills the engine. Requests survive those pauses and finish under the new version."""
    async with FakeSGLang(weight_version="0") as fake, EngineFleet([fake.url]) as fleet:
        transfer = RecordingTransfer(fleet)
        fake.hold(2)
        results: list[GenerateResult] = []

        async def run() -> None:
            results.append(await fleet.generate([1, 2], {"max_new_tokens": 4}, rid="held"))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await fake.wait_until(lambda: fake.held == 1)
                await publish_weights(VersionClock(), fleet, tmp_path / "v1", pause_mode=mode, transfer=transfer)
                fake.release()
        assert fake.healthy and fake.weight_version == "1"
    assert transfer.flushes == [mode == "abort"]
    assert results[0].finish_reason is (FinishReason.ABORT if mode == "abort" else FinishReason.LENGTH)

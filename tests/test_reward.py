"""The reward stage: sync rewards scored on worker threads and async ones awaited on the loop, both
under the same deadline; failures recorded on the sample and the group stored as failed; retries
after a growing wait. Real parts: the memory store behind `AsyncStore`, anyio memory streams, the
real stage, real threads."""

from __future__ import annotations

import math
import random
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import numpy as np
import pytest
import structlog.testing

from core.types import FinishReason, Group, PromptTask, Sample, SampleStatus
from stages.admission import Admission
from stages.reward import RetryBackoff, RewardFn, RewardStage
from storage import AsyncStore, Cursor, GroupState, MemoryStore
from tests.test_store import fresh, generated

pytestmark = pytest.mark.anyio


@pytest.fixture
async def store() -> AsyncIterator[AsyncStore]:
    async with AsyncStore(MemoryStore()) as astore:
        yield astore


async def _scored(
    store: AsyncStore, fn: RewardFn, groups: list[Group], *, timeout: float = 5.0, **stage: Any
) -> list[Group]:
    """Run `groups` (admitted, finished, unscored) through a RewardStage; what comes out downstream."""
    admission = Admission()
    admission.grant(len(groups))
    assert await admission.take_tickets(len(groups)) == len(groups)
    await store.admit([fresh(g.task.index) for g in groups], Cursor(0, len(groups), len(groups)))
    stage = RewardStage(fn, timeout=timeout, store=store, admission=admission, **stage)
    send_in, receive_in = anyio.create_memory_object_stream[Group](len(groups))
    send_out, receive_out = anyio.create_memory_object_stream[Group](len(groups))
    async with anyio.create_task_group() as tg:
        await tg.start(stage.run, receive_in, send_out)
        async with send_in:
            for g in groups:
                await send_in.send(g)
        with anyio.fail_after(5):
            async with receive_out:
                return [g async for g in receive_out]


def _unscored(index: int) -> Group:
    return generated(fresh(index), 0, reason=FinishReason.STOP)


def _length(task: PromptTask, sample: Sample) -> float:
    return float(sample.response_len + sample.index)


async def _async_length(task: PromptTask, sample: Sample) -> float:
    await anyio.lowlevel.checkpoint()
    return float(sample.response_len + sample.index)


@pytest.mark.parametrize(
    "fn",
    [_length, _async_length, lambda task, sample: _async_length(task, sample)],
    ids=["sync", "async", "def-awaitable"],
)
async def test_every_sample_gets_its_reward(store: AsyncStore, fn: RewardFn) -> None:
    out = await _scored(store, fn, [_unscored(0), _unscored(1)])
    assert [[s.reward for s in g.samples] for g in out] == [[3.0, 4.0], [3.0, 4.0]]
    assert all(s.status is SampleStatus.COMPLETED for g in out for s in g.samples)


async def test_a_sample_scored_before_keeps_its_reward(store: AsyncStore) -> None:
    group = _unscored(0)
    group = group.with_samples([group.samples[0].with_reward(-7.0), group.samples[1]])
    (out,) = await _scored(store, _length, [group])
    assert [s.reward for s in out.samples] == [-7.0, 4.0]


def _fails_on_second(task: PromptTask, sample: Sample) -> float:
    if sample.index == 1:
        raise RuntimeError("no verdict")
    return 1.0


async def _async_nan(task: PromptTask, sample: Sample) -> float:
    await anyio.lowlevel.checkpoint()
    return math.nan


async def _never(task: PromptTask, sample: Sample) -> float:
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


async def _async_inf(task: PromptTask, sample: Sample) -> float:
    await anyio.lowlevel.checkpoint()
    return math.inf


@pytest.mark.parametrize(
    ("fn", "error"),
    [
        (_fails_on_second, "reward: RuntimeError('no verdict')"),
        (lambda task, sample: "high" if sample.index == 1 else 1.0, "reward: the reward function returned 'high'"),
        (_never, "reward: timed out"),
        # A NaN or infinite reward would turn the group's advantages, the loss and then the weights
        # into NaN: it fails its sample, as an exception does.
        (lambda task, sample: math.nan if sample.index == 1 else 1.0, "reward: the reward function returned nan"),
        (lambda task, sample: -math.inf if sample.index == 1 else 1.0, "reward: the reward function returned -inf"),
        (_async_nan, "reward: the reward function returned nan"),
        (_async_inf, "reward: the reward function returned inf"),
        (lambda task, sample: None, "reward: the reward function returned None"),
        (lambda task, sample: "1.0", "reward: the reward function returned '1.0'"),
    ],
    ids=["raises", "not-a-number", "timeout", "nan", "inf", "async-nan", "async-inf", "none", "str"],
)
async def test_a_failed_reward_fails_its_sample_and_stores_the_group_as_failed(
    store: AsyncStore, fn: RewardFn, error: str
) -> None:
    stage_out = await _scored(store, fn, [_unscored(0)], timeout=0.05)
    assert stage_out == []  # nothing downstream: the group went to the failed set
    (stored,) = await store.groups(GroupState.FAILED)
    failed = [s for s in stored.samples if s.status is SampleStatus.FAILED]
    assert failed and all(s.error is not None and s.error.startswith(error) for s in failed)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, 1.0), (False, 0.0), (3, 3.0), (np.float32(0.5), 0.5), (np.float64(-2.0), -2.0), (np.bool_(True), 1.0)],
    ids=["true", "false", "int", "np.float32", "np.float64", "np.bool_"],
)
async def test_a_bool_an_int_or_a_numpy_scalar_is_a_reward(store: AsyncStore, value: object, expected: float) -> None:
    (out,) = await _scored(store, lambda task, sample: value, [_unscored(0)])  # type: ignore[arg-type,return-value]
    assert [s.reward for s in out.samples] == [expected, expected]
    assert all(type(s.reward) is float for s in out.samples)


async def test_the_first_group_each_error_fails_is_logged_once(store: AsyncStore) -> None:
    # Failed groups reach the metrics only with a completed step: a reward that fails every sample
    # must be said at once, and once per distinct error.
    with structlog.testing.capture_logs() as logs:
        await _scored(store, _fails_on_second, [_unscored(0), _unscored(1), _unscored(2)])
    warned = [e for e in logs if e["log_level"] == "warning"]
    assert len(warned) == 1, warned
    assert warned[0]["error"] == "reward: RuntimeError('no verdict')" and warned[0]["failed_samples"] == "1/2"


async def test_a_sync_reward_runs_off_the_loop_under_the_same_deadline(store: AsyncStore) -> None:
    # Before: a plain def ran on the event loop with no deadline: a 12 s reward held the whole step
    # with --reward-timeout 2. Now it runs on a worker thread: the deadline fails the sample, and
    # the loop runs other tasks while the function still blocks.
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()

    def blocking(task: PromptTask, sample: Sample) -> float:
        entered.set()
        release.wait(2)  # blocks its thread (the loop's, before) far past the 0.05 s deadline
        returned.set()
        return 1.0

    ran_while_blocked: list[bool] = []

    async def beside() -> None:
        await anyio.to_thread.run_sync(entered.wait, 5)
        await anyio.lowlevel.checkpoint()  # scheduled by the loop: only if the reward left it free
        ran_while_blocked.append(not returned.is_set())

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(beside)
            out = await _scored(store, blocking, [_unscored(0)], timeout=0.05)
    finally:
        release.set()  # the abandoned calls return; their threads go
    assert ran_while_blocked == [True]
    assert out == []
    (stored,) = await store.groups(GroupState.FAILED)
    assert [s.error for s in stored.samples] == ["reward: timed out", "reward: timed out"]


async def test_calls_past_their_deadline_keep_their_threads_and_later_calls_say_so(store: AsyncStore) -> None:
    # A thread cannot be killed: a call past its deadline keeps its thread until it returns. With
    # every thread so stuck (one, here), the next call never starts, and its sample says why.
    release, calls = threading.Event(), []

    def hangs(task: PromptTask, sample: Sample) -> float:
        calls.append(sample.index)
        release.wait(5)
        return 1.0

    try:
        await _scored(store, hangs, [_unscored(0)], timeout=0.05, threads=1)
    finally:
        release.set()
    (stored,) = await store.groups(GroupState.FAILED)
    assert calls == [0]
    assert stored.samples[0].error == "reward: timed out"
    error = stored.samples[1].error or ""
    assert error.startswith("reward: timed out (no reward thread free: all 1 are in calls past their deadline"), error


async def test_retries_wait_longer_each_time(store: AsyncStore) -> None:
    # Before: a retry followed its failure at once; a reward service down for a moment was hit
    # again by every sample that failed on it.
    failures: dict[int, int] = {}

    def flaky(task: PromptTask, sample: Sample) -> float:
        failures[sample.index] = failures.get(sample.index, 0) + 1
        if failures[sample.index] <= 3:
            raise ConnectionError("reward service busy")
        return 1.0

    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await anyio.lowlevel.checkpoint()

    (out,) = await _scored(store, flaky, [_unscored(0)], max_retries=3, sleep=sleep)
    assert [s.reward for s in out.samples] == [1.0, 1.0]
    assert len(waits) == 3 and waits == sorted(waits), waits
    for wait, ceiling in zip(waits, (0.5, 1.0, 2.0), strict=True):
        assert ceiling / 2 <= wait <= ceiling, waits


def test_the_backoff_is_jittered_and_capped() -> None:
    backoff, rng = RetryBackoff(first=0.5, cap=8.0), random.Random(0)
    delays = [backoff.delay(retry, rng) for retry in range(8)]
    assert all(4.0 <= d <= 8.0 for d in delays[4:]), delays  # capped: 0.5 * 2**4 = 8
    assert len({backoff.delay(0, rng) for _ in range(5)}) == 5  # jittered: retries do not fall together

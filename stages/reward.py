"""The reward stage: scores every sample of a finished group with the user's function.

The function is `(task: PromptTask, sample: Sample) -> float`, sync or async, resolved once when the
config loads. Either kind runs under the same deadline (`--reward-timeout`, per call): an `async def`
is awaited on the event loop, a plain `def` runs on a worker thread (`stages.reward_threads`), so a
slow one never holds the loop, and what it costs when it outlives its deadline is bounded there. A
group's samples are scored at once, each on its own (a plain `def` must therefore be thread-safe).

An exception or a timeout is recorded on the sample, which then counts as failed: its group is
stored as failed and shows in the metrics, never silently dropped. So is a value that is not a
finite number (None, a string, NaN, an infinity): a NaN reward would make the group's advantages,
then the loss, then the weights NaN. A bool, an int or a numpy scalar is a number.

`--reward-max-retries N` calls a reward that raised or timed out again, after a short, growing,
jittered wait (`RetryBackoff`: 0.5 s, 1 s, 2 s ... up to 8 s, each drawn from its upper half), as
slime's retries against a reward service wait: a service that is down for a moment is not hit
again at once by every sample that failed on it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from core.types import Group, PromptTask, Sample, SampleStatus
from stages.admission import Admission, Outcome
from stages.failures import FailureLog, first_traceback
from stages.reward_threads import REWARD_THREADS, CallOutcome, RewardThreads, RewardThreadsBusy
from stages.store_ports import RewardStore

__all__ = ["RetryBackoff", "RewardFn", "RewardStage", "RewardStatistics", "call_reward", "is_async_reward"]

RewardFn = Callable[[PromptTask, Sample], float | Awaitable[float]]


@dataclass(frozen=True, slots=True)
class RewardStatistics:
    scored_samples: int
    failed_samples: int
    retried_calls: int = 0  # reward calls made again after an exception or a timeout


@dataclass(frozen=True, slots=True)
class RetryBackoff:
    """The wait before each retry of a reward: `first` seconds doubling per retry up to `cap`, each
    drawn from the upper half of that (jitter: samples that failed together do not retry together,
    and a wait never shrinks from one retry to the next)."""

    first: float = 0.5
    cap: float = 8.0

    def delay(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before retry number `retry` (0 for the first)."""
        ceiling = min(self.cap, self.first * 2.0**retry)
        return ceiling * (0.5 + 0.5 * rng.random())


def is_async_reward(fn: Callable[..., object]) -> bool:
    """Whether `fn` is an `async def` (a function, a partial of one, or an object whose `__call__` is)."""
    if inspect.iscoroutinefunction(fn):
        return True
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)


async def call_reward(
    fn: RewardFn, task: PromptTask, samples: Sequence[Sample], *, timeout: float, threads: RewardThreads
) -> list[CallOutcome]:
    """What `fn` answers for each of `samples` (one prompt's), each call under a deadline of
    `timeout` seconds: `(True, value)`, or `(False, exception)` (a `TimeoutError` past the
    deadline). An `async def` is awaited here, one sample after another; a plain `def` runs on
    `threads`, the samples one after another on one thread (`RewardThreads.call_each`)."""
    if not is_async_reward(fn):
        outcomes = await threads.call_each(fn, [(task, s) for s in samples], timeout=timeout)
        for i, (ok, value) in enumerate(outcomes):
            if ok and inspect.isawaitable(value):  # a plain def around an async function: awaited here
                outcomes[i] = await _settled(functools.partial(_same, value), timeout)
        return outcomes
    return [await _settled(functools.partial(fn, task, s), timeout) for s in samples]


def _same(value: object) -> object:
    return value


async def _settled(call: Callable[[], object], timeout: float) -> CallOutcome:
    """`call()`'s value, awaited if it is awaitable, under the deadline."""
    try:
        with anyio.fail_after(timeout):
            value = call()
            if inspect.isawaitable(value):
                value = await value
            return True, value
    except Exception as exc:  # the user function's failure, or the deadline's TimeoutError
        return False, exc


class RewardStage:
    def __init__(
        self,
        reward_fn: RewardFn,
        *,
        timeout: float,
        store: RewardStore,
        admission: Admission,
        max_retries: int = 0,
        backoff: RetryBackoff = RetryBackoff(),
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        threads: int = REWARD_THREADS,
    ) -> None:
        self._fn = reward_fn
        self._timeout = timeout
        self._store = store
        self._admission = admission
        self._max_retries = max_retries
        self._backoff = backoff
        self._sleep = sleep  # the wait before a retry (a test records the waits asked for)
        self._rng = random.Random()
        self._threads = RewardThreads(threads)
        self._scored = 0
        self._failed = 0
        self._retried = 0
        self._failures = FailureLog("reward")

    async def run(
        self,
        receive: MemoryObjectReceiveStream[Group],
        send: MemoryObjectSendStream[Group],
        *,
        task_status: TaskStatus[None],
    ) -> None:
        task_status.started()
        try:
            async with receive, send:
                async for group in receive:
                    group = group.with_samples(await self._score(group))
                    if group.failed:
                        self._failures.failed(group)
                        await self._store.put_failed(group)
                        self._admission.settle(Outcome.FAILED, group)
                    else:
                        await send.send(group)
        finally:
            self._threads.close()

    async def _score(self, group: Group) -> list[Sample]:
        """The group's samples, each with its reward or failed. A sample scored in an earlier round
        (before its group was requeued) keeps its reward. One that raised or timed out is called
        again (`--reward-max-retries`, counted in `reward/retries_total`), after a wait that grows
        with each round: a reward that calls a service or a sandbox fails now and then. One that
        returned something that is not a number is not: that is the function's answer, not a flake."""
        samples = list(group.samples)
        todo = [i for i, s in enumerate(samples) if s.reward is None]
        errors: dict[int, Exception] = {}
        for attempt in range(1 + self._max_retries):
            if not todo:
                break
            if attempt:
                self._retried += len(todo)
                await self._sleep(self._backoff.delay(attempt - 1, self._rng))
            outcomes = await call_reward(
                self._fn, group.task, [samples[i] for i in todo], timeout=self._timeout, threads=self._threads
            )
            again = []
            for i, (ok, value) in zip(todo, outcomes, strict=True):
                if not ok:
                    if not isinstance(value, Exception):  # KeyboardInterrupt, SystemExit: not the sample's
                        raise value
                    errors[i] = value
                    again.append(i)
                    continue
                try:
                    samples[i] = samples[i].with_reward(_as_reward(value))
                    self._scored += 1
                except _BadReward as bad:
                    samples[i] = self._failed_sample(samples[i], bad)
            todo = again
        for i in todo:
            samples[i] = self._failed_sample(samples[i], errors[i], tries=1 + self._max_retries)
        return samples

    def _failed_sample(self, sample: Sample, exc: Exception, *, tries: int = 1) -> Sample:
        self._failed += 1
        if isinstance(exc, RewardThreadsBusy):
            reason = f"timed out ({exc})"
        elif isinstance(exc, TimeoutError):
            reason = "timed out"
        elif isinstance(exc, _BadReward):  # our own message says what was returned
            reason = str(exc)
        else:  # a user exception: shown with its type, and its traceback logged the first time
            reason = repr(exc)
            first_traceback("reward", exc)
        if tries > 1:
            reason += f" (each of {tries} tries)"
        return dataclasses.replace(sample, status=SampleStatus.FAILED, error=f"reward: {reason}")

    def statistics(self) -> RewardStatistics:
        return RewardStatistics(self._scored, self._failed, self._retried)


class _BadReward(ValueError):
    """The reward function returned something that is not a finite number."""


def _as_reward(value: object) -> float:
    """`value` as a float, or _BadReward naming it. `float()` alone would take "1.0" and NaN."""
    if value is None or isinstance(value, (str, bytes, bytearray)):
        raise _BadReward(f"the reward function returned {value!r}: a reward is a finite number (float, int or bool)")
    try:
        reward = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise _BadReward(
            f"the reward function returned {value!r}: a reward is a finite number (float, int or bool)"
        ) from None
    if not math.isfinite(reward):
        raise _BadReward(f"the reward function returned {reward}: a reward must be finite")
    return reward

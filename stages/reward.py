"""The reward stage: scores every sample of a finished group with the user's function.

The function is `(task: PromptTask, sample: Sample) -> float`, sync or async, resolved once when the
config loads. An async function runs under a deadline; a sync one runs inline (keep it cheap, or
make it async). An exception or a timeout is recorded on the sample, which then counts as failed:
its group is stored as failed and shows in the metrics, never silently dropped. So is a value that
is not a finite number (None, a string, NaN, an infinity): a NaN reward would make the group's
advantages, then the loss, then the weights NaN. A bool, an int or a numpy scalar is a number.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from core.types import Group, PromptTask, Sample, SampleStatus
from stages.admission import Admission, Outcome
from stages.failures import FailureLog, first_traceback
from stages.store_ports import RewardStore

__all__ = ["RewardFn", "RewardStage", "RewardStatistics"]

RewardFn = Callable[[PromptTask, Sample], float | Awaitable[float]]


@dataclass(frozen=True, slots=True)
class RewardStatistics:
    scored_samples: int
    failed_samples: int
    retried_calls: int = 0  # reward calls made again after an exception or a timeout


class RewardStage:
    def __init__(
        self, reward_fn: RewardFn, *, timeout: float, store: RewardStore, admission: Admission, max_retries: int = 0
    ) -> None:
        self._fn = reward_fn
        self._timeout = timeout
        self._store = store
        self._admission = admission
        self._max_retries = max_retries
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
        async with receive, send:
            async for group in receive:
                samples = []
                for sample in group.samples:
                    scored = self._score(group.task, sample)
                    if not isinstance(scored, Sample):  # an async reward, or a retry: awaited
                        scored = await scored
                    samples.append(scored)
                group = group.with_samples(samples)
                if group.failed:
                    self._failures.failed(group)
                    await self._store.put_failed(group)
                    self._admission.settle(Outcome.FAILED, group)
                else:
                    await send.send(group)

    def _score(self, task: PromptTask, sample: Sample) -> Sample | Awaitable[Sample]:
        """The scored sample, or an awaitable of it (an async reward under its deadline, or a
        retry). A sync reward is scored here, without a coroutine per sample (a plain call is
        most rewards' case)."""
        if sample.reward is not None:  # scored in an earlier round, before its group was requeued
            return sample
        try:
            value = self._fn(task, sample)
            if inspect.isawaitable(value):
                return self._score_later(task, sample, value)
            reward = _as_reward(value)
        except Exception as exc:  # a user function's failure is data, recorded on the sample
            return self._failed_or_retried(task, sample, exc)
        self._scored += 1
        return sample.with_reward(reward)

    async def _score_later(self, task: PromptTask, sample: Sample, pending: Awaitable[object]) -> Sample:
        try:
            with anyio.fail_after(self._timeout):
                value = await pending
            reward = _as_reward(value)
        except Exception as exc:
            out = self._failed_or_retried(task, sample, exc)
            return out if isinstance(out, Sample) else await out
        self._scored += 1
        return sample.with_reward(reward)

    def _failed_or_retried(self, task: PromptTask, sample: Sample, exc: Exception) -> Sample | Awaitable[Sample]:
        # A value that is not a number is the function's answer, not a flake: not called again.
        if self._max_retries and not isinstance(exc, _BadReward):
            return self._retry(task, sample, exc)
        return self._failed_sample(sample, exc)

    async def _retry(self, task: PromptTask, sample: Sample, exc: Exception) -> Sample:
        """Call the reward again, up to `max_retries` times (`--reward-max-retries`, counted in
        `reward/retries_total`): a reward that calls a service or a sandbox fails now and then."""
        for _ in range(self._max_retries):
            self._retried += 1
            try:
                value = self._fn(task, sample)
                if inspect.isawaitable(value):
                    with anyio.fail_after(self._timeout):
                        value = await value
                reward = _as_reward(value)
            except _BadReward as bad:
                return self._failed_sample(sample, bad)
            except Exception as again:
                exc = again
                continue
            self._scored += 1
            return sample.with_reward(reward)
        return self._failed_sample(sample, exc, tries=1 + self._max_retries)

    def _failed_sample(self, sample: Sample, exc: Exception, *, tries: int = 1) -> Sample:
        self._failed += 1
        if isinstance(exc, TimeoutError):
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

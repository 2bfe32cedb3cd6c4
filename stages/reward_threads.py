"""Where a plain `def` reward runs: on worker threads of its own, never on the event loop.

A sync reward called on the loop blocks everything the loop runs (generation, the store, the
trainer's hand-offs) for as long as it takes, and no deadline can interrupt it: a 12 s reward
held a whole step with `--reward-timeout 2`. On a worker thread the loop stays free and each call
gets the deadline an async reward gets: past it, the caller stops waiting and the sample fails.

What a deadline cannot do is stop the thread: Python has no way to kill one. An abandoned call
runs on until the function returns, holding its thread's stack, whatever the function holds
(sockets, files) and, if it computes, a share of the GIL that the loop then lacks. Three rules
bound that cost:

- At most `limit` threads are in calls at once, abandoned calls included: a thread's slot is given
  back when its function returns, not when its caller stops waiting. A reward that hangs on every
  call costs `limit` threads, never one per sample.
- A call waits for a thread only while some thread is in a call that is still within its deadline;
  once every one is stuck past its deadline, a waiting call fails a deadline later
  (`RewardThreadsBusy`, which says so) instead of the stage waiting forever.
- The threads are daemon threads: one stuck in a call never holds up the interpreter's exit (a
  thread of anyio's or `concurrent.futures`' pool would be joined there, forever).

One hand-off per group, not per sample: `call_each` runs a group's calls one after another on one
thread, and the thread wakes the loop once, when the last returns. Each call still has its own
deadline, counted from its own start: the loop sleeps until the running call's deadline, and if
that call is still running then, it is abandoned and the calls after it go to another thread. (A
hand-off costs about 40 us of CPU, thread wake-up and loop wake-up; one per sample was 13-25% of
the controller's CPU per sample in the local mode.) The calls of one group never overlap, as when
they ran on the loop; only an abandoned call can overlap the next.

Why threads and not processes: a process can be killed at the deadline, but each call would pickle
the sample (its token columns) and the task, the function would be imported again in each worker
(with its own caches and loaded verifiers), and a reward that keeps state in its module would see
another copy of it. A reward that needs isolation (a library that is not thread-safe, CPU-bound
scoring that should not share the GIL with the loop) is an `async def` that hands the work to a
process pool of its own; it then runs on the loop, under the same deadline.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

__all__ = ["REWARD_THREADS", "CallOutcome", "RewardThreads", "RewardThreadsBusy"]

# Threads in calls at once, per stage (slime's newer code runs 16 reward workers by default).
REWARD_THREADS = 16

# A call's result: (True, what it returned) or (False, what it raised, or the TimeoutError of its deadline).
CallOutcome = tuple[bool, Any]


class RewardThreadsBusy(TimeoutError):
    """The call never started: every thread was (and stayed, for a deadline's length) in a call
    past its own deadline."""


@dataclass(slots=True, eq=False)
class _Job:
    """Calls for one thread to make in turn; the loop and the thread share it under `lock`."""

    fn: Callable[..., Any]
    calls: Sequence[tuple[Any, ...]]
    loop: asyncio.AbstractEventLoop
    release: Callable[[], None]  # the job's slot, given back on the loop when the thread is through
    finished: anyio.Event = field(default_factory=anyio.Event)
    outcomes: list[CallOutcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    current: int = 0  # the call running (or about to)
    started: float = field(default_factory=time.monotonic)  # its start (before the first: the hand-over)
    cut: int | None = None  # set by the loop: the call it abandoned; the thread makes no more calls
    over: bool = False  # the thread is through with the job


class RewardThreads:
    """Daemon threads that make calls for the event loop, at most `limit` of them in calls at once.

    Threads start as calls need them and stay for the next ones until `close`. Use from one event
    loop; `close` when done (a thread still in a call exits once the call returns)."""

    def __init__(self, limit: int = REWARD_THREADS) -> None:
        if limit < 1:
            raise ValueError(f"RewardThreads limit={limit}: must be >= 1")
        self.limit = limit
        self._slots = anyio.CapacityLimiter(limit)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = 0  # started and not told to stop (only the loop's thread changes it)
        self.abandoned = 0  # threads in a call past its deadline, which nobody waits for any more
        self._closed = False

    @property
    def busy(self) -> int:
        """Threads in calls (or about to be), abandoned ones included."""
        return int(self._slots.borrowed_tokens)

    async def call_each(
        self, fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], *, timeout: float
    ) -> list[CallOutcome]:
        """`fn(*args)` for each `args` of `calls`, in turn, each under a deadline of `timeout`
        seconds from its own start: one outcome per call, in order. A call past its deadline is
        abandoned (its thread runs on) and the calls after it go to another thread. Cancelling
        the caller abandons the call running."""
        if self._closed:
            raise RuntimeError("RewardThreads is closed")
        outcomes: list[CallOutcome] = []
        while len(outcomes) < len(calls):
            job = await self._hand_over(fn, calls[len(outcomes) :], timeout)
            if job is None:
                busy = RewardThreadsBusy(
                    f"no reward thread free: all {self.limit} are in calls past their deadline (a plain def "
                    "reward runs on worker threads, and a call that outlives its deadline keeps its thread)"
                )
                outcomes.extend((False, busy) for _ in range(len(calls) - len(outcomes)))
                break
            outcomes.extend(await self._wait(job, timeout))
        return outcomes

    def close(self) -> None:
        """Let every thread exit: idle ones now, one still in a call when the call returns."""
        if self._closed:
            return
        self._closed = True
        for _ in range(self._threads):
            self._jobs.put(None)
        self._threads = 0

    async def _hand_over(self, fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], timeout: float) -> _Job | None:
        """A job for `calls`, given to a thread; None if every thread stayed stuck past its deadline."""
        borrower = object()
        while True:
            # A thread in a call within its deadline will be free (or abandoned) within one deadline.
            with anyio.move_on_after(timeout) as waiting:
                await self._slots.acquire_on_behalf_of(borrower)
            if not waiting.cancelled_caught:
                break
            if self.abandoned >= self.limit:
                return None

        def release() -> None:
            self._slots.release_on_behalf_of(borrower)
            if job.cut is not None:
                self.abandoned -= 1
            job.finished.set()

        job = _Job(fn, calls, asyncio.get_running_loop(), release)
        if self._threads < self.busy:  # every job holding a slot has a thread to run on
            self._threads += 1
            threading.Thread(target=self._work, name="reward", daemon=True).start()
        self._jobs.put(job)
        return job

    async def _wait(self, job: _Job, timeout: float) -> list[CallOutcome]:
        """The job's outcomes: all of them, or those before the call that passed its deadline and
        that call's `TimeoutError` (the rest are the caller's to hand over again)."""
        try:
            while True:
                with job.lock:
                    if job.over:
                        return job.outcomes
                    left = job.started + timeout - time.monotonic()
                with anyio.move_on_after(max(left, 0.0)):
                    await job.finished.wait()
                with job.lock:
                    if job.over:
                        return job.outcomes
                    if time.monotonic() >= job.started + timeout:  # else a later call runs: its deadline
                        self._abandon(job)
                        return [*job.outcomes[: job.current], (False, TimeoutError())]
        except BaseException:  # cancelled: nobody waits for the call running
            with job.lock:
                if not job.over and job.cut is None:
                    self._abandon(job)
            raise

    def _abandon(self, job: _Job) -> None:
        job.cut = job.current
        self.abandoned += 1

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            for i, args in enumerate(job.calls):
                with job.lock:
                    if job.cut is not None:
                        break
                    job.current, job.started = i, time.monotonic()
                try:
                    outcome: CallOutcome = (True, job.fn(*args))
                except BaseException as exc:  # the caller's to judge
                    outcome = (False, exc)
                job.outcomes.append(outcome)
                del outcome
            with job.lock:
                job.over = True
            try:
                job.loop.call_soon_threadsafe(job.release)
            except RuntimeError:  # the loop is closed: the run is over, nobody waits for this
                pass
            del job  # not kept alive while this thread waits for the next

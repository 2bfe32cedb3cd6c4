"""`AsyncStore`: the `Store` methods as `async def`, for stages running on the event loop.

An LMDB transaction can wait on a disk (fsync), so `AsyncStore` runs every call of a blocking store
in a worker thread, one call at a time (a `CapacityLimiter(1)`): the store sees a single writer,
and its transactions never overlap. The memory store never blocks, so its calls run inline.

Cancellation: a call that has started runs to the end. The worker thread is never abandoned (a
transaction half-seen by its caller would lose work, e.g. groups claimed but never received), and
the cancellation is delivered at the caller's next checkpoint. A call cancelled before it starts
does nothing. A cancel scope cannot reach a running call (anyio shields it) and delivers its
cancellation again at the caller's next checkpoint; `Task.cancel()` from outside any scope (how a
SIGTERM stops the run: `pipeline.run.end.StopOnSigterm`) passes through every shield and is
delivered once, so the caller waits for its call's thread, still holding the writer's turn, and
then re-raises it (`_ThreadCall`): cancellation stays cancellation, never a store error.

Group commit: a store with `run_grouped` (the LMDB store) gets the calls that queue up while its
previous transaction commits as one batch, run in one transaction with one fsync
(`_GroupWriter`). Each caller still gets its own result or its own error, and its await returns
only once the transaction holding its call is committed (synced, when the store syncs). There is
no writer task to start or stop: whichever waiting caller finds the store idle drives the next
batch, and hands the turn on when it is done (or cancelled while queued).

Lease arguments are passed on only when given, so a store written against the older signatures
(`admit(groups, cursor)`, `put_ready(group)`) keeps working behind `AsyncStore`.
"""

from __future__ import annotations

import enum
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard, TypeVar, runtime_checkable

import anyio
import anyio.lowlevel
import anyio.to_thread

from core.errors import CorruptRecordError, StoreError
from core.types import Batch, Group

from .history import PromptHistory
from .memory import MemoryStore
from .protocol import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_OWNER,
    Coverage,
    Cursor,
    GroupState,
    Lease,
    RecoveryReport,
    RunMeta,
    Store,
    StoreStatistics,
)

__all__ = ["AsyncStore", "GroupCommitStatistics"]

T = TypeVar("T")

_CLOSE_DEADLINE_S = 30.0


@dataclass(frozen=True, slots=True)
class GroupCommitStatistics:
    """How well group commit groups: `calls` store calls went out in `groups` batches (a batch of
    one call is a transaction of its own), the largest holding `largest` calls."""

    groups: int
    calls: int
    largest: int


class _Stage(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


class _Call:
    """One call waiting for, or in, a group."""

    __slots__ = ("error", "fn", "stage", "value", "wake")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.stage = _Stage.QUEUED
        self.value: Any = None
        self.error: Exception | None = None
        self.wake: anyio.Event | None = None


class _ThreadCall:
    """One blocking call on a worker thread, run to its end whatever cancels its caller.

    anyio shields a worker-thread call from cancel scopes, but a `Task.cancel()` from outside them
    (a SIGTERM's, `pipeline.run.end`) passes through: the await ends at once while the thread runs
    on, and the limiter is given back, so the next call (or the store's close) would run beside a
    transaction still open. Here the caller keeps the limiter until the thread has ended, then gets
    the cancellation back to re-raise, with the call's outcome in `value`/`error`.
    """

    __slots__ = ("_ended", "error", "fn", "value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.value: Any = None
        self.error: Exception | None = None
        self._ended = threading.Event()

    def _run(self) -> None:  # on the worker thread
        try:
            self.value = self.fn()
        except Exception as exc:
            self.error = exc
        finally:
            self._ended.set()

    async def run(self, limiter: anyio.CapacityLimiter) -> BaseException | None:
        """Run the call holding `limiter`; the cancellation that arrived while it ran (None if none).
        Cancelled while waiting for the limiter, it raises and the call never runs."""
        async with limiter:
            try:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self._run)
                return None
            except anyio.get_cancelled_exc_class() as exc:
                cancelled = exc
            # The thread runs on: wait for it on another one (no event-loop callback from a thread
            # that may outlive the loop), through any further Task.cancel().
            while not self._ended.is_set():
                try:
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(self._ended.wait)
                except anyio.get_cancelled_exc_class():
                    continue
            return cancelled


def _delivered_again() -> bool:
    """Whether a cancel scope around the caller is cancelled (or past its deadline): it delivers the
    cancellation again at the caller's next checkpoint. A `Task.cancel()` is delivered only once."""
    return anyio.current_effective_deadline() <= anyio.current_time()


class _GroupWriter:
    """Batches the calls queued while a group commits into the next group (see the module docstring)."""

    def __init__(
        self,
        run_grouped: Callable[[list[Callable[[], Any]]], list[tuple[Any, Exception | None]]],
        limiter: anyio.CapacityLimiter,
    ) -> None:
        self._run_grouped = run_grouped
        self._limiter = limiter
        self._queue: list[_Call] = []
        self._running = False
        self.groups = 0  # batches run (each one transaction when it holds more than one call)
        self.calls = 0
        self.largest = 0

    async def call(self, fn: Callable[[], T]) -> T:
        call = _Call(fn)
        self._queue.append(call)
        try:
            while call.stage is not _Stage.DONE:
                if call.stage is _Stage.QUEUED and not self._running:
                    await self._drive()
                else:
                    call.wake = anyio.Event()
                    await call.wake.wait()
        except anyio.get_cancelled_exc_class():
            if call.stage is _Stage.QUEUED:  # never started: it does nothing
                self._queue.remove(call)
                self._hand_on()
                raise
            # Started: it runs to the end and its caller gets the outcome, as a worker-thread call
            # would; the caller's cancel scope delivers the cancellation again at its next checkpoint.
            with anyio.CancelScope(shield=True):
                while call.stage is not _Stage.DONE:
                    call.wake = anyio.Event()
                    await call.wake.wait()
            if not _delivered_again():  # a Task.cancel(): nothing would deliver it again
                raise
        if call.error is not None:
            raise call.error
        return call.value  # type: ignore[no-any-return]

    async def _drive(self) -> None:
        """Run everything queued now as one group, then wake its callers and the next queued one."""
        batch, self._queue = self._queue, []
        for call in batch:
            call.stage = _Stage.RUNNING
        self._running = True
        group = _ThreadCall(functools.partial(self._run_grouped, [c.fn for c in batch]))
        try:
            with anyio.CancelScope(shield=True):  # a started group is never abandoned
                cancelled = await group.run(self._limiter)
        except anyio.get_cancelled_exc_class():  # a Task.cancel() before it started: it never ran
            for call in batch:
                call.stage = _Stage.QUEUED
            self._queue[:0] = batch
            self._running = False
            raise
        self.groups += 1
        self.calls += len(batch)
        self.largest = max(self.largest, len(batch))
        if group.error is not None:  # the group as a whole failed (not one call): each caller hears it
            self._settle(batch, [(None, group.error)] * len(batch))
        else:
            self._settle(batch, group.value)
        if cancelled is not None:  # the callers have their outcomes; this one is cancelled
            raise cancelled

    def _settle(self, batch: list[_Call], outcomes: list[tuple[Any, Exception | None]]) -> None:
        self._running = False
        for call, (value, error) in zip(batch, outcomes, strict=True):
            call.value, call.error, call.stage = value, error, _Stage.DONE
            if call.wake is not None:
                call.wake.set()
        self._hand_on()

    def _hand_on(self) -> None:
        if self._queue and not self._running and (head := self._queue[0]).wake is not None:
            head.wake.set()


class AsyncStore:
    """A `Store` for async code: every call runs on one worker thread, so the store stays single-writer
    and the event loop never blocks on a transaction."""

    def __init__(self, store: Store, *, group_commit: bool = True) -> None:
        """`group_commit=False` runs one call per transaction even on a store that can group them."""
        self._store = store
        self._inline = isinstance(store, MemoryStore)
        self._limiter = anyio.CapacityLimiter(1)
        self._writer = (
            _GroupWriter(store.run_grouped, self._limiter)
            if group_commit and _groups_commits(store) and not self._inline
            else None
        )

    @property
    def store(self) -> Store:
        """The synchronous store underneath (for code that already runs off the event loop)."""
        return self._store

    async def _call(self, fn: Callable[..., T], *args: object, **kwargs: Any) -> T:
        if kwargs:
            return await self._call(lambda: fn(*args, **kwargs))
        if self._inline:
            # A checkpoint before, never after: a caller cancelled here loses nothing.
            await anyio.lowlevel.checkpoint()
            return fn(*args)
        if self._writer is not None:
            return await self._writer.call(functools.partial(fn, *args))
        call = _ThreadCall(functools.partial(fn, *args))
        cancelled = await call.run(self._limiter)
        if cancelled is not None and not _delivered_again():
            raise cancelled
        if call.error is not None:
            raise call.error
        return call.value  # type: ignore[no-any-return]

    async def read_meta(self) -> RunMeta | None:
        return await self._call(self._store.read_meta)

    async def write_meta(self, meta: RunMeta) -> None:
        await self._call(self._store.write_meta, meta)

    async def cursor(self) -> Cursor:
        return await self._call(self._store.cursor)

    async def admit(
        self,
        groups: Sequence[Group],
        cursor: Cursor,
        *,
        skipped: Sequence[Group] = (),
        owner: str | None = None,
        lease_seconds: float | None = None,
    ) -> None:
        # `skipped` only when there are some: a store written before skips takes no such keyword.
        given = _given(owner=owner, lease_seconds=lease_seconds, skipped=tuple(skipped) or None)
        await self._call(self._store.admit, groups, cursor, **given)

    async def prompt_history(self, indexes: Sequence[int]) -> dict[int, PromptHistory]:
        """The stored history of each of these dataset rows that has one (`Store.prompt_history`)."""
        return await self._call(self._store.prompt_history, indexes)

    async def claim_partial(
        self, limit: int, *, owner: str | None = None, lease_seconds: float | None = None
    ) -> list[Group]:
        if self._writer is not None and owner is None and lease_seconds is None and self._nothing_partial():
            # The dispenser asks before every new group and there is usually nothing to resume:
            # answer from the committed counters instead of a round trip to the writer thread.
            # A put_partial still in flight is concurrent with this call, so either order is right.
            await anyio.lowlevel.checkpoint()
            return []
        return await self._call(self._store.claim_partial, limit, **_given(owner=owner, lease_seconds=lease_seconds))

    def _nothing_partial(self) -> bool:
        # `statistics()` of a writing store reads its committed counters (never a group in flight).
        return self._store.statistics().counts[GroupState.PARTIAL] == 0

    async def put_partial(self, group: Group, *, owner: str | None = None) -> None:
        await self._call(self._store.put_partial, group, **_given(owner=owner))

    async def put_ready(self, group: Group, *, owner: str | None = None) -> None:
        await self._call(self._store.put_ready, group, **_given(owner=owner))

    async def put_rejected(self, group: Group, *, owner: str | None = None) -> None:
        await self._call(self._store.put_rejected, group, **_given(owner=owner))

    async def put_failed(self, group: Group, *, owner: str | None = None) -> None:
        await self._call(self._store.put_failed, group, **_given(owner=owner))

    async def put_ready_groups(self, groups: Sequence[Group], *, owner: str | None = None) -> None:
        """Many groups READY in one store call (one transaction): what the collector found waiting."""
        if groups:
            store = self._store
            fn = store.put_ready_groups if isinstance(store, _PutsReadyGroups) else _one_by_one(store.put_ready)
            await self._call(fn, groups, **_given(owner=owner))

    async def put_rejected_groups(self, groups: Sequence[Group], *, owner: str | None = None) -> None:
        """Many groups REJECTED in one store call (one transaction): what the filter turned down together."""
        if groups:
            store = self._store
            fn = (
                store.put_rejected_groups if isinstance(store, _PutsRejectedGroups) else _one_by_one(store.put_rejected)
            )
            await self._call(fn, groups, **_given(owner=owner))

    async def lease(self, group_id: str) -> Lease | None:
        return await self._call(self._store.lease, group_id)

    async def renew_leases(self, owner: str, lease_seconds: float) -> int:
        return await self._call(self._store.renew_leases, owner, lease_seconds)

    async def hand_over(self, group_id: str, *, owner: str, to: str, lease_seconds: float) -> None:
        await self._call(self._store.hand_over, group_id, owner=owner, to=to, lease_seconds=lease_seconds)

    async def hand_over_groups(self, group_ids: Sequence[str], *, owner: str, to: str, lease_seconds: float) -> None:
        """Many leases moved in one store call (one transaction): the groups handed to a producer together."""
        if group_ids:
            store = self._store
            fn = store.hand_over_groups if isinstance(store, _HandsOverGroups) else _one_by_one(store.hand_over)
            await self._call(fn, group_ids, owner=owner, to=to, lease_seconds=lease_seconds)

    async def accept_results(
        self,
        owner: str,
        results: Sequence[tuple[GroupState, Group]],
        *,
        to: str | None = None,
        lease_seconds: float | None = None,
    ) -> dict[str, str]:
        """A producer's results in one store call (one transaction), each fenced on its own;
        returns {group id: why} of those refused. A store without `accept_results` gets the single
        moves one by one in one worker call (a transaction each: a crash between them leaves the
        rest RUNNING under the producer's lease, which expires and requeues them)."""
        if not results:
            return {}
        store = self._store
        fn = (
            store.accept_results
            if isinstance(store, _AcceptsResults)
            else functools.partial(_results_one_by_one, store)
        )
        return await self._call(fn, owner, results, **_given(to=to, lease_seconds=lease_seconds))

    async def reclaim_expired(self, now: float | None = None) -> int:
        return await self._call(self._store.reclaim_expired, now)

    async def collect_garbage(self, up_to_step: int) -> int:
        return await self._call(self._store.collect_garbage, up_to_step)

    async def take_batch(self, step: int, size: int) -> Batch | None:
        return await self._call(self._store.take_batch, step, size)

    async def finish_batch(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        await self._call(self._store.finish_batch, step, metrics)

    async def step_metrics(self, first: int = 0) -> dict[int, dict[str, Any]]:
        return await self._call(self._store.step_metrics, first)

    async def trained_step(self) -> int:
        return await self._call(self._store.trained_step)

    async def recover(self) -> RecoveryReport:
        return await self._call(self._store.recover)

    async def count(self, state: GroupState) -> int:
        return await self._call(self._store.count, state)

    async def get(self, group_id: str) -> tuple[GroupState, Group] | None:
        return await self._call(self._store.get, group_id)

    async def groups(self, state: GroupState) -> list[Group]:
        """A snapshot list (an iterator would read the store lazily from the event loop)."""
        return await self._call(lambda: list(self._store.groups(state)))

    async def batch(self, step: int, *, damaged: list[CorruptRecordError] | None = None) -> Batch | None:
        return await self._call(self._store.batch, step, damaged=damaged)

    async def damaged_in_batch(self, step: int) -> list[tuple[str, CorruptRecordError]] | None:
        return await self._call(self._store.damaged_in_batch, step)

    async def coverage(self, step: int) -> Coverage:
        return await self._call(self._store.coverage, step)

    def statistics(self) -> StoreStatistics:
        """Synchronous: a writing store answers from memory, without a transaction."""
        return self._store.statistics()

    def group_commit_statistics(self) -> GroupCommitStatistics | None:
        """None when calls are not grouped (a memory store, or `group_commit=False`)."""
        w = self._writer
        return None if w is None else GroupCommitStatistics(w.groups, w.calls, w.largest)

    async def aclose(self) -> None:
        """Closes the store after any call in flight; runs even if the caller is being cancelled."""
        with anyio.move_on_after(_CLOSE_DEADLINE_S, shield=True):
            if self._writer is None:
                await self._call(self._store.close)
            else:  # never inside a group: it waits for the group in flight (the same limiter)
                close = _ThreadCall(self._store.close)
                cancelled = await close.run(self._limiter)
                if cancelled is not None:
                    raise cancelled
                if close.error is not None:
                    raise close.error

    async def __aenter__(self) -> AsyncStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _results_one_by_one(
    store: Store,
    owner: str,
    results: Sequence[tuple[GroupState, Group]],
    *,
    to: str = DEFAULT_OWNER,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
) -> dict[str, str]:
    """`accept_results` from a store's single moves, each fenced by the store as it refuses it."""
    refused: dict[str, str] = {}
    for state, group in results:
        try:
            if state is GroupState.RUNNING:
                store.hand_over(group.group_id, owner=owner, to=to, lease_seconds=lease_seconds)
            else:
                _PUT_BY_STATE[state](store)(group, owner=owner)
        except StoreError as exc:
            refused[group.group_id] = str(exc)
    return refused


_PUT_BY_STATE: dict[GroupState, Callable[[Store], Callable[..., None]]] = {
    GroupState.PARTIAL: lambda store: store.put_partial,
    GroupState.READY: lambda store: store.put_ready,
    GroupState.REJECTED: lambda store: store.put_rejected,
    GroupState.FAILED: lambda store: store.put_failed,
}


def _one_by_one(one: Callable[..., None]) -> Callable[..., None]:
    """A batched move from a store's single move, once per group (or group id) in one worker call,
    for a store written before the batched moves existed: a transaction each, so a crash between
    them leaves the rest RUNNING, which recovery or lease expiry requeues (exactly-once holds;
    only the one-transaction batch is lost)."""

    def each(items: Sequence[Any], **kwargs: Any) -> None:
        for item in items:
            one(item, **kwargs)

    return each


# The `Store` protocol has all of the moves below; a store written before one existed lacks it, and
# `AsyncStore` then falls back to the single moves. Each is its own declared capability, checked
# with `isinstance`, never probed by name.


@runtime_checkable
class _GroupsCommits(Protocol):
    """A store that runs several calls in one transaction (the LMDB store): group commit."""

    def run_grouped(self, calls: Sequence[Callable[[], Any]]) -> list[tuple[Any, Exception | None]]: ...


def _groups_commits(store: object) -> TypeGuard[_GroupsCommits]:
    # Checked on the class: a wrapper that forwards every attribute is not a grouping store.
    return issubclass(type(store), _GroupsCommits)


@runtime_checkable
class _PutsReadyGroups(Protocol):
    def put_ready_groups(self, groups: Sequence[Group], *, owner: str | None = None) -> None: ...


@runtime_checkable
class _PutsRejectedGroups(Protocol):
    def put_rejected_groups(self, groups: Sequence[Group], *, owner: str | None = None) -> None: ...


@runtime_checkable
class _HandsOverGroups(Protocol):
    def hand_over_groups(self, group_ids: Sequence[str], *, owner: str, to: str, lease_seconds: float) -> None: ...


@runtime_checkable
class _AcceptsResults(Protocol):
    def accept_results(
        self,
        owner: str,
        results: Sequence[tuple[GroupState, Group]],
        *,
        to: str = DEFAULT_OWNER,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> dict[str, str]: ...


def _given(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}

"""`--rollout-producers ray`: the generator pool, reward and filter in one Ray actor per node, leasing
work from the controller's store (issue 13).

    dispenser ─► RayProducers ──hand_over(controller → p)──► [mailbox] ──► actor p: pool ─► reward ─► filter
                     ▲                                                                │
                     └── commit under p's lease (fenced) ◄── [mailbox] ◄── results ───┘
                                                                heartbeats renew p's leases

The controller stays the single store writer and the single version clock; this is the
`stages.producers.Producers` the graph hands groups to. The rules that keep work exactly-once:

- A group handed to producer p is leased to p (`Store.hand_over_groups`), expiring `lease_seconds` after
  p's last answered heartbeat (`renew_leases`). A producer that dies or stops answering is lost:
  it gets no more work, is killed, and its leases end at once (or, had that failed, expire);
  `reclaim_expired` puts its groups back as PARTIAL with every prefix it had returned, and the
  dispenser serves them again.
- Results are fenced: each is committed with `owner=p` (a `put_*`, or its lease handed back to
  the controller for an accepted group that the collector then makes ready), so a late result
  from a producer whose lease expired or was reassigned is refused by the store, counted
  (`producers/fenced_results`) and dropped, never trained twice; so is any result of a producer
  already given up on, refused by the controller before the store has taken its leases back. A batch of results is one
  `Store.accept_results` (one transaction): the store fences each group on its own, so one
  refused group never holds back the others, and a crash mid-batch stores none of it.
- Every call to a producer has a deadline (`deadline_seconds`); one that passes it is lost, never
  waited on forever. A publish closes every producer's admission (abort mode: every group in hand
  with a token generated comes back as partial; one not started stays) before the engines pause,
  and tells them the new version after.

Where the cost hides: a Ray actor call costs the driver about a millisecond of CPU, far more than
handling a group, so calls carry batches, as group commit does for the store. The dispatcher
leases each producer its share of every group already waiting in one store call. Through the
producers' mailbox (`launch.ray_mailbox`, the default) one Ray call at a time posts every
producer's share, and one takes back everything every producer has delivered, at most
`takes_per_second` times a second (the store's group commit makes the producers' commits of one
take one transaction): the controller's calls do not grow with the producers, and the busier the
run, the more each carries (BENCHMARKS.md section 11). Without it (`mailbox=None`) the calls go to
each producer, which suits one or two, whose slow answers batch their calls by themselves. Each
call is bounded by `store_batch` and never waits for more to arrive; heartbeats, stops and
publishes go to each producer (once a step or a few times a lease, not once a group).

Groups cross as `storage.codec` bytes; the actor side is `launch.ray_producer.ProducerCore`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson
import structlog
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from core.errors import PipelineError
from core.types import Group, PauseMode
from launch.ray_producer import ResultKind
from stages.admission import Admission, Outcome
from stages.filter import FilterStatistics
from stages.generator import GeneratorStatistics
from stages.publisher import AdmissionGates
from stages.streams import drain_nowait
from storage import DEFAULT_OWNER, AsyncStore, GroupState
from storage.codec import decode_group, encode_group

__all__ = ["ProducerHandle", "RayProducers"]

log = structlog.get_logger("producers")

RESULTS_PER_CALL = 64  # the least a Ray call takes back when there is that much waiting
# A Ray call costs the controller about 1 ms of CPU whatever it carries (BENCHMARKS.md section 11):
# taking results back at most this often in all caps that at about a tenth of a core, so a busier
# run's calls carry more groups, not more calls; a result waits at most 10 ms (W x 10 ms without
# the mailbox) longer, nothing beside generations that take seconds.
DEFAULT_TAKES_PER_SECOND = 100.0
# How each kind of result is committed: an accepted group's lease comes back (it stays RUNNING
# until the collector makes it ready); the others are stored as they are.
_COMMIT_AS = {
    ResultKind.ACCEPTED: GroupState.RUNNING,
    ResultKind.PARTIAL: GroupState.PARTIAL,
    ResultKind.FAILED: GroupState.FAILED,
    ResultKind.REJECTED: GroupState.REJECTED,
}
_OUTCOME = {
    ResultKind.PARTIAL: Outcome.PARTIAL,
    ResultKind.FAILED: Outcome.FAILED,
    ResultKind.REJECTED: Outcome.REJECTED,
}
_AT_ONCE = 1e-6  # seconds: a lease renewed for this long has expired by the next reclaim


@dataclass(slots=True, eq=False)
class ProducerHandle:
    """One producer actor as the controller knows it."""

    name: str
    actor: Any  # a Ray actor handle (launch.ray_cluster.ProducerActor)
    node: str
    group_slots: int
    in_hand: set[str] = field(default_factory=set)  # group ids leased to it, not yet settled
    handed: int = 0  # groups handed to it over the run
    lost: str | None = None  # why it was given up on
    # Groups it held when given up on, less those whose results were already being committed:
    # each of them is settled once, by the reclaim (`reclaimed`) or as a fenced result (`fenced`).
    given_up: int = 0
    stats: dict[str, Any] = field(default_factory=dict)  # its last heartbeat's answer
    outbox: list[bytes] = field(default_factory=list)  # leased to it, waiting for the Ray call in flight
    sending: bool = False  # a submit call to it is in flight


class RayProducers:
    """The `Producers` of a run whose producers are Ray actors (see the module docstring)."""

    def __init__(
        self,
        producers: Sequence[ProducerHandle],
        *,
        admission: Admission,
        store: AsyncStore,
        n_samples: int,
        lease_seconds: float,
        deadline_seconds: float,
        overlap_publish: bool = False,
        kill: Any = None,
        store_batch: int = 64,
        takes_per_second: float = DEFAULT_TAKES_PER_SECOND,
        mailbox: Any = None,
    ) -> None:
        """`store_batch`: the most groups handed out, or results committed, in one store call.
        `takes_per_second`: how often, at most, the controller takes results back from all its
        producers together (math.inf: as soon as each has one). `mailbox`: the producers' mailbox
        actor (`launch.ray_mailbox`), through which groups go out and results come back in one call
        each way for all producers; None: calls to each producer."""
        if not producers:
            raise PipelineError("no producer to run: Ray found no eligible node")
        if store_batch < 1:
            raise ValueError(f"RayProducers store_batch={store_batch!r}: must be at least 1")
        if not takes_per_second > 0:
            raise ValueError(f"RayProducers takes_per_second={takes_per_second!r}: must be above 0")
        self._takes_per_second = takes_per_second
        self._batch = store_batch
        self._take = max(RESULTS_PER_CALL, store_batch)
        self.producers = list(producers)
        self._admission = admission
        self._store = store
        self._n_samples = n_samples
        self._lease = lease_seconds
        self._deadline = deadline_seconds
        self._overlap = overlap_publish
        self._kill = kill  # ray.kill; given so this module never imports Ray at the top
        self._mailbox = mailbox
        self._posting = False  # a post to the mailbox is in flight
        self._stopping = False
        self._room = anyio.Event()
        self._committing: set[str] = set()
        self._resuming: list[Any] = []
        self._counts = dict(fenced=0, reclaimed=0, accepted=0)
        # Ray calls that carry groups, and the groups they carried: the batches' mean size.
        self._calls = dict(submit=0, submitted=0, take=0, taken=0)
        self._tg: TaskGroup | None = None  # the run's, for work started by a loss

    # -- the graph's side -----------------------------------------------------------------------
    async def run(
        self,
        receive: MemoryObjectReceiveStream[Group],
        send: MemoryObjectSendStream[Group],
        *,
        task_status: TaskStatus[None],
    ) -> None:
        # The dispenser hands over with no buffer, one group at a time; this buffer holds what it
        # has already admitted, so the dispatcher can hand it all to a producer in one call.
        waiting_send, waiting = anyio.create_memory_object_stream[Group](self._batch)
        try:
            async with receive, send, waiting, anyio.create_task_group() as tg:
                self._tg = tg
                if self._mailbox is not None:
                    tg.start_soon(self._take_from_mailbox, send.clone())
                for p in self.producers:
                    if self._mailbox is None:
                        tg.start_soon(self._receive_results, p, send.clone())
                    tg.start_soon(self._heartbeats, p)
                tg.start_soon(self._reap)
                tg.start_soon(_forward, receive, waiting_send)
                task_status.started()
                async for group in waiting:
                    await self._dispatch(group, waiting, tg)
                tg.cancel_scope.cancel()
        finally:
            # A publish still under way as the run stops may lose a producer after this: its leases
            # are left to expire (a start_soon here would raise over the error that stopped the run).
            self._tg = None

    @property
    def mailbox(self) -> Any:
        """The producers' mailbox actor, or None when calls go to each producer."""
        return self._mailbox

    @property
    def idle_slots(self) -> int:
        free = sum(max(0, p.group_slots - len(p.in_hand)) for p in self._live())
        return free * self._n_samples

    async def wait_slot_freed(self) -> None:
        await self._room.wait()

    async def stop(self) -> None:
        """Groups not yet handed out go back to the store; every producer aborts and returns the rest."""
        self._stopping = True
        self._notify()
        await self._each("stop")

    def resume(self) -> None:
        self._stopping = False
        self._resuming = [(p, p.actor.resume.remote()) for p in self._live()]
        self._notify()

    @property
    def gates(self) -> AdmissionGates | None:
        return _PublishGates(self)

    def statistics(self) -> GeneratorStatistics:
        fields = GeneratorStatistics.__dataclass_fields__
        total = {name: 0 for name in fields}
        for p in self.producers:
            for name, value in p.stats.get("generator", {}).items():
                total[name] = total.get(name, 0) + value
        total["slots"] = sum(p.group_slots for p in self.producers) * self._n_samples
        return GeneratorStatistics(**{name: total[name] for name in fields})

    def filter_statistics(self) -> FilterStatistics:
        rejected: dict[str, int] = {}
        for p in self.producers:
            for reason, n in p.stats.get("rejected", {}).items():
                rejected[reason] = rejected.get(reason, 0) + n
        return FilterStatistics(self._counts["accepted"], rejected)

    def metrics(self) -> dict[str, float]:
        return {
            "producers/live": len(self._live()),
            "producers/lost": len(self.producers) - len(self._live()),
            "producers/fenced_results": self._counts["fenced"],
            "producers/reclaimed_groups": self._counts["reclaimed"],
            # Groups per Ray call each way: 1 at light load, growing with load (the module docstring).
            "producers/groups_per_submit": self._calls["submitted"] / max(self._calls["submit"], 1),
            "producers/results_per_take": self._calls["taken"] / max(self._calls["take"], 1),
        }

    # -- handing groups out ---------------------------------------------------------------------
    async def _dispatch(self, group: Group, waiting: MemoryObjectReceiveStream[Group], tg: TaskGroup) -> None:
        """Hand `group`, and the groups waiting behind it, to the least loaded producer."""
        while True:
            if self._stopping:
                # The round is over: the group goes back untouched, first in line next round.
                await self._store.put_partial(group)
                self._admission.settle(Outcome.PARTIAL)
                return
            await self._wait_resumed()
            candidates = [p for p in self._live() if len(p.in_hand) <= p.group_slots]
            if candidates:
                break
            if not self._live():
                raise PipelineError(f"every Ray producer is lost: {self._why_lost()}")
            await self._room.wait()
        # With it, whatever is already waiting, as far as the producers have room (each holds
        # group_slots + 1 at most), spread as one at a time would spread it: each group to the least
        # loaded for its size, then the one that got least so far. One store call and one Ray call
        # per producer that gets any.
        room = sum(c.group_slots + 1 - len(c.in_hand) for c in candidates)
        batch = [group, *drain_nowait(waiting, min(self._batch, room) - 1)]
        load = {c.name: (len(c.in_hand), c.handed) for c in candidates}
        shares: dict[str, list[Group]] = {}
        for g in batch:
            p = min(
                (c for c in candidates if load[c.name][0] <= c.group_slots),
                key=lambda c: (load[c.name][0] / c.group_slots, load[c.name][1], c.name),
            )
            shares.setdefault(p.name, []).append(g)
            held, handed = load[p.name]
            load[p.name] = (held + 1, handed + 1)
        for p in candidates:
            if (share := shares.get(p.name)) is not None:
                ids = [g.group_id for g in share]
                await self._store.hand_over_groups(ids, owner=DEFAULT_OWNER, to=p.name, lease_seconds=self._lease)
                p.in_hand.update(ids)
                p.handed += len(share)
                p.outbox.extend(encode_group(g) for g in share)
                if self._mailbox is not None:
                    if not self._posting:
                        self._posting = True
                        tg.start_soon(self._post)
                elif not p.sending:
                    # Sent in a task of its own: a producer that stops answering holds up only its own groups.
                    p.sending = True
                    tg.start_soon(self._submit, p)
        self._notify()  # wakes whoever watches the producers' load (a policy re-checks, a test waits)

    async def _submit(self, p: ProducerHandle) -> None:
        """Send p its outbox, one Ray call at a time: what is leased to p while a call is in flight
        goes in the next one (group commit, as the LMDB store does it), so the calls carry more
        groups the busier the controller is, and never wait for more to arrive."""
        try:
            while p.outbox and p.lost is None:
                data, p.outbox = p.outbox[: self._batch], p.outbox[self._batch :]
                self._calls["submit"] += 1
                self._calls["submitted"] += len(data)
                try:
                    with anyio.fail_after(self._deadline):
                        await p.actor.submit_many.remote(data)
                except Exception as exc:  # RayActorError, a timeout: its leases end, the reaper requeues
                    self._lose(p, f"submit failed: {exc!r}")
                    return
        finally:
            p.sending = False
            if p.lost is not None:
                p.outbox.clear()  # leased to p in the store: they come back when its leases end

    async def _post(self) -> None:
        """Send every producer's outbox to the mailbox, one Ray call at a time for all of them: what
        is leased meanwhile goes in the next call."""
        try:
            while parcels := self._parcels():
                self._calls["submit"] += 1
                self._calls["submitted"] += sum(len(data) for data in parcels.values())
                try:
                    with anyio.fail_after(self._deadline):
                        await self._mailbox.post.remote(parcels)
                except Exception as exc:  # the mailbox is gone: the run stops, the store keeps the leases
                    raise PipelineError(f"the producers' mailbox did not take the groups handed out: {exc!r}") from exc
        finally:
            self._posting = False

    def _parcels(self) -> dict[str, list[bytes]]:
        """Up to `store_batch` groups from each live producer's outbox; a lost one's are dropped
        (leased to it in the store: they come back when its leases end)."""
        parcels = {}
        for p in self.producers:
            if p.lost is not None:
                p.outbox.clear()
            elif p.outbox:
                parcels[p.name], p.outbox = p.outbox[: self._batch], p.outbox[self._batch :]
        return parcels

    async def _wait_resumed(self) -> None:
        resuming, self._resuming = self._resuming, []
        for p, ref in resuming:
            try:
                with anyio.fail_after(self._deadline):
                    await ref
            except Exception as exc:
                self._lose(p, f"resume failed: {exc!r}")

    # -- taking results back --------------------------------------------------------------------
    async def _receive_results(self, p: ProducerHandle, send: MemoryObjectSendStream[Group]) -> None:
        async with send:
            while p.lost is None:
                began = anyio.current_time()
                try:
                    # Everything p has finished by now, in one call: the busier the controller, the more.
                    batch, stats = await p.actor.take_results.remote(self._take)
                except Exception as exc:  # the actor died, or its stages failed
                    self._lose(p, f"results failed: {exc!r}")
                    return
                p.stats = orjson.loads(stats)
                self._calls["take"] += 1
                self._calls["taken"] += len(batch)
                await self._accept_all(p, batch, send, f"result of producer {p.name}")
                await anyio.sleep(self._take_pause(anyio.current_time() - began))

    async def _take_from_mailbox(self, send: MemoryObjectSendStream[Group]) -> None:
        """Everything every producer has delivered, in one call at most `takes_per_second` times a
        second, each producer's results committed under its own lease (the store's group commit makes
        the producers' store calls of one take one transaction)."""
        by_name = {p.name: p for p in self.producers}
        async with send:
            while True:
                began = anyio.current_time()
                try:
                    results, statistics, failures = await self._mailbox.take.remote()
                except Exception as exc:
                    raise PipelineError(f"the producers' mailbox failed: {exc!r}") from exc
                for name, answer in statistics.items():
                    by_name[name].stats = orjson.loads(answer)
                for name, why in failures.items():
                    self._lose(by_name[name], f"results failed: {why}")
                if results:
                    self._calls["take"] += 1
                    self._calls["taken"] += len(results)
                    each: dict[str, list[tuple[str, bytes]]] = {}
                    for name, kind, data in results:
                        each.setdefault(name, []).append((kind, data))
                    async with anyio.create_task_group() as tg:
                        for name, batch in each.items():
                            p = by_name[name]
                            tg.start_soon(self._accept_all, p, batch, send, f"result of producer {name}")
                await anyio.sleep(max(0.0, 1.0 / self._takes_per_second - (anyio.current_time() - began)))

    async def _accept_all(
        self,
        p: ProducerHandle,
        batch: Sequence[tuple[str, bytes]],
        send: MemoryObjectSendStream[Group] | None,
        what: str,
    ) -> None:
        """Decode what p sent back and commit it, `store_batch` results a store call."""
        results = [(ResultKind(kind), decode_group(data, key=what)) for kind, data in batch]
        for start in range(0, len(results), self._batch):
            await self._accept(p, results[start : start + self._batch], send)

    async def _accept(
        self,
        p: ProducerHandle,
        results: Sequence[tuple[ResultKind, Group]],
        send: MemoryObjectSendStream[Group] | None,
    ) -> None:
        """Commit `results` under p's lease in one store call; the store refuses (fences) each one
        p no longer holds, and commits the rest."""
        ids = [group.group_id for _, group in results]
        if p.lost is not None:
            # Given up on: its leases are ending (`_reclaim_now`), so nothing more of it is committed,
            # whether or not the store has taken them back yet. Checked here, with no await before
            # the store call below: a group p held when lost is settled once, reclaimed or fenced.
            refused = dict.fromkeys(ids, f"producer {p.name} was given up on: {p.lost}")
        else:
            self._committing.update(ids)
            try:
                # The collector's put_ready runs as the controller: an accepted group's lease comes back first.
                refused = await self._store.accept_results(
                    p.name, [(_COMMIT_AS[kind], group) for kind, group in results]
                )
            finally:
                self._committing.difference_update(ids)
        accepted = []
        for kind, group in results:
            gid = group.group_id
            if gid in refused:
                self._counts["fenced"] += 1
                log.warning("late result fenced", producer=p.name, group=gid, reason=refused[gid])
                self._settle(p, gid, Outcome.PARTIAL)  # if still ours: reclaimed behind our back, partial now
            elif kind is ResultKind.ACCEPTED:
                accepted.append(group)
                p.in_hand.discard(gid)
            else:
                self._settle(p, gid, _OUTCOME[kind], group)
        self._counts["accepted"] += len(accepted)
        self._notify()
        if accepted:
            assert send is not None, "accepted groups come with the results stream"
            for group in accepted:
                await send.send(group)  # the collector settles it as ready

    def _take_pause(self, since_last_take: float) -> float:
        """How long a producer's next take waits: its share of the takes per second (the live
        producers share them), less the time since its last take began. A take that waited for
        its first result (a light load) has used its turn up and the next goes at once."""
        turn = len(self._live()) / self._takes_per_second
        return max(0.0, turn - since_last_take)

    def _settle(self, p: ProducerHandle, gid: str, outcome: Outcome, group: Group | None = None) -> None:
        """Settle a group p held (the caller notifies once for all it settled); a failed `group`
        is passed on so its error is logged."""
        if gid in p.in_hand:
            p.in_hand.discard(gid)
            self._admission.settle(outcome, group)

    # -- liveness -------------------------------------------------------------------------------
    async def _heartbeats(self, p: ProducerHandle) -> None:
        """Renew p's leases each time it answers; give it up when it does not answer in time."""
        while p.lost is None:
            try:
                with anyio.fail_after(self._deadline):
                    answer = await p.actor.heartbeat.remote()
            except Exception as exc:
                self._lose(p, f"no heartbeat answer: {exc!r}")
                return
            p.stats = orjson.loads(answer)
            if p.lost is None:
                await self._store.renew_leases(p.name, self._lease)
            await anyio.sleep(self._lease / 3)

    async def _reap(self) -> None:
        """Expired leases go back to PARTIAL; the groups they covered are settled as partial here."""
        while True:
            await anyio.sleep(self._lease / 2)
            reclaimed = await self._store.reclaim_expired()
            if reclaimed or any(p.in_hand for p in self.producers if p.lost is not None):
                await self._settle_reclaimed()

    async def _settle_reclaimed(self) -> None:
        for p in self.producers:
            for gid in list(p.in_hand):
                if gid in self._committing:
                    continue  # its result is being committed: that settles it, fenced or not
                lease = await self._store.lease(gid)
                if gid in p.in_hand and gid not in self._committing and (lease is None or lease.owner != p.name):
                    self._counts["reclaimed"] += 1
                    self._settle(p, gid, Outcome.PARTIAL)
        self._notify()

    def _lose(self, p: ProducerHandle, why: str) -> None:
        if p.lost is not None:
            return
        p.lost = why
        p.given_up = len(p.in_hand - self._committing)
        log.warning("producer lost; its leases expire and its groups are served again", producer=p.name, why=why)
        if self._kill is not None:
            try:
                self._kill(p.actor, no_restart=True)
            except Exception as exc:  # already gone
                log.debug("kill failed", producer=p.name, reason=repr(exc))
        if self._tg is not None:
            self._tg.start_soon(self._reclaim_now, p)
            if self._mailbox is not None:
                self._tg.start_soon(self._drop, p)
        self._notify()

    async def _reclaim_now(self, p: ProducerHandle) -> None:
        """A producer given up on (and killed) will renew nothing: its leases end now rather than at
        their expiry, so its groups are served again at once. A result of it still on the way is
        fenced like any late one."""
        await self._store.renew_leases(p.name, _AT_ONCE)
        if await self._store.reclaim_expired():
            await self._settle_reclaimed()

    async def _drop(self, p: ProducerHandle) -> None:
        """Nothing more goes to p through the mailbox, and what it still delivers is dropped there
        (it would be fenced here anyway)."""
        try:
            with anyio.fail_after(self._deadline):
                await self._mailbox.drop.remote(p.name)
        except Exception as exc:  # the next post or take says what became of the mailbox
            log.debug("mailbox drop failed", producer=p.name, reason=repr(exc))

    def _unanswered(self, method: str, exc: Exception) -> str:
        if isinstance(exc, TimeoutError):
            return f"{method} not answered within {self._deadline:g}s"
        return f"{method} failed: {exc!r}"

    def _live(self) -> list[ProducerHandle]:
        return [p for p in self.producers if p.lost is None]

    def _why_lost(self) -> str:
        return "; ".join(f"{p.name} on {p.node}: {p.lost}" for p in self.producers)

    def _notify(self) -> None:
        self._room.set()
        self._room = anyio.Event()

    async def _close_gates(self, version: int, pause_mode: PauseMode) -> None:
        """Every live producer stops admitting; in abort mode its partial groups come back with its
        answer and are stored here, before the engines pause."""

        async def one(p: ProducerHandle) -> None:
            try:
                with anyio.fail_after(self._deadline):
                    partial = await p.actor.begin_publish.remote(version, pause_mode.value, self._overlap)
            except Exception as exc:
                self._lose(p, self._unanswered("begin_publish", exc))
                return
            await self._accept_all(p, partial, None, f"partial of {p.name}")

        async with anyio.create_task_group() as tg:
            for p in self._live():
                tg.start_soon(one, p)

    async def _each(self, method: str, *args: Any) -> None:
        """Call `method` on every live producer at once; one that misses the deadline is lost."""

        async def one(p: ProducerHandle) -> None:
            try:
                with anyio.fail_after(self._deadline):
                    await getattr(p.actor, method).remote(*args)
            except Exception as exc:
                self._lose(p, self._unanswered(method, exc))

        async with anyio.create_task_group() as tg:
            for p in self._live():
                tg.start_soon(one, p)


async def _forward(receive: MemoryObjectReceiveStream[Group], send: MemoryObjectSendStream[Group]) -> None:
    async with send:
        async for group in receive:
            await send.send(group)


class _PublishGates:
    """A publish across producers: close every producer's admission, later tell them the version."""

    def __init__(self, producers: RayProducers) -> None:
        self._producers = producers

    async def close(self, version: int, pause_mode: PauseMode) -> None:
        started = time.perf_counter()
        await self._producers._close_gates(version, PauseMode(pause_mode))
        log.debug("producer gates closed", version=version, seconds=round(time.perf_counter() - started, 3))

    async def open(self, version: int) -> None:
        await self._producers._each("end_publish", version)

"""One producer: the generator pool, reward and filter of `stages.producers.LocalProducers`, run
inside a Ray actor on its node, with no store of its own.

    controller ── submit_many(group bytes) ─► inbox ─► pool ─► reward ─► filter ─┐
        ▲                                                                   │ accepted
        └──── take_results() ◄── results: (outcome, group bytes) ◄──────────┘ partial / failed / rejected

The stages are the very classes the controller runs in local mode. Where they would write the
store (the calls of `stages.store_ports.ProducerStore`), `_Outbox` queues the group for the
controller instead, which commits it under this producer's lease (`launch.ray_producers`): the
controller stays the single store writer.

Groups cross the process boundary as `storage.codec` bytes (msgpack with a schema version), never
pickled domain objects: a producer may run another node's copy of this code, and a record of
another schema is refused rather than misread. This module does not import Ray: the actor
(`launch.ray_producers`) wraps it, and a test can drive it in-process.

The producer's clock is a copy of the controller's. A publish closes it (`begin_publish`; in abort
mode every request is aborted and every group in hand with a token generated goes back to the
controller, so a producer lost later loses nothing generated before that abort), and `end_publish`
tells it the version that serves. A group none of whose samples had started stays here through the
publish and runs after it: sending it back would carry nothing the controller's store lacks, and
would cost a round trip through the store and both Ray calls for each group queued here (half the
groups that came back at each publish, measured: BENCHMARKS.md section 11).
"""

from __future__ import annotations

import enum
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import anyio
import orjson
from anyio.abc import TaskStatus

from core.clock import VersionClock
from core.types import Group, PauseMode, SampleStatus
from stages.admission import Admission, Outcome
from stages.filter import FilterStage
from stages.generator import GeneratorPool
from stages.plugins import resolve_function
from stages.producers import LocalProducers
from stages.reward import RewardStage
from stages.sglang_client import EngineFleet
from stages.sglang_client.payloads import TokenPayloads
from stages.store_ports import ProducerStore
from storage.codec import decode_group, encode_group

__all__ = ["ProducerCore", "ProducerSpec", "ResultKind"]


class ResultKind(enum.Enum):
    """How a group left a producer; the controller commits each kind with the producer's lease."""

    ACCEPTED = "accepted"  # rewarded and kept by the filter: the controller's collector makes it ready
    PARTIAL = "partial"
    FAILED = "failed"
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True)
class ProducerSpec:
    """Everything one producer needs, as plain values (sent as JSON, so any node's code reads it)."""

    name: str
    engine_urls: tuple[str, ...]
    router_url: str | None
    group_slots: int
    n_samples: int
    sampling_params: Mapping[str, Any]
    max_response_len: int
    reward_path: str
    reward_timeout: float = 30.0
    reward_max_retries: int = 0
    agent_max_retries: int = 0
    filter_path: str | None = None
    agent_path: str | None = None
    seed: int = 0
    version: int = 0
    request_timeout: float = 600.0
    max_retries: int = 3
    api_key: str | None = None
    # R3 / SC payloads asked with every request (`stages.sglang_client.payloads.TokenPayloads`); they come
    # back inside the groups' codec records.
    routed_experts_top_k: int | None = None
    sampler_top_k: int | None = None
    routed_experts_count: int | None = None  # the model's experts per layer: the routes' packed type

    @property
    def slots(self) -> int:
        """Sample slots: the producer's group slots times the group size."""
        return self.group_slots * self.n_samples

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> ProducerSpec:
        """Fields this code does not know (a newer controller's) are left out; missing optional
        ones take their defaults, so a producer on another node's code version still starts."""
        values = orjson.loads(data)
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in values.items() if k in known}
        values["engine_urls"] = tuple(values["engine_urls"])
        return cls(**values)


class _Results:
    """Groups on their way back to the controller, oldest first; bounded by the groups in hand."""

    def __init__(self) -> None:
        self._items: list[tuple[str, bytes]] = []
        self._added = anyio.Event()
        self._drained = anyio.Event()
        self._drained.set()

    def put(self, kind: ResultKind, group: Group) -> None:
        self._items.append((kind.value, encode_group(group)))
        self._added.set()
        if self._drained.is_set():
            self._drained = anyio.Event()

    async def take(self, limit: int | None) -> list[tuple[str, bytes]]:
        """Wait for at least one result; return up to `limit` of them (None: all)."""
        while not self._items:
            self._added = anyio.Event()
            await self._added.wait()
        cut = len(self._items) if limit is None else limit
        out, self._items = self._items[:cut], self._items[cut:]
        if not self._items:
            self._drained.set()
        return out

    def take_partial(self) -> list[tuple[str, bytes]]:
        """Every partial group waiting here, taken out now (the others keep their turn)."""
        partial = [r for r in self._items if r[0] == ResultKind.PARTIAL.value]
        self._items = [r for r in self._items if r[0] != ResultKind.PARTIAL.value]
        if not self._items:
            self._drained.set()
        return partial

    async def wait_drained(self) -> None:
        await self._drained.wait()

    def __len__(self) -> int:
        return len(self._items)


class _Outbox:
    """The store as the producer's stages see it (`stages.store_ports.ProducerStore`): each group
    that leaves the pool, reward or filter goes back to the controller instead of into a store.

    Only those calls exist: a stage that called anything else (reading state this producer does
    not have) would fail mypy where the stages are built here, and `AttributeError` if it got past."""

    def __init__(self, results: _Results, keep: Callable[[Group], bool]) -> None:
        self._results = results
        self._keep = keep

    async def put_partial(self, group: Group) -> None:
        if not self._keep(group):
            self._results.put(ResultKind.PARTIAL, group)

    async def put_failed(self, group: Group) -> None:
        self._results.put(ResultKind.FAILED, group)

    async def put_rejected_groups(self, groups: Sequence[Group]) -> None:
        for group in groups:
            self._results.put(ResultKind.REJECTED, group)


def where() -> str:
    """This process's node, for errors: a producer that cannot import a path says which node."""
    return f"{socket.gethostname()}"


def _resolve(path: str | None, what: str, node: str) -> Callable[..., Any] | None:
    from core.errors import PluginError

    if path is None:
        return None
    try:
        return resolve_function(path)
    except PluginError as exc:
        reason = str(exc).removeprefix(f"{path!r}: ")
        raise PluginError(path, f"the {what} cannot be imported on producer node {node}: {reason}") from exc


class ProducerCore:
    """The stages of one producer on one event loop; `run` it in a task group, then call the rest."""

    def __init__(self, spec: ProducerSpec, *, node: str | None = None) -> None:
        self.spec = spec
        self.node = node or where()
        self._local: LocalProducers | None = None
        self._inbox: anyio.abc.ObjectSendStream[Group] | None = None
        self.clock = VersionClock(spec.version)
        self._stopped_for_publish = False
        # Between an abort-mode begin_publish and its end_publish: groups that come back from the
        # pool untouched are held here (`_held`) rather than sent back, and run after the publish.
        self._holding = False
        self._held: list[Group] = []

    async def run(self, *, task_status: TaskStatus[None]) -> None:
        spec = self.spec
        reward = _resolve(spec.reward_path, "reward function", self.node)
        assert reward is not None
        keep = _resolve(spec.filter_path, "filter function", self.node)
        agent = _resolve(spec.agent_path, "agent", self.node)
        self.admission = Admission()
        self.results = _Results()
        outbox: ProducerStore = _Outbox(self.results, self._hold)
        urls = list(spec.engine_urls)
        async with EngineFleet(
            urls or None,
            router_url=spec.router_url,
            concurrency=spec.slots,
            request_timeout=spec.request_timeout,
            max_retries=spec.max_retries,
            api_key=spec.api_key,
            routed_experts=spec.routed_experts_top_k is not None,  # past a router that drops R3's fields
        ) as fleet:
            pool = GeneratorPool(
                fleet,
                slots=spec.slots,
                sampling_params=spec.sampling_params,
                max_response_len=spec.max_response_len,
                clock=self.clock,
                store=outbox,
                admission=self.admission,
                seed=spec.seed,
                agent=agent,
                agent_max_retries=spec.agent_max_retries,
                payloads=TokenPayloads(spec.routed_experts_top_k, spec.sampler_top_k, spec.routed_experts_count),
            )
            stages = RewardStage(
                reward,
                timeout=spec.reward_timeout,
                store=outbox,
                admission=self.admission,
                max_retries=spec.reward_max_retries,
            )
            self._local = LocalProducers(
                pool, stages, FilterStage(keep, store=outbox, admission=self.admission), buffer=spec.group_slots
            )
            # The controller keeps at most group_slots + 1 groups here; the inbox holds them all.
            inbox_send, inbox = anyio.create_memory_object_stream[Group](spec.group_slots + 1)
            accepted_send, accepted = anyio.create_memory_object_stream[Group](spec.group_slots)
            self._inbox = inbox_send
            async with inbox_send, accepted, anyio.create_task_group() as tg:
                await tg.start(self._local.run, inbox, accepted_send)
                task_status.started()
                async for group in accepted:
                    self.results.put(ResultKind.ACCEPTED, group)
                    self.admission.settle(Outcome.READY)

    # -- the controller's calls ---------------------------------------------------------------
    async def submit(self, data: bytes) -> None:
        """A group leased to this producer, as codec bytes."""
        await self.submit_many([data])

    async def submit_many(self, data: Sequence[bytes]) -> None:
        """Groups leased to this producer together, as codec bytes, in the order they came."""
        await self._feed([decode_group(d, key=f"group for producer {self.spec.name}") for d in data])

    async def _feed(self, groups: Sequence[Group]) -> None:
        assert self._inbox is not None, "submit before run"
        self.admission.grant(len(groups))
        for group in groups:
            await self.admission.take_ticket()
            await self._inbox.send(group)

    async def take_results(self, limit: int | None = 64) -> list[tuple[str, bytes]]:
        return await self.results.take(limit)

    async def stop(self) -> None:
        """The sync round's "enough": abort everything; return once every group in hand went back."""
        self._holding = False  # a stop during a publish: the held groups go back too
        for group in self._held:
            self.results.put(ResultKind.PARTIAL, group)
        self._held = []
        await self._open().stop()
        await self.admission.wait_settled()
        await self.results.wait_drained()

    def resume(self) -> None:
        self._open().resume()

    async def begin_publish(self, version: int, pause_mode: str, overlap: bool) -> list[tuple[str, bytes]]:
        """Close this producer's admission for `version`. In abort mode every request is aborted and
        the partial groups are the answer, for the controller to store before the weights move.

        Not waiting for the controller to take the finished groups too: in async mode it may not
        take them before this publish's batch made room in its collector."""
        if not self.clock.publishing:
            self.clock.begin_publish()
        if PauseMode(pause_mode) is not PauseMode.ABORT or overlap:
            return []
        self._stopped_for_publish = self._holding = True
        await self._open().stop()
        await self.admission.wait_settled()
        return self.results.take_partial()

    async def end_publish(self, version: int) -> None:
        """The publish ended with `version` serving (one more than before if it committed); the
        groups held through it run now, in the order they came back."""
        if self.clock.publishing:
            self.clock.end_publish(committed=version == self.clock.version + 1)
        if self._stopped_for_publish:
            self._stopped_for_publish = self._holding = False
            self.resume()
            held, self._held = self._held, []
            await self._feed(held)

    def _hold(self, group: Group) -> bool:
        """Keep `group` here instead of sending it back as partial, if a publish stopped the pool
        before any of its samples started: nothing generated is at stake, and it is still leased
        to this producer (the controller renews the lease, and serves the group again from its
        store if this producer is lost)."""
        if not self._holding or any(s.status is not SampleStatus.PENDING for s in group.samples):
            return False
        self._held.append(group)
        return True

    def statistics(self) -> dict[str, Any]:
        local = self._open()
        return {
            "node": self.node,
            "version": self.clock.version,
            "in_hand": self.admission.outstanding + len(self._held),
            "waiting_results": len(self.results),
            "idle_slots": local.idle_slots,
            "generator": asdict(local.statistics()),
            "rejected": local.filter_statistics().rejected,
        }

    def _open(self) -> LocalProducers:
        if self._local is None:
            raise RuntimeError(f"producer {self.spec.name} is not running")
        return self._local

"""Ray process control for `--rollout-producers ray`: join or start a cluster, place one producer
actor per eligible node, and take them down again.

    async with open_ray_producers(settings, specs) as make:   # actors started, each with its node
        await run_pipeline(..., producers=make)              # make(admission) -> RayProducers

Eligible nodes are the alive ones with CPUs. Producers are placed with node-affinity scheduling,
round robin over those nodes (one each by default). `--ray-address` joins an existing cluster;
otherwise `ray.init` starts a local one, which is shut down on exit. Ray's token authentication is
turned off for a cluster started here (`RAY_AUTH_MODE=disabled`, environment.md section 1a): it is
a private single-user cluster, and the token file would otherwise be written to the home folder.

Actors get this process's code root on their PYTHONPATH, so a local cluster's workers import the
same code as the controller; on other nodes the path is absent and their installed copy is used
(groups cross as versioned codec bytes, so that copy may differ).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import orjson
import structlog

from core.errors import PipelineError
from launch.gc_settings import settle_gc
from launch.ray_mailbox import Mailbox
from launch.ray_producer import ProducerCore, ProducerSpec
from launch.ray_producers import DEFAULT_TAKES_PER_SECOND, ProducerHandle, RayProducers
from stages.admission import Admission
from storage import AsyncStore

__all__ = ["ProducerActor", "RaySettings", "eligible_nodes", "engine_shares", "group_slots", "open_ray_producers"]

log = structlog.get_logger("producers")

_CODE_ROOT = str(Path(__file__).resolve().parent.parent)
START_DEADLINE = 120.0  # a fresh worker imports torch, transformers and our stages


@dataclass(frozen=True, slots=True)
class RaySettings:
    address: str | None  # None: start a local cluster
    num_producers: int | None  # None: one per eligible node
    lease_seconds: float
    deadline_seconds: float
    overlap_publish: bool = False
    takes_per_second: float = DEFAULT_TAKES_PER_SECOND  # results taken back, all producers together
    mailbox: bool = True  # groups and results go through one mailbox actor (launch.ray_mailbox)


class ProducerActor:
    """The Ray actor around one `ProducerCore` (decorated with `ray.remote` when placed)."""

    def __init__(self, spec_json: bytes, node: str) -> None:
        self._spec = ProducerSpec.from_json(spec_json)
        self._node = node
        self._core: ProducerCore | None = None
        self._failure: str | None = None
        self._main: asyncio.Task[None] | None = None

    async def start(self, mailbox: Any = None, deliveries_per_second: float = math.inf) -> bytes:
        """Run the stages; answer JSON with the node and, if they could not start, why. With a
        `mailbox` (`launch.ray_mailbox`), collect groups from it and deliver results to it, at most
        `deliveries_per_second`; without, the controller calls `submit_many` and `take_results`."""
        # The actor's process parses every answer of its producer, as the controller does in the
        # local mode: the same collector settings spare it the same walks (launch.gc_settings).
        settle_gc()
        core = ProducerCore(self._spec, node=self._node)
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def main() -> None:
            try:
                async with anyio.create_task_group() as tg:
                    await tg.start(core.run)
                    started.set_result(None)
                    if mailbox is not None:
                        tg.start_soon(self._collect, core, mailbox)
                        tg.start_soon(self._deliver, core, mailbox, 1.0 / deliveries_per_second)
            except Exception as exc:  # kept for every later call: the controller loses us with it
                self._failure = _describe(exc)
                if not started.done():
                    started.set_result(None)
                elif mailbox is not None:  # the controller hears it with the next take, not a heartbeat later
                    with contextlib.suppress(Exception):
                        await mailbox.deliver.remote(self._spec.name, [], None, self._failure)

        self._main = asyncio.ensure_future(main())
        await started
        self._core = core
        return orjson.dumps({"node": self._node, "error": self._failure})

    async def _collect(self, core: ProducerCore, mailbox: Any) -> None:
        """The groups the controller leased to this producer, as the mailbox gets them."""
        while data := await mailbox.collect.remote(self._spec.name):
            await core.submit_many(data)
        # An empty answer: the controller gave this producer up (it is being killed); nothing more comes.

    async def _deliver(self, core: ProducerCore, mailbox: Any, interval: float) -> None:
        """Everything finished, with the statistics as of now, one call in flight; the results that
        finish meanwhile go in the next, which leaves at most every `interval` seconds."""
        while True:
            began = anyio.current_time()
            results = await core.take_results(None)
            await mailbox.deliver.remote(self._spec.name, results, orjson.dumps(core.statistics()))
            await anyio.sleep(max(0.0, interval - (anyio.current_time() - began)))

    def _ok(self) -> ProducerCore:
        if self._failure is not None or self._core is None:
            raise RuntimeError(f"producer {self._spec.name} on {self._node} failed: {self._failure}")
        return self._core

    async def submit_many(self, data: list[bytes]) -> None:
        await self._ok().submit_many(data)

    async def take_results(self, limit: int) -> tuple[list[tuple[str, bytes]], bytes]:
        """Up to `limit` results once there is one, with the statistics as of now (so the step
        record counts the work behind these results, not the last heartbeat's)."""
        core = self._ok()
        async with anyio.create_task_group() as tg:
            # A failure of the stages must end this wait too, or the controller would never hear of it.
            taken: list[tuple[str, bytes]] = []

            async def take() -> None:
                taken.extend(await core.take_results(limit))
                tg.cancel_scope.cancel()

            async def failed() -> None:
                assert self._main is not None
                try:
                    await asyncio.shield(self._main)
                finally:
                    tg.cancel_scope.cancel()

            tg.start_soon(take)
            tg.start_soon(failed)
        if not taken:
            self._ok()
        return taken, orjson.dumps(core.statistics())

    async def heartbeat(self) -> bytes:
        return orjson.dumps(self._ok().statistics())

    async def stop(self) -> None:
        await self._ok().stop()

    async def resume(self) -> None:
        self._ok().resume()

    async def begin_publish(self, version: int, pause_mode: str, overlap: bool) -> list[tuple[str, bytes]]:
        return await self._ok().begin_publish(version, pause_mode, overlap)

    async def end_publish(self, version: int) -> None:
        await self._ok().end_publish(version)

    def pid(self) -> int:
        """The worker's process id (tests freeze it to play a producer that stops answering)."""
        return os.getpid()


def _describe(exc: BaseException) -> str:
    """The errors inside nested task groups, each as `Type: message`."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


def group_slots(sample_slots: int, n_samples: int, producers: int) -> list[int]:
    """K = floor(C*E / G) group slots split over W producers by quotient and remainder."""
    q, r = divmod(sample_slots // n_samples, producers)
    return [q + (1 if i < r else 0) for i in range(producers)]


def engine_shares(
    urls: Sequence[str], router_url: str | None, producers: int
) -> list[tuple[tuple[str, ...], str | None]]:
    """(engine URLs, router URL) for each producer.

    At most one engine per producer: round robin, so W producers over E <= W engines share them
    evenly. More engines than producers, or only a router: every producer goes through the router,
    and aborts reach every engine (the router does not forward them).
    """
    if not urls:
        return [((), router_url)] * producers
    if len(urls) <= producers:
        return [((urls[i % len(urls)],), None) for i in range(producers)]
    if router_url is None:
        raise PipelineError(f"{len(urls)} engines over {producers} producers need a router in front of them")
    return [(tuple(urls), router_url)] * producers


def eligible_nodes(nodes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ray's nodes that can host a producer: alive, with CPUs."""
    return [n for n in nodes if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]


@asynccontextmanager
async def open_ray_producers(
    settings: RaySettings,
    spec_for: Callable[[int, int], ProducerSpec],
    *,
    store: AsyncStore,
    n_samples: int,
    store_batch: int = 64,
) -> AsyncIterator[Callable[[Admission], RayProducers]]:
    """Start the producers (`spec_for(i, W)` is producer i's spec); yield the graph's factory.

    A producer that cannot start (a reward path it cannot import, no engine) stops the run here,
    naming the producer and its node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    started_here = not ray.is_initialized()
    if started_here:
        if settings.address is None:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address=settings.address, include_dashboard=False, log_to_driver=False)
    handles: list[ProducerHandle] = []
    mailbox: Any = None
    try:
        nodes = eligible_nodes(ray.nodes())  # type: ignore[no-untyped-call]
        count = settings.num_producers or len(nodes)
        if not nodes:
            raise PipelineError("Ray has no alive node with CPUs to run a producer on")
        remote = ray.remote(num_cpus=0, max_restarts=0)(ProducerActor)
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [_CODE_ROOT, os.environ.get("PYTHONPATH")]))}
        if settings.mailbox:
            # On the controller's node, so that it shares the controller's fate (and not by a soft
            # affinity: Ray places a soft one with no CPU on any node).
            mailbox = (
                ray.remote(num_cpus=0, max_restarts=0)(Mailbox)
                .options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(
                        ray.get_runtime_context().get_node_id(), soft=False
                    ),
                    runtime_env={"env_vars": env},
                )
                .remote()
            )
        for i in range(count):
            node = nodes[i % len(nodes)]
            spec = spec_for(i, count)
            where = f"{node.get('NodeManagerAddress', '?')} ({node['NodeID'][:8]})"
            actor = remote.options(
                name=None,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
                runtime_env={"env_vars": env},
            ).remote(spec.to_json(), where)
            handles.append(ProducerHandle(spec.name, actor, where, spec.group_slots))
        await _start_all(handles, mailbox, settings.takes_per_second)
        log.info("producers started", producers=[(h.name, h.node, h.group_slots) for h in handles])

        made = False

        def make(admission: Admission) -> RayProducers:
            nonlocal made
            if made:
                # The handles (groups in hand, losses) and the mailbox are that run's state: a
                # second set on them would take the first's results, or start from its leftovers.
                raise PipelineError(
                    "open_ray_producers makes one producer set, for one run, and it was made already: "
                    "open it again for another run (or another Rollout)"
                )
            made = True
            return RayProducers(
                handles,
                admission=admission,
                store=store,
                n_samples=n_samples,
                lease_seconds=settings.lease_seconds,
                deadline_seconds=settings.deadline_seconds,
                overlap_publish=settings.overlap_publish,
                kill=ray.kill,
                store_batch=store_batch,
                takes_per_second=settings.takes_per_second,
                mailbox=mailbox,
            )

        yield make
    finally:
        actors = [(h.name, h.actor) for h in handles]
        if mailbox is not None:
            actors.append(("mailbox", mailbox))
        for name, actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already dead
                log.debug("kill at exit failed", producer=name, reason=repr(exc))
        if started_here:
            ray.shutdown()


async def _start_all(handles: Sequence[ProducerHandle], mailbox: Any, deliveries_per_second: float) -> None:
    problems: list[str] = []

    async def one(h: ProducerHandle) -> None:
        try:
            with anyio.fail_after(START_DEADLINE):
                answer = orjson.loads(await h.actor.start.remote(mailbox, deliveries_per_second))
        except Exception as exc:
            problems.append(f"producer {h.name} on {h.node} did not start: {exc!r}")
            return
        if answer["error"]:
            problems.append(f"producer {h.name} on {answer['node']}: {answer['error']}")

    async with anyio.create_task_group() as tg:
        for h in handles:
            tg.start_soon(one, h)
    if problems:
        raise PipelineError("; ".join(problems))

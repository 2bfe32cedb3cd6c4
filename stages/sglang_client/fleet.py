"""`EngineFleet`: every engine the pipeline uses, behind one aiohttp session.

One module, over 600 lines: one class whose methods share the fleet's state (live engines, the
watch, the fault policy); dispatch, faults, the watch and the publishes live beside it already.

`/generate` goes to one URL (the router, or the only engine), and every control call fans out to
every engine concurrently, because the router does not forward `/abort_request`,
`/pause_generation` or the weight endpoints. The one exception: R3 requests behind a router that
drops their fields go to the engines themselves, placed by the fleet (`dispatch.py` says why).

A `/generate` that gets no answer within its deadline is never sent to the same engine again.
Without a fault policy the run stops with `EngineLostError`, naming the engine (the liveness watch
has said for a while that it is silent, or that it answers and is only slow). With one, the only
engine's failure evicts it (as a failed control call does), and its requests come back as aborted
ones that wait for an engine to serve (a restarted one at the same URL is a new process). Behind
a router the client cannot pick the engine, but the heartbeat has taken a silent one out of the
router long before a request's deadline passes, and the timed-out request comes back aborted, to
resume on the engines that live.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self, TypeVar

import aiohttp
import anyio
import structlog

from core.errors import EngineError, EngineLostError, EngineUnavailableError
from core.types import PauseMode
from stages.sglang_client.dispatch import EnginePicker, PickerStatistics
from stages.sglang_client.engine_client import EngineClient, EngineStatistics, RequestCounters, folder_for_engine
from stages.sglang_client.faults import FleetFaults
from stages.sglang_client.health import EngineRestarter, FaultPolicy, FaultStatistics
from stages.sglang_client.http1 import GeneratePool
from stages.sglang_client.watch import LivenessWatch, request_timed_out
from stages.sglang_client.wire import PAUSE_MODES, EngineLoad, GenerateResult

__all__ = ["CONTROL_HEADROOM", "EngineFleet"]

# Connections kept free for control calls on top of the generation concurrency. Without them a
# pool saturated by `/generate` requests would queue the very `/abort_request` that frees it.
CONTROL_HEADROOM = 32

# The R3 probe (`EngineFleet(routed_experts=True)`): one token after one token, whose id every
# vocabulary has.
_PROBE_INPUT = (0,)
_PROBE_PARAMS = {"max_new_tokens": 1, "temperature": 0.0}
_R3_FIELDS = {"return_routed_experts": True, "routed_experts_start_len": 0}
# Which routers drop R3's fields and which keep them (dispatch.py has the sources).
_ROUTERS_THAT_DROP = (
    "sglang-router up to 0.3.2 (its last release) drops return_routed_experts; smg >= 1.5.0 passes it on"
)

log = structlog.get_logger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class _FleetState:
    session: aiohttp.ClientSession
    generator: EngineClient
    workers: tuple[EngineClient, ...] = field(default=())  # the live ones: evicted engines leave
    generate_pool: GeneratePool | None = None  # lean /generate connections (None: aiohttp's)
    # Set when /generate goes to the engines themselves (R3 behind a router that drops its
    # fields): the picker, and each engine's own /generate client (with its own lean pool).
    picker: EnginePicker | None = None
    engine_generators: dict[str, EngineClient] = field(default_factory=dict)
    engine_pools: list[GeneratePool] = field(default_factory=list)


class EngineFleet:
    """Every engine the pipeline uses, behind one aiohttp session.

    Build it with the engines' URLs (one engine, or several plus `router_url`), or with only
    `router_url`, in which case the workers are discovered from the router on entry
    (`GET /workers`, or `GET /list_workers` on routers up to 0.2.1). Use it as an async context
    manager: the session lives between enter and exit.

    `concurrency` is the most `/generate` requests the caller keeps in flight; the connection pool
    is that plus `CONTROL_HEADROOM`, so control calls never queue behind generation.

    `routed_experts`: the requests ask for R3 routes. Entry then checks with one request that an
    engine answers them (refused by name if not), and behind a router, that the router passes
    `return_routed_experts` on (sglang-router 0.3.2 does not); where it does not, `/generate` goes
    to the engines directly (`dispatch.EnginePicker`).

    Without a `fault_policy`, a `LivenessWatch` names an engine that has not answered `/health`
    for `silence_warning` seconds while requests wait on it (None: no watch).
    """

    def __init__(
        self,
        worker_urls: Sequence[str] | None = None,
        *,
        router_url: str | None = None,
        concurrency: int = 64,
        request_timeout: float = 3600.0,
        control_timeout: float = 30.0,
        max_retries: int = 3,
        retry_backoff: float = 0.5,
        api_key: str | None = None,
        fault_policy: FaultPolicy | None = None,
        restarter: EngineRestarter | None = None,
        lean_generate: bool = True,
        routed_experts: bool = False,
        silence_warning: float | None = 30.0,
    ) -> None:
        if not worker_urls and router_url is None:
            raise ValueError("an EngineFleet needs worker URLs, a router URL, or both")
        if worker_urls is not None and len(worker_urls) > 1 and router_url is None:
            raise ValueError(f"{len(worker_urls)} engines need a router in front of them: {list(worker_urls)}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self._given_workers = tuple(u.rstrip("/") for u in worker_urls) if worker_urls else None
        self._router_url = router_url.rstrip("/") if router_url else None
        self._concurrency = concurrency
        self._client_kw: dict[str, Any] = {
            "request_timeout": request_timeout,
            "control_timeout": control_timeout,
            "max_retries": max_retries,
            "retry_backoff": retry_backoff,
        }
        self._counters = RequestCounters()
        # SGLang's --api-key: every request (engines and router alike) carries it.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._state: _FleetState | None = None
        # `/generate` over `GeneratePool` (plain http on asyncio); False: over aiohttp, as before.
        self._lean_generate = lean_generate
        # With a fault policy, engine faults evict instead of failing the call (see faults.py).
        self._faults = FleetFaults(self, fault_policy, restarter) if fault_policy is not None else None
        self._routed_experts = routed_experts
        self._request_timeout = request_timeout
        # Without fault tolerance nothing evicts a hung engine; the watch at least says so.
        self._watch = (
            LivenessWatch(
                lambda: self.workers,
                silence=silence_warning,
                request_timeout=request_timeout,
                via_router=self._router_url is not None,
            )
            if self._faults is None and silence_warning is not None
            else None
        )
        # Requests waiting for an engine to come back (fault policy, none live): abort reaches them.
        self._waiting: dict[anyio.CancelScope, str] = {}

    async def __aenter__(self) -> Self:
        if self._state is not None:
            raise RuntimeError("this EngineFleet is already open")
        connector = aiohttp.TCPConnector(limit=self._concurrency + CONTROL_HEADROOM)
        session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        try:
            generate_url = self._router_url or self._given_workers[0]  # type: ignore[index]
            pool = None
            if self._lean_generate and GeneratePool.supports(generate_url):
                pool = GeneratePool(generate_url, headers=self._headers, max_idle=self._concurrency)
            generator = EngineClient(
                generate_url, session, counters=self._counters, generate_pool=pool, **self._client_kw
            )
            self._state = _FleetState(session, generator, generate_pool=pool)
            if self._given_workers is not None:
                self._state.workers = tuple(self._client(session, u) for u in self._given_workers)
            else:
                await self.discover_workers()
            if self._routed_experts:
                await self._check_routed_experts()
            if self._faults is not None:
                await self._faults.__aenter__()
            if self._watch is not None:
                await self._watch.__aenter__()
        except BaseException:
            state, self._state = self._state, None
            with anyio.move_on_after(5, shield=True):
                if state is not None:
                    await _close_pools(state)
                await session.close()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._watch is not None and self._state is not None:
                await self._watch.__aexit__(exc_type, exc, tb)
            if self._faults is not None and self._state is not None:
                await self._faults.__aexit__(exc_type, exc, tb)  # raises what ended the run, if it did
        finally:
            state, self._state = self._state, None
            if state is not None:
                with anyio.move_on_after(5, shield=True):
                    await _close_pools(state)
                    await state.session.close()

    def _client(self, session: aiohttp.ClientSession, url: str) -> EngineClient:
        return EngineClient(url, session, counters=self._counters, **self._client_kw)

    @property
    def _open(self) -> _FleetState:
        if self._state is None:
            raise RuntimeError("use the EngineFleet inside `async with` first")
        return self._state

    @property
    def generate_url(self) -> str:
        """Where `/generate` goes: the router or the only engine (R3 placed by the fleet: the router's URL too)."""
        return self._open.generator.url

    @property
    def generates_direct(self) -> bool:
        """Whether `/generate` goes to the engines themselves, placed by the fleet, not the router."""
        return self._open.picker is not None

    def picker_statistics(self) -> PickerStatistics | None:
        """Where the fleet placed its requests; None while the router places them."""
        picker = self._open.picker
        return picker.statistics() if picker is not None else None

    @property
    def worker_urls(self) -> tuple[str, ...]:
        return tuple(w.url for w in self._open.workers)

    @property
    def workers(self) -> tuple[EngineClient, ...]:
        return self._open.workers

    def set_workers(self, workers: tuple[EngineClient, ...]) -> None:
        """The live engines from now on: the fault handling's eviction and re-admission (`FleetFaults`)."""
        self._open.workers = workers

    @property
    def router(self) -> EngineClient:
        """The router's client: `/generate` goes there, and the fault handling's worker calls."""
        if self._router_url is None:
            raise RuntimeError("this EngineFleet has no router")
        return self._open.generator

    def statistics(self) -> EngineStatistics:
        return self._counters.snapshot()

    @property
    def router_url(self) -> str | None:
        return self._router_url

    def fault_statistics(self) -> FaultStatistics | None:
        """Evictions, restarts and time at reduced capacity; None without a fault policy."""
        return self._faults.statistics() if self._faults is not None else None

    def fault_metrics(self) -> dict[str, float]:
        stats = self.fault_statistics()
        return stats.as_metrics() if stats is not None else {}

    def client_for(self, url: str) -> EngineClient:
        """A client for one engine on this fleet's session (live or not)."""
        return self._client(self._open.session, url)

    def set_current_weights(self, path: str | None, weight_version: str) -> None:
        """What engines already hold (a resumed run's weights, or the start version): what a
        restarted or returning engine is made before it takes work. A no-op without a fault policy."""
        if self._faults is not None:
            self._faults.current_weights = (path, weight_version)

    async def evict(self, url: str, reason: str) -> None:
        """Take `url` out of the fleet now (needs a fault policy); see `FleetFaults.evict`."""
        if self._faults is None:
            raise RuntimeError("eviction needs an EngineFleet built with a fault_policy")
        await self._faults.evict(url, reason)

    async def readmit(self, url: str) -> None:
        """Bring `url` back with the current weights and version (needs a fault policy)."""
        if self._faults is None:
            raise RuntimeError("re-admission needs an EngineFleet built with a fault_policy")
        await self._faults.readmit(url)

    async def discover_workers(self) -> tuple[str, ...]:
        """Ask the router which engines it routes to, and fan control calls out to those from now on."""
        state = self._open
        if self._router_url is None:
            raise RuntimeError("worker discovery needs a router_url")
        urls = await state.generator.router_workers()
        state.workers = tuple(self._client(state.session, u) for u in urls)
        return self.worker_urls

    # -- generation goes to one URL -----------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        rid: str,
        return_logprob: bool = True,
        **fields: Any,
    ) -> GenerateResult:
        state = self._open
        if state.picker is not None:
            return await self._generate_direct(
                state, state.picker, input_ids, sampling_params, rid=rid, return_logprob=return_logprob, **fields
            )
        if self._faults is not None:
            return await self._generate_tolerant(
                self._faults, input_ids, sampling_params, rid=rid, return_logprob=return_logprob, **fields
            )
        return await self._generate_watched(
            state.generator, input_ids, sampling_params, rid=rid, return_logprob=return_logprob, **fields
        )

    async def _generate_watched(
        self,
        client: EngineClient,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        rid: str,
        return_logprob: bool,
        **fields: Any,
    ) -> GenerateResult:
        """Without a fault policy, through the router or straight to an engine: the watch counts the
        request while it waits, and a request past its deadline ends the run instead of going back
        to the pool, which would send it to the same engine, to wait as long again."""
        watch = self._watch
        if watch is not None:
            watch.request_started()
        try:
            return await client.generate(input_ids, sampling_params, rid=rid, return_logprob=return_logprob, **fields)
        except EngineUnavailableError as exc:
            if exc.timed_out:
                raise self._timed_out(client.url) from exc
            raise
        finally:
            if watch is not None:
                watch.request_ended()

    def _timed_out(self, url: str) -> EngineLostError:
        silent = None if self._watch is None else self._watch.silent_engines()
        return request_timed_out(url, router_url=self._router_url, deadline=self._request_timeout, silent=silent)

    async def _generate_tolerant(
        self,
        faults: FleetFaults,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        rid: str,
        return_logprob: bool,
        **fields: Any,
    ) -> GenerateResult:
        """With a fault policy: wait while no engine is live (a restart is under way), and hand a
        request the only engine did not answer back as aborted, after evicting that engine."""
        state = self._open
        if not state.workers or faults.lost:
            if not await self._wait_for_engine(faults, rid):
                return GenerateResult.aborted_unanswered(rid, "aborted while it waited for an engine")
        url = state.generator.url
        admitted = faults.admissions(url)
        try:
            return await state.generator.generate(
                input_ids, sampling_params, rid=rid, return_logprob=return_logprob, **fields
            )
        except EngineUnavailableError as exc:
            if self._router_url is None:
                # The only engine did not answer: that is evidence, as a failed control call is. Its
                # requests all end here; the pool resumes each from its prefix once an engine serves.
                await faults.evict(url, f"/generate: {exc}", admitted=admitted)
                return GenerateResult.aborted_unanswered(rid, f"no answer from {url}, evicted: {exc}")
            if exc.timed_out:
                # Behind the router the engine is unknown, but a silent one failed its heartbeat
                # long before this deadline and is out of the router: the pool resumes the request
                # on the engines that live (it is no sample's fault, and counts against none).
                return GenerateResult.aborted_unanswered(rid, f"no answer through the router: {exc}")
            raise  # the router itself did not answer

    async def _wait_for_engine(self, faults: FleetFaults, rid: str) -> bool:
        """Wait until an engine is live; False if an abort reached the request first. Raises
        `EngineLostError` once no engine will be (`FleetFaults.lost`)."""
        with anyio.CancelScope() as scope:
            self._waiting[scope] = rid
            try:
                await faults.wait_live()
            finally:
                del self._waiting[scope]
        return not scope.cancelled_caught

    def _abort_waiting(self, rid: str | None) -> None:
        for scope, waiting in self._waiting.items():
            if rid is None or waiting.startswith(rid):  # SGLang matches an abort's rid by prefix
                scope.cancel()

    async def _generate_direct(
        self,
        state: _FleetState,
        picker: EnginePicker,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        rid: str,
        return_logprob: bool,
        **fields: Any,
    ) -> GenerateResult:
        """R3 behind a router that drops its fields: the fleet places the request on an engine."""
        urls = tuple(w.url for w in state.workers)
        if not urls:
            raise EngineUnavailableError(state.generator.url, f"request {rid}: no live engine to send it to")
        url = picker.pick(urls, input_ids)
        try:
            client = self._engine_generator(url)
            if self._faults is None:
                return await self._generate_watched(
                    client, input_ids, sampling_params, rid=rid, return_logprob=return_logprob, **fields
                )
            # Through the router a request to an engine that hangs would wait for its timeout; here
            # the engine's eviction ends it, and the sample goes back to be continued elsewhere.
            with self._faults.cancelled_on_eviction(url):
                return await client.generate(
                    input_ids, sampling_params, rid=rid, return_logprob=return_logprob, **fields
                )
            raise EngineUnavailableError(url, f"request {rid}: the engine was evicted while it ran")
        finally:
            picker.release(url)

    def _engine_generator(self, url: str) -> EngineClient:
        """`url`'s own `/generate` client, with lean connections of its own where they work."""
        state = self._open
        client = state.engine_generators.get(url)
        if client is None:
            pool = None
            if self._lean_generate and GeneratePool.supports(url):
                pool = GeneratePool(url, headers=self._headers, max_idle=self._concurrency)
                state.engine_pools.append(pool)
            client = EngineClient(url, state.session, counters=self._counters, generate_pool=pool, **self._client_kw)
            state.engine_generators[url] = client
        return client

    async def _check_routed_experts(self) -> None:
        """Make sure R3's fields reach the engines and are answered, before the first sample asks.

        Behind a router: one R3 request through it; if its answer has no routes, the same request
        to an engine, and if that one has them, the router drops the fields and /generate goes to
        the engines from now on. An engine that answers none itself (SGLang without
        --enable-return-routed-experts), or cannot be reached, is refused by name: otherwise every
        sample would fail, one by one, until the run gave up."""
        state = self._open
        rid = f"r3-probe-{uuid.uuid4().hex}"  # unique: Ray producers probe the same engines at once
        if self._router_url is not None:
            router = state.generator
            answer = await router.generate(_PROBE_INPUT, _PROBE_PARAMS, rid=rid, return_logprob=False, **_R3_FIELDS)
            if answer.routed_experts is not None:
                return  # the router passes the fields on: it places every request, as before
            if not state.workers:
                raise EngineError(
                    router.url,
                    f"the router drops return_routed_experts ({_ROUTERS_THAT_DROP}), and lists no engine to "
                    "send R3 requests to directly",
                )
        engine = state.workers[0].url if state.workers else state.generator.url
        client = self._engine_generator(engine) if self._router_url is not None else state.generator
        try:
            direct = await client.generate(
                _PROBE_INPUT, _PROBE_PARAMS, rid=rid + "-engine", return_logprob=False, **_R3_FIELDS
            )
        except EngineUnavailableError as exc:
            if self._router_url is None:
                raise
            raise EngineUnavailableError(
                self._router_url,
                f"the router drops return_routed_experts ({_ROUTERS_THAT_DROP}), and its engine {engine} "
                f"cannot be reached from here to send R3 requests to directly ({exc}): put a router that "
                "passes it on in front of the engines, or give the engines' own URLs (--sglang-url, repeated)",
            ) from exc
        if direct.routed_experts is None:
            raise EngineError(
                engine,
                "answers without meta_info.routed_experts although return_routed_experts was asked: "
                "start SGLang with --enable-return-routed-experts, and serve an MoE model",
            )
        if self._router_url is not None:
            state.picker = EnginePicker(self._concurrency)
            log.warning(
                "the router drops R3's return_routed_experts: /generate goes to the engines directly",
                router=self._router_url,
                engines=len(state.workers),
                routers=_ROUTERS_THAT_DROP,
            )

    # -- control calls reach every engine -----------------------------------------------------

    async def abort(self, rid: str) -> None:
        self._abort_waiting(rid)
        # The router does not forward aborts and does not say where it sent a request.
        await self._fan_out("abort", lambda w: w.abort(rid))

    async def abort_all(self) -> None:
        self._abort_waiting(None)
        await self._fan_out("abort_all", lambda w: w.abort_all())

    @property
    def _monitor(self) -> FleetFaults | LivenessWatch | None:
        """What must know that a publish has the engines quiet: the heartbeat, or the watch."""
        return self._faults if self._faults is not None else self._watch

    async def pause(self, mode: PauseMode | str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {[str(m) for m in PAUSE_MODES]}, got {mode!r}")
        if (monitor := self._monitor) is not None:
            monitor.paused = True  # /health_generate answers 503 while paused: /health, or no probe
        await self._fan_out("pause", lambda w: w.pause(mode))

    async def continue_generation(self) -> None:
        await self._fan_out("continue_generation", lambda w: w.continue_generation())
        if (monitor := self._monitor) is not None:
            monitor.paused = False

    async def flush_cache(self, deadline: float) -> None:
        await self._fan_out("flush_cache", lambda w: w.flush_cache(deadline))

    async def update_weights_from_disk(self, path: str, *, weight_version: str, flush_cache: bool = True) -> None:
        path = folder_for_engine(path)  # absolute now: a re-admitted engine loads it later, from anywhere
        if self._faults is not None:
            # Under the re-admission lock: an engine coming back either is live before this fan-out
            # starts (and takes these weights with it) or loads them itself after it ends.
            async with self._faults.weights_lock:
                with self._faults.updating_weights():
                    await self._fan_out(
                        "update_weights_from_disk",
                        lambda w: w.update_weights_from_disk(
                            path, weight_version=weight_version, flush_cache=flush_cache
                        ),
                    )
                self._faults.current_weights = (path, weight_version)
            return
        with self._watch.updating_weights() if self._watch is not None else nullcontext():
            await self._fan_out(
                "update_weights_from_disk",
                lambda w: w.update_weights_from_disk(path, weight_version=weight_version, flush_cache=flush_cache),
            )

    async def init_weights_update_group(
        self, *, master_address: str, master_port: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """Every engine joins the weight-update group; engine i (in worker order) at rank i + 1."""
        ranks = {w.url: i + 1 for i, w in enumerate(self._open.workers)}
        await self._fan_out(
            "init_weights_update_group",
            lambda w: w.init_weights_update_group(
                master_address=master_address,
                master_port=master_port,
                rank_offset=ranks[w.url],
                world_size=world_size,
                group_name=group_name,
                backend=backend,
            ),
        )

    async def update_weights_from_distributed(
        self, specs: Sequence[Any], *, group_name: str, weight_version: str | None, flush_cache: bool
    ) -> None:
        if self._faults is not None:
            with self._faults.updating_weights():
                await self._fan_out(
                    "update_weights_from_distributed",
                    lambda w: w.update_weights_from_distributed(
                        specs, group_name=group_name, weight_version=weight_version, flush_cache=flush_cache
                    ),
                )
            return
        with self._watch.updating_weights() if self._watch is not None else nullcontext():
            await self._fan_out(
                "update_weights_from_distributed",
                lambda w: w.update_weights_from_distributed(
                    specs, group_name=group_name, weight_version=weight_version, flush_cache=flush_cache
                ),
            )

    async def update_weights_from_tensor(
        self, entry: str, *, tp_sizes: Mapping[str, int], weight_version: str | None, flush_cache: bool
    ) -> None:
        """One bucket to every engine by CUDA IPC: `entry` (a serialized bucket) once per TP rank of
        each engine, as SGLang reads it (`stages.sglang_client.publish_tensor`)."""
        await self._fan_out(
            "update_weights_from_tensor",
            lambda w: w.update_weights_from_tensor(
                [entry] * tp_sizes.get(w.url, 1), weight_version=weight_version, flush_cache=flush_cache
            ),
        )

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self._fan_out("release_memory_occupation", lambda w: w.release_memory_occupation(tags))

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self._fan_out("resume_memory_occupation", lambda w: w.resume_memory_occupation(tags))

    async def tp_sizes(self) -> dict[str, int]:
        return await self._fan_out("tp_size", lambda w: w.tp_size())

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._fan_out("destroy_weights_update_group", lambda w: w.destroy_weights_update_group(group_name))

    async def update_weight_version(self, weight_version: str) -> None:
        if self._faults is not None:
            async with self._faults.weights_lock:
                await self._fan_out("update_weight_version", lambda w: w.update_weight_version(weight_version))
                self._faults.current_weights = (self._faults.current_weights[0], weight_version)
            return
        await self._fan_out("update_weight_version", lambda w: w.update_weight_version(weight_version))

    async def weight_versions(self) -> dict[str, str]:
        return await self._fan_out("weight_version", lambda w: w.weight_version())

    async def loads(self) -> dict[str, EngineLoad]:
        return await self._fan_out("loads", lambda w: w.loads())

    async def wait_healthy(self, deadline: float) -> None:
        await self._fan_out("wait_healthy", lambda w: w.wait_healthy(deadline))

    async def _fan_out(self, what: str, call: Callable[[EngineClient], Awaitable[T]]) -> dict[str, T]:
        """Run `call` on every worker at once. Every worker gets the call even if another fails;
        then any failure is raised, naming each worker that failed."""
        workers = self._open.workers
        results: dict[str, T] = {}
        failures: dict[str, EngineError] = {}

        async def one(worker: EngineClient) -> None:
            try:
                if self._faults is None:
                    results[worker.url] = await call(worker)
                    return
                with self._faults.cancelled_on_eviction(worker.url):
                    results[worker.url] = await call(worker)
            except EngineError as exc:
                failures[worker.url] = exc

        async with anyio.create_task_group() as tg:
            for worker in workers:
                tg.start_soon(one, worker)
        if self._faults is not None:
            # An unreachable engine is evicted and the call stands on the engines that live; an
            # engine evicted meanwhile (by the heartbeat) is no longer asked.
            failures = await self._faults.absorb(what, failures)
            self._faults.raise_if_lost()
            workers = tuple(w for w in workers if w.url in results or w.url in failures)
        if failures:
            raise _fan_out_error(what, failures, len(workers))
        return {w.url: results[w.url] for w in workers}


async def _close_pools(state: _FleetState) -> None:
    for pool in (state.generate_pool, *state.engine_pools):
        if pool is not None:
            await pool.aclose()


def _fan_out_error(what: str, failures: Mapping[str, EngineError], total: int) -> EngineError:
    first = next(iter(failures.values()))
    unreachable = all(isinstance(e, EngineUnavailableError) for e in failures.values())
    kind = EngineUnavailableError if unreachable else EngineError
    status = first.status if len(failures) == 1 else None
    detail = "; ".join(str(e) for e in failures.values())
    error = kind(", ".join(failures), f"{what} failed on {len(failures)} of {total} engines: {detail}", status=status)
    error.__cause__ = first
    return error

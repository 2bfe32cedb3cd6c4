"""The engines a run uses: the user's (`--sglang-url`, `--sglang-router-url`), or built-in ones
(or real SGLang servers) this process starts, behind the real sglang-router when there are
several, and stops on exit. The run and `python -m pipeline.eval` open them the same way. Before
the first request every engine serves the run's starting weights (`load_starting_weights`).
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import structlog

from core.errors import EngineError
from pipeline.config import Config, EngineConfig
from pipeline.config.derived import derived
from stages.sglang_client import EngineFleet
from stages.sglang_client.health import EngineRestarter, FaultPolicy

if TYPE_CHECKING:
    from launch.engine_restart import ManagedEngines

__all__ = [
    "COLOCATED_MEM_FRACTION",
    "RunEngines",
    "builtin_engine_args",
    "fault_policy",
    "load_starting_weights",
]

log = structlog.get_logger("launch")


def fault_policy(e: EngineConfig) -> FaultPolicy | None:
    if not e.use_fault_tolerance:
        return None
    return FaultPolicy(
        interval=e.health_check_interval,
        timeout=e.health_check_timeout,
        first_wait=e.health_check_first_wait,
        min_live=e.min_live_engines,
        max_restarts=e.max_engine_restarts,
    )


# A colocated built-in engine's share of the GPU (weights plus KV cache) unless
# --sglang-mem-fraction-static says: the trainer's parameters and optimizer state stay resident
# while the engine generates (BENCHMARKS.md, the colocated memory table).
COLOCATED_MEM_FRACTION = 0.4


def builtin_engine_args(e: EngineConfig) -> list[str]:
    """The flags a started built-in engine gets beyond those every engine gets."""
    args = ["--device", e.device]
    if e.colocate:
        fraction = e.sglang_mem_fraction_static or COLOCATED_MEM_FRACTION
        args += ["--enable-memory-saver", "--mem-fraction-static", str(fraction)]
    return args


class RunEngines:
    """The engines for this run: the user's, or built-in ones this process starts and stops."""

    def __init__(self, config: Config, model_path: Path) -> None:
        self._config = config
        self._model_path = model_path
        self._stack = AsyncExitStack()
        # Whether the engines are ones this process started on `model_path` (with --weight-version 0),
        # so that what they hold is known; the user's engines may hold anything.
        self.started_here = False

    async def __aenter__(self) -> EngineFleet:
        # What starts before a failure (engines, a router, the fleet's session) stops at once; on
        # success the stack moves to `self._stack`, which `__aexit__` closes.
        async with AsyncExitStack() as stack:
            fleet = await stack.enter_async_context(await self._open_fleet(stack))
            self._stack = stack.pop_all()
        return fleet

    async def _open_fleet(self, stack: AsyncExitStack) -> EngineFleet:
        """The fleet for the configured engines: the user's router, the user's engines, or engines
        this process starts; what it starts is stopped by `stack`."""
        e = self._config.engine
        policy = fault_policy(e)  # checked before anything starts
        if e.router_url:
            # The plan's slots: C x the engines behind it.
            return self._fleet(None, router_url=e.router_url, engines=e.num_engines, policy=policy)
        if e.urls:
            return await self._fleet_of(list(e.urls), stack, policy=policy)
        urls, restarter = await self._start_engines(stack)
        self.started_here = True
        return await self._fleet_of(urls, stack, policy=policy, restarter=restarter)

    async def _start_engines(self, stack: AsyncExitStack) -> tuple[list[str], ManagedEngines | None]:
        """Start the built-in engines (or real SGLang servers) on `model_path`; their URLs, and the
        restarter that replaces failed ones under fault tolerance (built-in engines only)."""
        from launch.builtin_engine import start_engines
        from launch.engine_restart import ManagedEngines

        e = self._config.engine
        slots = e.sglang_server_concurrency
        log_dir = Path(derived(self._config.output.dir, "output.dir")) / "logs"
        if e.launcher == "sglang":
            from launch.sglang_server import start_sglang_servers

            procs = await start_sglang_servers(
                self._model_path,
                engine=e,
                log_dir=log_dir,
                seed=self._config.rollout.seed,
                routed_experts=self._config.rollout.use_rollout_routing_replay,
            )
        else:
            procs = await start_engines(
                e.num_engines,
                self._model_path,
                host=e.host,
                max_running_requests=slots,
                log_dir=log_dir,
                extra_args=builtin_engine_args(e),
                api_key=e.api_key or None,
            )
        urls = [p.url for p in procs]
        if e.use_fault_tolerance and e.launcher != "sglang":
            # Restarted engines replace the started ones: stop whichever run at exit.
            managed = ManagedEngines(
                procs,
                self._model_path,
                host=e.host,
                max_running_requests=slots,
                extra_args=builtin_engine_args(e),
                api_key=e.api_key or None,
            )
            stack.push_async_callback(managed.stop)
            return urls, managed
        for proc in procs:
            stack.push_async_exit(proc)  # stopped on exit, whatever happens
        return urls, None

    async def _fleet_of(
        self,
        urls: list[str],
        stack: AsyncExitStack,
        *,
        policy: FaultPolicy | None,
        restarter: EngineRestarter | None = None,
    ) -> EngineFleet:
        """A fleet of the engines at `urls`: several need a router in front of them, which this
        process starts (and `stack` stops)."""
        from launch.router_process import start_router

        if len(urls) <= 1:
            return self._fleet(urls, router_url=None, engines=1, policy=policy, restarter=restarter)
        e = self._config.engine
        router = await start_router(urls, host=e.host, log_path=self._router_log(), api_key=e.api_key)
        stack.push_async_exit(router)
        return self._fleet(urls, router_url=router.url, engines=len(urls), policy=policy, restarter=restarter)

    def _fleet(
        self,
        urls: list[str] | None,
        *,
        router_url: str | None,
        engines: int,
        policy: FaultPolicy | None,
        restarter: EngineRestarter | None = None,
    ) -> EngineFleet:
        """The fleet with the run's request settings and `engines` x --sglang-server-concurrency slots."""
        e, rollout = self._config.engine, self._config.rollout
        return EngineFleet(
            urls,
            router_url=router_url,
            concurrency=e.sglang_server_concurrency * engines,
            request_timeout=rollout.request_timeout,
            max_retries=rollout.max_retries,
            api_key=e.api_key or None,  # sent as 'Authorization: Bearer KEY'
            fault_policy=policy,
            restarter=restarter,
            # R3: the fleet checks on entry that the engines answer routes, and behind a router
            # that it passes their fields on; where it does not (sglang-router 0.3.2) R3 requests
            # go to the engines directly.
            routed_experts=rollout.use_rollout_routing_replay,
            silence_warning=e.silence_warning,
        )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stack.__aexit__(exc_type, exc, tb)

    def _router_log(self) -> Path:
        logs = Path(derived(self._config.output.dir, "output.dir")) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        return logs / "router.log"


async def load_starting_weights(
    engines: EngineFleet, *, version: int, weights: Path, started_on_them: bool = False
) -> None:
    """Make every engine serve `weights` (the run's starting weights) as `version` before the first request.

    An engine's weights are what the run says they are, or the run loads them; a version is never
    relabelled onto weights nobody checked. A version label says nothing about which weights an
    engine holds: one reused from an earlier run reports that run's last version (its last
    weights); a fresh SGLang says "default" whatever `--model-path` it was given, and an engine
    whose weights moved without a version (an update from another client) says what it said
    before. So unless this process started the engines on `weights` (`started_on_them`: they
    report `version` and hold it), every engine loads `weights` from disk
    (`/update_weights_from_disk` with `weight_version`): one load at start-up, the price of
    knowing. An engine that cannot load them (the path is not readable where it runs) is
    named, with the version it reports and the fix.
    """
    want = str(version)
    reported = await engines.weight_versions()
    if started_on_them and all(v == want for v in reported.values()):
        engines.set_current_weights(None, want)  # a restarted engine starts from these weights itself
        return
    log.info(
        "loading the run's starting weights into the engines",
        weights=str(weights),
        version=want,
        reported=reported,
    )
    try:
        # With a fault policy the fleet remembers these as what a returning engine is made to load.
        await engines.update_weights_from_disk(str(weights), weight_version=want)
    except EngineError as exc:
        said = ", ".join(f"{url} reports weight_version {v!r}" for url, v in reported.items())
        raise EngineError(
            exc.url,
            f"the run starts from {weights} as weight_version {want!r} ({said}), and loading those weights "
            f"failed ({exc}). An engine is never relabelled to a version whose weights it may not hold: make "
            f"{weights} readable at that path where the engine runs, or leave out --sglang-url/"
            "--sglang-router-url to have the run start its own engines",
            status=exc.status,
        ) from exc

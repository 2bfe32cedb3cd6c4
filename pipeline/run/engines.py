"""The engines a run uses: the user's (`--sglang-url`, `--sglang-router-url`), or built-in ones
(or real SGLang servers) this process starts, behind the real sglang-router when there are
several, and stops on exit. The run and `python -m pipeline.eval` open them the same way.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

from core.errors import EngineError
from pipeline.config import Config, EngineConfig
from pipeline.config.derived import derived
from stages.sglang import EngineFleet
from stages.sglang.health import FaultPolicy

__all__ = ["COLOCATED_MEM_FRACTION", "RunEngines", "align_weight_versions", "builtin_engine_args", "fault_policy"]


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

    async def __aenter__(self) -> EngineFleet:
        from launch.engine_process import start_engines
        from launch.engine_restart import ManagedEngines
        from launch.router_process import start_router

        e = self._config.engine
        slots = e.sglang_server_concurrency
        timeout = self._config.rollout.request_timeout
        retries = self._config.rollout.max_retries
        key = e.api_key or None  # sent as 'Authorization: Bearer KEY'
        await self._stack.__aenter__()
        faults: dict[str, Any] = {"fault_policy": fault_policy(e), "silence_warning": e.silence_warning}
        # R3: the fleet checks on entry that the engines answer routes, and behind a router that
        # it passes their fields on; where it does not (sglang-router 0.3.2) R3 requests go to
        # the engines directly.
        r3 = self._config.rollout.use_rollout_routing_replay
        try:
            if e.router_url:
                fleet = EngineFleet(
                    router_url=e.router_url,
                    concurrency=slots * e.num_engines,  # the plan's slots: C x the engines behind it
                    request_timeout=timeout,
                    max_retries=retries,
                    api_key=key,
                    routed_experts=r3,
                    **faults,
                )
            elif len(e.urls) == 1:
                fleet = EngineFleet(
                    list(e.urls),
                    concurrency=slots,
                    request_timeout=timeout,
                    max_retries=retries,
                    api_key=key,
                    routed_experts=r3,
                    **faults,
                )
            elif e.urls:
                # Several engines need a router in front of them; the pipeline starts one.
                router = await start_router(list(e.urls), host=e.host, log_path=self._router_log(), api_key=e.api_key)
                self._stack.push_async_exit(router)
                fleet = EngineFleet(
                    list(e.urls),
                    router_url=router.url,
                    concurrency=slots * len(e.urls),
                    request_timeout=timeout,
                    max_retries=retries,
                    api_key=key,
                    routed_experts=r3,
                    **faults,
                )
            else:
                log_dir = Path(derived(self._config.output.dir, "output.dir")) / "logs"
                if e.launcher == "sglang":
                    from launch.sglang_server import start_sglang_servers

                    procs = await start_sglang_servers(
                        self._model_path,
                        engine=e,
                        log_dir=log_dir,
                        seed=self._config.rollout.seed,
                        routed_experts=r3,
                    )
                else:
                    procs = await start_engines(
                        e.num_engines,
                        self._model_path,
                        host=e.host,
                        max_running_requests=slots,
                        log_dir=log_dir,
                        extra_args=builtin_engine_args(e),
                        api_key=key,
                    )
                if e.use_fault_tolerance and e.launcher != "sglang":
                    # Restarted engines replace the started ones: stop whichever run at exit.
                    managed = ManagedEngines(
                        procs,
                        self._model_path,
                        host=e.host,
                        max_running_requests=slots,
                        extra_args=builtin_engine_args(e),
                        api_key=key,
                    )
                    self._stack.push_async_callback(managed.stop)
                    faults["restarter"] = managed
                else:
                    for proc in procs:
                        self._stack.push_async_exit(proc)  # stopped on exit, whatever happens
                urls = [p.url for p in procs]
                if len(urls) > 1:
                    router = await start_router(urls, host=e.host, log_path=self._router_log(), api_key=e.api_key)
                    self._stack.push_async_exit(router)
                    fleet = EngineFleet(
                        urls,
                        router_url=router.url,
                        concurrency=slots * len(urls),
                        request_timeout=timeout,
                        max_retries=retries,
                        api_key=key,
                        routed_experts=r3,
                        **faults,
                    )
                else:
                    fleet = EngineFleet(
                        urls,
                        concurrency=slots,
                        request_timeout=timeout,
                        max_retries=retries,
                        api_key=key,
                        routed_experts=r3,
                        **faults,
                    )
            return await self._stack.enter_async_context(fleet)
        except BaseException:
            await self._stack.aclose()
            raise

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


async def align_weight_versions(engines: EngineFleet, version: int) -> None:
    """Make every engine report `version` before the first request (a fresh SGLang says "default").

    Engines that already do are left alone; an engine too old for `/update_weight_version` is
    named, with the launch flag that fixes it.
    """
    reported = await engines.weight_versions()
    if all(v == str(version) for v in reported.values()):
        return
    try:
        await engines.update_weight_version(str(version))
    except EngineError as exc:
        if exc.status != 404:
            raise
        raise EngineError(
            exc.url,
            f"reports weight_version {reported} and has no /update_weight_version; "
            f"start it with --weight-version {version}",
            status=404,
        ) from exc

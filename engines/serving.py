"""Running an engine: serve an `EngineServer` on a port, and the command-line main every engine shares."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from aiohttp import web

from engines.http import EngineServer
from engines.length_tail import LengthTail
from engines.scheduler import EngineCore
from engines.seam import ModelForward

__all__ = ["open_engine", "run_main", "running"]

log = logging.getLogger(__name__)


class _DropHttp2Probes(logging.Filter):
    """The sglang-router probes each worker with an HTTP/2 preface before settling on HTTP/1.1;
    aiohttp logs every probe as an error with a traceback. They are expected, so drop them."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI/Upgrade" in str(exc))


_HTTP2_PROBE_FILTER = _DropHttp2Probes()


@asynccontextmanager
async def open_engine(
    model: ModelForward,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_running_requests: int = 64,
    weight_version: str = "0",
    random_seed: int | None = None,
    served_model_name: str | None = None,
    health_check_timeout: float = 20.0,
    routes: Callable[[EngineServer], list[web.RouteDef]] | None = None,
    length_tail: LengthTail | None = None,
    api_key: str | None = None,
    max_body_bytes: int | None = None,
) -> AsyncIterator[EngineServer]:
    """Schedule `model` behind the HTTP surface on host:port (port 0 picks a free one); yield the server.

    `routes` adds an engine's own endpoints (the simulated engine's `/sim/stats`); `api_key` and
    `max_body_bytes` guard every one of them (guards.py: None is no key, and the default bound)."""
    logging.getLogger("aiohttp.server").addFilter(_HTTP2_PROBE_FILTER)
    core = EngineCore(
        model,
        max_running_requests=max_running_requests,
        weight_version=weight_version,
        random_seed=random_seed,
        length_tail=length_tail,
    )
    server = EngineServer(
        core,
        host=host,
        port=port,
        served_model_name=served_model_name,
        health_check_timeout=health_check_timeout,
        random_seed=random_seed,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
    )
    if routes is not None:
        server.app.add_routes(routes(server))
    async with running(server, host, port):
        yield server


@asynccontextmanager
async def running(server: EngineServer, host: str, port: int) -> AsyncIterator[EngineServer]:
    """Run `server`'s core and HTTP app on host:port until the block ends, then close both.

    On exit every request in flight is aborted (clients get their partial output), then the listener
    and the loop stop."""
    async with anyio.create_task_group() as tg:
        await tg.start(server.core.run)
        app_runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
        await app_runner.setup()
        try:
            site = web.TCPSite(app_runner, host, port)
            await site.start()
            server.port = app_runner.addresses[0][1]
            yield server
        finally:
            with anyio.move_on_after(10, shield=True):
                server.core.close()
                await app_runner.cleanup()
            tg.cancel_scope.cancel()


def run_main(
    serve: Callable[..., Any],
    *,
    log_level: str,
    startup_errors: tuple[type[Exception], ...],
) -> int:
    """Run `serve` (an anyio task that calls `task_status.started(server)`) until SIGTERM or SIGINT.

    Startup errors of the given types (an unusable model folder, a port taken) are logged in one
    line each and give exit status 1, not a traceback."""
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    failed = False
    try:
        anyio.run(_run, serve)
    except* startup_errors as group:
        for exc in _leaves(group):
            log.error("%s", exc)
        failed = True
    if not failed:
        log.info("engine stopped")
    return 1 if failed else 0


async def _run(serve: Callable[..., Any]) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_signal, tg.cancel_scope)
        server = await tg.start(serve)
        log.info("The server is fired up and ready to roll! %s", server.url)


async def _cancel_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for sig in signals:
            log.info("received %s, shutting down", sig.name)
            scope.cancel()
            return


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]

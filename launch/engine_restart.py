"""`ManagedEngines`: restarts built-in engines the pipeline started, at the same URL.

The fleet calls it after it evicted an engine. The old process is killed outright (a hung engine,
e.g. SIGSTOPped, ignores SIGTERM and still holds its port and in-flight connections: killing it is
what hands those requests back, partial, to the pipeline), then a new one is started on the same
port, so the router and the fleet know it by the same URL.
"""

from __future__ import annotations

import os
from typing import Any

from launch.builtin_engine import EngineProcess, start_engine

__all__ = ["ManagedEngines"]


class ManagedEngines:
    def __init__(self, engines: list[EngineProcess], model_path: str | os.PathLike[str], **options: Any) -> None:
        self._by_url = {e.url: e for e in engines}
        self._model_path = model_path
        # What `start_engine` got the first time (max_running_requests, api_key, ...); host and port are the
        # old engine's, so the restarted one has its URL.
        self._options = {k: v for k, v in options.items() if k not in ("host", "port", "log_path")}

    def process(self, url: str) -> EngineProcess:
        return self._by_url[url]

    @property
    def processes(self) -> list[EngineProcess]:
        return list(self._by_url.values())

    async def __call__(self, url: str) -> None:
        old = self._by_url[url]
        if old.returncode is None:
            old.process.kill()
        await old.stop(timeout=5.0)
        self._by_url[url] = await start_engine(
            self._model_path, host=old.host, port=old.port, log_path=old.log_path, **self._options
        )

    async def stop(self) -> None:
        for engine in self._by_url.values():
            await engine.stop()

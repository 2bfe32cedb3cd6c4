"""The real `sglang-router` in front of several engines, run as a subprocess.

    async with await start_router([engine_a.url, engine_b.url]) as router:
        async with EngineFleet(router_url=router.url) as fleet: ...

`start_router` returns once the router lists every worker on `GET /workers` (about a second with
engines that are already up; engines still loading delay it), and fails with the tail of the
router's log if the process exits first or the deadline passes.

Flags chosen on purpose (checked against `python -m sglang_router.launch_router --help`, 0.3.2):
- `--prometheus-port` defaults to 29000 on 0.0.0.0: two routers on one host would clash, and it
  would listen on every interface. We pick a free port on 127.0.0.1 (port 0 is rejected).
- Health checks and the circuit breaker are off, as slime runs it: SGLang's `/health` can take
  20 s during a weight publish (pause), and the router would take every engine out of rotation.
- `--worker-startup-check-interval` defaults to 30 s; 1 s lets a router started beside loading
  engines become ready soon after they do.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import aiohttp
import anyio
import anyio.abc
import orjson

from core.errors import EngineError, EngineUnavailableError
from launch.builtin_engine import free_port
from launch.orphan_guard import guarded

__all__ = ["RouterProcess", "free_port", "start_router"]

_POLL_FIRST = 0.05
_POLL_MAX = 0.5
_PROBE_TIMEOUT = 2.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the router colours its log even into a file


class RouterProcess:
    """A running sglang-router. `stop()` (or leaving `async with`) ends it: SIGTERM, then kill."""

    def __init__(
        self,
        url: str,
        worker_urls: tuple[str, ...],
        process: anyio.abc.Process,
        log_path: Path,
        *,
        owns_log: bool,
    ) -> None:
        self.url = url
        self.worker_urls = worker_urls
        self.process = process
        self.log_path = log_path
        self._owns_log = owns_log

    def __repr__(self) -> str:
        return f"RouterProcess({self.url!r}, pid={self.process.pid}, workers={list(self.worker_urls)})"

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no router log)"
        return "\n".join(_ANSI.sub("", line) for line in text.splitlines()[-lines:])

    async def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM, wait up to `grace` seconds, then SIGKILL. Returns the exit code. Shielded:
        it also runs to the end while the caller is being cancelled."""
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                try:
                    self.process.terminate()
                except ProcessLookupError:
                    pass
                with anyio.move_on_after(grace):
                    await self.process.wait()
                if self.process.returncode is None:
                    try:
                        self.process.kill()
                    except ProcessLookupError:
                        pass
                    with anyio.move_on_after(5):
                        await self.process.wait()
            with anyio.move_on_after(2):
                await self.process.aclose()
            if self._owns_log:
                self.log_path.unlink(missing_ok=True)
        return self.process.returncode

    async def __aenter__(self) -> RouterProcess:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def start_router(
    worker_urls: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    policy: str = "round_robin",
    startup_timeout: float = 60.0,
    request_timeout: float = 3600.0,
    prometheus_port: int | None = None,
    health_checks: bool = False,
    log_path: Path | None = None,
    extra_args: Sequence[str] = (),
    api_key: str | None = None,
) -> RouterProcess:
    """Start `python -m sglang_router.launch_router` for `worker_urls` and wait until it routes to all.

    `request_timeout` is the router's own limit on one proxied request (its default, 30 min, is
    shorter than a long generation can take). `log_path` keeps the router's output; by default it
    goes to a temporary file that `stop()` deletes.
    """
    workers = tuple(u.rstrip("/") for u in worker_urls)
    if not workers:
        raise ValueError("a router needs at least one worker URL")
    port = free_port(host) if port is None else port
    prometheus_port = free_port("127.0.0.1") if prometheus_port is None else prometheus_port
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    command = [
        *guarded(), sys.executable, "-m", "sglang_router.launch_router",
        "--host", host,
        "--port", str(port),
        "--worker-urls", *workers,
        "--policy", policy,
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(prometheus_port),
        "--request-timeout-secs", str(math.ceil(request_timeout)),
        "--worker-startup-timeout-secs", str(math.ceil(startup_timeout)),
        "--worker-startup-check-interval", "1",
        "--shutdown-grace-period-secs", "1",
        "--log-level", "warn",
    ]  # fmt: skip
    if not health_checks:
        command += ["--disable-health-check", "--disable-circuit-breaker"]
    if api_key:  # the router then wants it on every request, and passes it on to the workers
        command += ["--api-key", api_key]
    command += list(extra_args)

    owns_log = log_path is None
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="sglang-router-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    with open(log_path, "wb") as log:  # noqa: ASYNC230 - a local log opens at once; the child keeps its own copy of the fd
        process = await anyio.open_process(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    router = RouterProcess(url, workers, process, log_path, owns_log=owns_log)
    try:
        await _wait_ready(router, startup_timeout, api_key)
    except BaseException:
        await router.stop(grace=2.0)  # the error already carries the log's tail
        raise
    return router


async def _wait_ready(router: RouterProcess, deadline: float, api_key: str | None = None) -> None:
    """Poll `GET /workers` until it lists every worker: waiting for another process to start."""
    end = anyio.current_time() + deadline
    delay = _POLL_FIRST
    listed: set[str] = set()
    last = "no answer yet"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api_key}"} if api_key else None) as session:
        while True:
            if router.process.returncode is not None:
                raise EngineError(
                    router.url,
                    f"sglang-router exited with code {router.process.returncode} before it was ready:\n"
                    f"{router.log_tail()}",
                )
            left = end - anyio.current_time()
            if left <= 0:
                raise EngineUnavailableError(
                    router.url,
                    f"sglang-router not ready within {deadline:g} s (listed {sorted(listed)} of "
                    f"{list(router.worker_urls)}; last: {last}):\n{router.log_tail()}",
                )
            try:
                timeout = aiohttp.ClientTimeout(total=min(_PROBE_TIMEOUT, left))
                async with session.get(router.url + "/workers", timeout=timeout) as resp:
                    body = await resp.read()
                    status = resp.status
            except (TimeoutError, aiohttp.ClientError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if status == 200:
                    listed = _listed_workers(body)
                    if listed >= set(router.worker_urls):
                        return
                    last = f"{len(listed)} of {len(router.worker_urls)} workers listed"
                else:
                    last = f"HTTP {status}"
            await anyio.sleep(min(delay, max(0.0, end - anyio.current_time())))
            delay = min(delay * 2, _POLL_MAX)


def _listed_workers(body: bytes) -> set[str]:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return set()
    rows = doc.get("workers") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        return set()
    return {str(w["url"]).rstrip("/") for w in rows if isinstance(w, dict) and "url" in w and w.get("is_healthy", True)}

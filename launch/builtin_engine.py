"""Start built-in engine servers as subprocesses and stop them again.

    async with await start_engine(model_dir) as engine:      # waits until /health_generate is 200
        ...  engine.url ...
    engines = await start_engines(4, model_dir)               # concurrently; all or none

Each engine's stdout and stderr go to a log file (a pipe nobody reads would fill up and stall the
server); when an engine dies during startup the error carries the tail of that log.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import anyio
from anyio.abc import Process

from core.errors import EngineUnavailableError
from launch.orphan_guard import guarded

__all__ = ["EngineProcess", "free_port", "start_engine", "start_engines"]

_LOG_TAIL_CHARS = 4000
# Engine children import `launch` from this checkout: see `start_engine`.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (another process could still take it before we do)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EngineProcess:
    """A running `python -m engines.builtin`. Stop it with `stop()` or by leaving `async with`."""

    def __init__(self, process: Process, *, host: str, port: int, log_path: Path, own_log: bool) -> None:
        self.process = process
        self.host, self.port = host, port
        self.log_path = log_path
        self._own_log = own_log  # a temp file we created and remove after a clean stop

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def log_tail(self, chars: int = _LOG_TAIL_CHARS) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-chars:].decode("utf-8", "replace")

    async def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to `timeout`, then SIGKILL. Safe to call twice. Returns the exit code."""
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                try:
                    self.process.send_signal(signal.SIGTERM)
                    # A stopped engine (SIGSTOP) acts on SIGTERM only once continued; otherwise
                    # its stop would wait out the whole timeout before the SIGKILL.
                    self.process.send_signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass
                with anyio.move_on_after(timeout):
                    await self.process.wait()
                if self.process.returncode is None:
                    self.process.kill()
                    with anyio.move_on_after(timeout):
                        await self.process.wait()
            await self.process.aclose()
            if self._own_log and self.process.returncode == 0:
                self.log_path.unlink(missing_ok=True)
        return self.process.returncode

    async def __aenter__(self) -> EngineProcess:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def __repr__(self) -> str:
        return f"EngineProcess(pid={self.pid}, url={self.url}, returncode={self.returncode})"


async def start_engine(
    model_path: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    max_running_requests: int = 64,
    weight_version: str = "0",
    extra_args: Sequence[str] = (),
    startup_timeout: float = 120.0,
    log_path: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    module: str = "engines.builtin",
    api_key: str | None = None,
) -> EngineProcess:
    """Spawn a built-in engine and wait until `/health_generate` answers 200.

    `module` picks the server: the built-in engine, or `engines.sim` (the simulated one,
    which takes the same flags and only reports `model_path`). With `api_key` the engine
    answers only requests that carry it (SGLang's `--api-key`), and the readiness probe sends it.

    Raises EngineUnavailableError if the process exits first (with its log tail) or the deadline
    passes; the process is stopped in both cases. A port picked here that another process grabbed
    before the engine bound it is replaced by a fresh one (up to 3 tries).
    """
    for attempt in range(3):
        chosen = port if port is not None else free_port(host)
        own_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"engine-{chosen}-", suffix=".log")
            os.close(fd)
            path = Path(name)
        else:
            path = Path(log_path)
        cmd = [
            *guarded(), sys.executable, "-m", module,
            "--model-path", str(model_path),
            "--host", host,
            "--port", str(chosen),
            "--max-running-requests", str(max_running_requests),
            "--weight-version", str(weight_version),
            *(["--api-key", api_key] if api_key else []),
            *extra_args,
        ]  # fmt: skip
        child_env = {**os.environ, **(env or {})}
        if "--enable-memory-saver" in extra_args and module == "engines.builtin":
            # The memory saver's allocation hook must be preloaded when the engine starts; set
            # here, the engine need not start a second time to set it itself (engines/builtin.py).
            child_env.update(_memory_saver_preload())
        # The child imports `launch` from wherever this module lives, even if cwd is elsewhere.
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, child_env.get("PYTHONPATH")) if p)
        with open(path, "ab") as log_file:  # noqa: ASYNC230 - the child needs a real fd; a local log opens at once
            process = await anyio.open_process(cmd, stdin=None, stdout=log_file, stderr=log_file, env=child_env)
        engine = EngineProcess(process, host=host, port=chosen, log_path=path, own_log=own_log)
        try:
            await _wait_ready(engine, startup_timeout, api_key)
        except EngineUnavailableError:
            await engine.stop(timeout=5.0)
            if port is None and attempt < 2 and "address already in use" in engine.log_tail():
                if own_log:
                    path.unlink(missing_ok=True)
                continue
            raise
        except BaseException:
            await engine.stop(timeout=5.0)
            raise
        return engine
    raise AssertionError("unreachable")


def _memory_saver_preload() -> dict[str, str]:
    """LD_PRELOAD (and the CUDA runtime's folder) for an engine started with --enable-memory-saver;
    empty when the package is missing here (the engine then says so itself)."""
    from engines.memory_saver import preload_environment

    env = preload_environment()
    if env is None:
        return {}
    return {k: env[k] for k in ("LD_PRELOAD", "LD_LIBRARY_PATH") if k in env}


async def _wait_ready(engine: EngineProcess, timeout: float, api_key: str | None = None) -> None:
    # Polling is the only signal a separate process gives; each probe has its own short deadline.
    deadline = time.monotonic() + timeout
    probe = aiohttp.ClientTimeout(total=5.0)
    # SGLang lets the health probes through without the key; sent anyway, like every other call.
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(timeout=probe, headers=headers) as session:
        while True:
            if engine.returncode is not None:
                raise EngineUnavailableError(
                    engine.url,
                    f"the engine exited with code {engine.returncode} during startup; log tail:\n{engine.log_tail()}",
                )
            try:
                async with session.get(engine.url + "/health_generate") as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise EngineUnavailableError(
                    engine.url,
                    f"not healthy after {timeout:.0f}s; log tail:\n{engine.log_tail()}",
                )
            await anyio.sleep(0.2)


async def start_engines(
    n: int, model_path: str | os.PathLike[str], *, log_dir: str | os.PathLike[str] | None = None, **options: Any
) -> list[EngineProcess]:
    """Start `n` engines concurrently, each on its own free port. If any fails, all are stopped.

    With `log_dir`, engine i writes `log_dir/engine-i.log` (kept); otherwise each logs to a temp
    file removed after a clean stop.
    """
    if "port" in options or "log_path" in options:
        raise ValueError("start_engines picks a port and a log file per engine; pass neither")
    if log_dir is not None:
        await anyio.Path(log_dir).mkdir(parents=True, exist_ok=True)
    engines: list[EngineProcess | None] = [None] * n
    errors: list[Exception] = []

    async def one(i: int) -> None:
        try:
            log_path = Path(log_dir) / f"engine-{i}.log" if log_dir is not None else None
            engines[i] = await start_engine(model_path, log_path=log_path, **options)
        except Exception as exc:  # collected so the caller gets the error itself, not a group
            errors.append(exc)

    try:
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
    finally:
        if errors or any(e is None for e in engines):  # failed, or cancelled part way
            with anyio.CancelScope(shield=True):
                for e in engines:
                    if e is not None:
                        await e.stop(timeout=5.0)
    if errors:
        raise errors[0]
    return [e for e in engines if e is not None]

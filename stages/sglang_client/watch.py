"""`LivenessWatch`: without fault tolerance, says out loud that an engine stopped answering while
requests wait on it.

Without `--use-fault-tolerance` nothing evicts an engine, and a hung one (SIGSTOPped, a wedged GPU)
holds its requests until `--rollout-request-timeout` passes: 600 s by default, during which the run
used to say nothing at all. While requests are outstanding, each engine's `/health` is asked every
`silence / 6` seconds (one probe in flight per engine, each with a `silence` deadline); an engine
that has not answered for `silence` seconds is named in one warning, and again when it answers.
Any answer counts, a 503 too: the process is alive and serving HTTP. Nothing is probed while a
publish has the engines quiet (paused, or loading weights), when SGLang's health answer waits for
output that will not come; the publish's own calls have deadlines (the continue's is 30 s).

It reports, nothing more. The user opted out of eviction, and an engine that is slow but still
answers is not hung: `--rollout-request-timeout` stays the bound, and what happens when a request
passes it is the fleet's to decide (`EngineFleet.generate`: the run stops, naming the engine,
rather than send the request to it again; `request_timed_out` says why, in the watch's words).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Self

import anyio
import anyio.abc
import structlog

from core.errors import EngineLostError, EngineUnavailableError
from stages.sglang_client.engine_client import EngineClient

__all__ = ["LivenessWatch", "request_timed_out"]

log = structlog.get_logger(__name__)

# Probes per silence: an engine that stops right after answering is named at most `silence` later.
_PROBES_PER_SILENCE = 6


class LivenessWatch:
    """Probes `workers()` while requests wait and names the silent ones (see the module docstring).

    The fleet counts its outstanding `/generate` requests here (`request_started`, `request_ended`),
    marks a publish's quiet stretches (`paused`, `updating_weights`), and asks `silent_for` when a
    request timed out, to say whether its engine is hung or only slow.
    """

    def __init__(
        self,
        workers: Callable[[], tuple[EngineClient, ...]],
        *,
        silence: float,
        request_timeout: float,
        via_router: bool,
    ) -> None:
        if silence <= 0:
            raise ValueError(f"the liveness watch's silence must be > 0 seconds, got {silence}")
        self._workers = workers
        self.silence = silence
        self._interval = silence / _PROBES_PER_SILENCE
        self._request_timeout = request_timeout
        self._via_router = via_router
        self._waiting = 0  # /generate requests outstanding
        self._paused = False
        self._updating = 0
        self._watching = anyio.Event()  # set while requests wait and the engines are not quiet
        self._since = 0.0  # when the current watched stretch began: no engine is silent before it
        self._answered: dict[str, float] = {}  # url -> when it last answered a probe
        self._last_error: dict[str, str] = {}
        self._probing: set[str] = set()
        self._reported: set[str] = set()
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> Self:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._run)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        tg, self._tg = self._tg, None
        if tg is not None:
            tg.cancel_scope.cancel()
            await tg.__aexit__(exc_type, exc, tb)

    # -- what the fleet tells it ----------------------------------------------------------------

    def request_started(self) -> None:
        self._waiting += 1
        if self._waiting == 1:
            self._changed()

    def request_ended(self) -> None:
        self._waiting -= 1
        if self._waiting == 0:
            self._changed()

    @property
    def paused(self) -> bool:
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        """Set by the fleet's pause and continue: between them a publish has the engines quiet."""
        self._paused = value
        self._changed()

    @contextmanager
    def updating_weights(self) -> Iterator[None]:
        """Around a weight update (an overlapped publish loads weights without a pause)."""
        self._updating += 1
        self._changed()
        try:
            yield
        finally:
            self._updating -= 1
            self._changed()

    def silent_for(self, url: str) -> float | None:
        """Seconds since `url` last answered, when that is at least `silence` (else None)."""
        if not self._watching.is_set():
            return None
        silent = anyio.current_time() - max(self._answered.get(url, self._since), self._since)
        return silent if silent >= self.silence else None

    def silent_engines(self) -> dict[str, float]:
        """Every engine silent for at least `silence` seconds now, and for how long."""
        return {w.url: s for w in self._workers() if (s := self.silent_for(w.url)) is not None}

    # -- the watch ------------------------------------------------------------------------------

    def _changed(self) -> None:
        watched = self._waiting > 0 and not self._paused and self._updating == 0
        if watched and not self._watching.is_set():
            # Nothing was asked while idle or quiet: every engine's silence starts counting now.
            self._since = anyio.current_time()
            self._watching.set()
        elif not watched and self._watching.is_set():
            self._watching = anyio.Event()

    async def _run(self) -> None:
        while True:
            await self._watching.wait()
            assert self._tg is not None
            for client in self._workers():
                if client.url not in self._probing:
                    self._probing.add(client.url)
                    self._tg.start_soon(self._probe, client)
                silent = self.silent_for(client.url)
                if silent is not None and client.url not in self._reported:
                    self._reported.add(client.url)
                    self._report(client.url, silent)
            await anyio.sleep(self._interval)

    async def _probe(self, client: EngineClient) -> None:
        try:
            await client.probe("/health", self.silence)
        except EngineUnavailableError as exc:
            self._last_error[client.url] = str(exc)
            return
        finally:
            self._probing.discard(client.url)
        now = anyio.current_time()
        if client.url in self._reported:
            self._reported.discard(client.url)
            log.warning(
                f"engine {client.url} answers /health again after "
                f"{now - max(self._answered.get(client.url, self._since), self._since):.0f} s"
            )
        self._answered[client.url] = now

    def _report(self, url: str, silent: float) -> None:
        where = "the router's engines" if self._via_router else "it"
        last = self._last_error.get(url)
        log.warning(
            f"engine {url} has not answered /health for {silent:.0f} s while {self._waiting} requests wait on "
            f"{where} (SIGSTOPped? overloaded?); without --use-fault-tolerance it is not evicted: each request "
            f"waits up to --rollout-request-timeout={self._request_timeout:g} s, then the run stops, naming it"
            + (f" (last probe: {last})" if last else "")
        )


def request_timed_out(
    url: str, *, router_url: str | None, deadline: float, silent: Mapping[str, float] | None
) -> EngineLostError:
    """Why a `/generate` to `url` (the only engine, or the router) got no answer within `deadline`,
    and the fix: hung when the watch finds its engine `silent` (url -> seconds), else slow. None:
    no watch ran, so nothing is known about `/health`."""
    within = f"within --rollout-request-timeout={deadline:g} s"
    fix = (
        "run with --use-fault-tolerance (a built-in engine is then restarted on its port; yours is evicted "
        "and waited for)"
    )
    slow = "raise --rollout-request-timeout, or lower --rollout-max-response-len"
    if router_url is None:
        if silent is None:
            said = f"a /generate got no answer {within}; the request is not sent to it again: {slow}, or {fix}"
        elif url in silent:
            said = (
                f"a /generate got no answer {within}, and /health none for {silent[url]:.0f} s: the engine is "
                f"hung (SIGSTOPped? a wedged GPU?); the request is not sent to it again: restart it, or {fix}"
            )
        else:
            said = f"answers /health, but a /generate got no answer {within}; it is not sent the request again: {slow}"
        return EngineLostError(url, said)
    if silent:
        named = ", ".join(f"{u} (none for {s:.0f} s)" for u, s in silent.items())
        return EngineLostError(
            next(iter(silent)),
            f"a /generate through the router {url} got no answer {within}, and engines behind it do not answer "
            f"/health: {named}; the request is not sent through the router again, which routes to them still: "
            f"restart them, or {fix}",
        )
    known = "" if silent is None else ", though every engine behind it answers /health"
    return EngineLostError(
        url, f"a /generate got no answer {within}{known}; the request is not sent again: {slow}, or {fix}"
    )

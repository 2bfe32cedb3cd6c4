"""`FleetFaults`: eviction, heartbeat, restart and re-admission for one `EngineFleet`.

Lives as long as the fleet's `async with`: it owns a task group with the heartbeat and one
recovery task per evicted engine. When fewer than `min_live` engines are live and no restart can
bring one back (an engine the user runs, or every restart failed), `EngineLostError` is raised
from that task group, which ends the run with the error (and its engines named), and to every
request waiting for an engine. While a restart is under way the run waits for it: the single
engine of a quick start is restarted, not given up on.

Order on the way back matters: an engine takes the current weights and version first, is put back
behind the router next, and only then joins the fan-out; `weights_lock` keeps a publish's weight
update and a re-admission from crossing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Protocol, Self
from urllib.parse import quote, urlencode

import anyio
import anyio.abc
import structlog

from core.errors import EngineError, EngineLostError, EngineUnavailableError
from stages.sglang_client.engine_client import EngineClient
from stages.sglang_client.health import (
    EngineRestarter,
    FaultCounters,
    FaultPolicy,
    FaultStatistics,
)

__all__ = ["FleetFaults", "Roster"]

log = structlog.get_logger(__name__)

_ROUTER_LIST_DEADLINE = 30.0
# How long SGLang's /health_generate waits for output before it answers 503 (its
# SGLANG_HEALTH_CHECK_TIMEOUT, default 20 s); ~0.5.x serves /health the same way.
_SGLANG_HEALTH_WAIT = 20.0
_LEGACY = "_legacy"  # marks a row listed by a router up to 0.2.1, which has no /workers


class Roster(Protocol):
    """The fleet as its fault handling sees it (`EngineFleet` is one): which engines are live, a
    client for any engine, and the router when there is one."""

    @property
    def workers(self) -> tuple[EngineClient, ...]:
        """The live engines: the ones control calls fan out to."""
        ...

    def set_workers(self, workers: tuple[EngineClient, ...]) -> None:
        """Make `workers` the live engines (an eviction takes one out, a re-admission puts it back)."""
        ...

    @property
    def router_url(self) -> str | None: ...

    @property
    def router(self) -> EngineClient:
        """The client of the router (only asked for when `router_url` is set)."""
        ...

    def client_for(self, url: str) -> EngineClient: ...


class FleetFaults:
    def __init__(self, fleet: Roster, policy: FaultPolicy, restarter: EngineRestarter | None) -> None:
        self._fleet = fleet
        self.policy = policy
        self._restarter = restarter
        self.counters = FaultCounters()
        self._paused = False
        self._updating = 0  # weight updates under way: SGLang's health probes stall meanwhile
        self._unpaused = anyio.Event()
        self._unpaused.set()
        self.weights_lock = anyio.Lock()
        self.current_weights: tuple[str | None, str | None] = (None, None)  # (path, version) last published
        self._scopes: dict[str, set[anyio.CancelScope]] = {}
        self._total = 0
        self._tg: anyio.abc.TaskGroup | None = None
        # Re-admissions per URL: a failure seen by a request sent before the last one is old news.
        self._admissions: dict[str, int] = {}
        self._back = anyio.Event()  # set (and replaced) when an engine comes back or none will
        self._lost: tuple[str, str] | None = None  # (url, why): the run ends with EngineLostError

    async def __aenter__(self) -> Self:
        self._total = len(self._fleet.workers)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._heartbeat)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        tg, self._tg = self._tg, None
        if tg is not None:
            tg.cancel_scope.cancel()
            await tg.__aexit__(exc_type, exc, tb)

    @property
    def paused(self) -> bool:
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        """Set by the fleet's pause and continue: between them a publish is under way."""
        self._paused = value
        if value and self._unpaused.is_set():
            self._unpaused = anyio.Event()
        elif not value:
            self._unpaused.set()

    @contextmanager
    def updating_weights(self) -> Iterator[None]:
        """Around a weight update's fan-out: SGLang holds its model-update lock while it loads, no
        output arrives, and `/health_generate` answers 503 after 20 s (an overlapped publish
        does not pause), so the heartbeat treats the engines as it does while paused."""
        self._updating += 1
        try:
            yield
        finally:
            self._updating -= 1

    def statistics(self) -> FaultStatistics:
        live = len(self._fleet.workers) if self._tg is not None else 0
        return self.counters.snapshot(live)

    # -- eviction -----------------------------------------------------------------------------

    @contextmanager
    def cancelled_on_eviction(self, url: str) -> Iterator[None]:
        """A control call to `url` that eviction cancels: a hung engine never answers it."""
        with anyio.CancelScope() as scope:
            self._scopes.setdefault(url, set()).add(scope)
            try:
                yield
            finally:
                self._scopes[url].discard(scope)

    async def absorb(self, what: str, failures: Mapping[str, EngineError]) -> dict[str, EngineError]:
        """Evict every engine a fan-out found unreachable; return the failures that remain errors."""
        kept: dict[str, EngineError] = {}
        for url, exc in failures.items():
            if isinstance(exc, EngineUnavailableError):
                await self.evict(url, f"{what}: {exc}")
            else:
                kept[url] = exc
        return kept

    async def evict(self, url: str, reason: str, *, admitted: int | None = None) -> None:
        """Take `url` out at once: no new control calls, its running ones cancelled, out of the
        router; then restart or wait for it. `admitted`: the engine's `admissions` when the
        failing call was sent (a later re-admission makes that failure old news).

        When fewer than `min_live` engines remain and no restart is coming, the run ends
        (`lost`); with a restart coming, it waits for the restart to succeed or run out of tries.
        """
        state_workers = self._fleet.workers
        if url not in {w.url for w in state_workers}:
            return
        if admitted is not None and admitted != self._admissions.get(url, 0):
            return
        live = tuple(w for w in state_workers if w.url != url)
        self._fleet.set_workers(live)
        self.counters.evictions += 1
        self.counters.capacity(len(live), self._total)
        for scope in self._scopes.get(url, ()):
            scope.cancel()
        restarting = self._restarter is not None and self.policy.max_restarts > 0
        fewer = len(live) < self.policy.min_live
        then = "restarting it on its port" if restarting else ("the run stops" if fewer else "waiting for it")
        # The one line a fault prints (its requests come back quietly, as aborted ones).
        log.warning("engine evicted", url=url, reason=reason, live=len(live), total=self._total, then=then)
        if fewer and not restarting:
            self._lose(url, f"evicted ({reason}); {self._below_min(len(live))}")
            return
        if self._fleet.router_url is not None:
            await self._router_remove(url)
        if self._tg is not None:
            self._tg.start_soon(self._recover, url, reason)

    def _below_min(self, live: int) -> str:
        return f"{live} of {self._total} engines live, fewer than --min-live-engines {self.policy.min_live}"

    def admissions(self, url: str) -> int:
        """How often `url` came back: what `evict(admitted=...)` compares."""
        return self._admissions.get(url, 0)

    @property
    def lost(self) -> bool:
        """The run ends: fewer than `min_live` engines, and none coming back."""
        return self._lost is not None

    def raise_if_lost(self) -> None:
        if self._lost is not None:
            raise EngineLostError(*self._lost)

    async def wait_live(self) -> None:
        """Return once an engine is live; raise `EngineLostError` once none will be."""
        while True:
            self.raise_if_lost()
            if self._fleet.workers:
                return
            await self._back.wait()

    def _lose(self, url: str, why: str) -> None:
        """End the run: from the task group (which cancels the fleet's user) and to every waiter."""
        if self._lost is not None:
            return
        self._lost = (url, why)
        self._notify_back()
        if self._tg is not None:
            self._tg.start_soon(self._raise_lost)

    async def _raise_lost(self) -> None:
        self.raise_if_lost()

    def _notify_back(self) -> None:
        self._back.set()
        self._back = anyio.Event()

    # -- heartbeat ----------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        await anyio.sleep(self.policy.first_wait)
        while True:
            failed: dict[str, str] = {}

            async def probe(worker: EngineClient, failed: dict[str, str] = failed) -> None:
                if (reason := await self._unhealthy(worker)) is not None:
                    failed[worker.url] = reason

            async with anyio.create_task_group() as tg:
                for worker in self._fleet.workers:
                    tg.start_soon(probe, worker)
            for url, reason in failed.items():
                await self.evict(url, reason)
            await anyio.sleep(self.policy.interval)

    async def _unhealthy(self, worker: EngineClient) -> str | None:
        """Why `worker` failed its heartbeat, or None. While a publish has the engines paused,
        `/health_generate` answers 503 by design, so liveness (`/health`) is what is probed; the
        same while a weight update is under way."""
        path = "/health" if self._quiet else "/health_generate"
        try:
            status, _ = await worker.probe(path, self.policy.timeout)
        except EngineUnavailableError as exc:
            quiet = self._quiet or path == "/health"
            if quiet and self.policy.timeout <= _SGLANG_HEALTH_WAIT and exc.timed_out:
                # SGLang ~0.5.x serves /health with /health_generate's handler, which waits 20 s
                # for output that a pause or a weight load withholds, then answers 503: a shorter
                # probe cannot tell that from a hung engine. A dead engine still refuses the
                # connection; a longer probe gets the 503 from a live one and times out on a hung one,
                # which would otherwise hold the publish's weight update until its request timeout.
                return await self._silent_while_quiet(worker)
            return f"heartbeat {path}: {exc}"
        # Quiet now or when the probe went out: a pause that began while a `/health_generate` was
        # under way aborts its probe request (an abort pause) or withholds its output, and the
        # 503 that follows is the pause's, not the engine's.
        if status != 200 and not ((self._quiet or path == "/health") and status == 503):
            return f"heartbeat {path}: HTTP {status}"
        return None

    async def _silent_while_quiet(self, worker: EngineClient) -> str | None:
        """Ask `/health` again, outwaiting SGLang's health wait: None once it answers at all."""
        wait = self.policy.quiet_wait
        try:
            status, _ = await worker.probe("/health", wait)
        except EngineUnavailableError as exc:
            return f"heartbeat /health: no answer within {wait:g} s while the engines were quiet ({exc})"
        if status not in (200, 503):
            return f"heartbeat /health: HTTP {status}"
        return None

    @property
    def _quiet(self) -> bool:
        """Paused, or loading weights: SGLang's health probes wait for output that will not come."""
        return self.paused or self._updating > 0

    # -- restart and re-admission -------------------------------------------------------------

    async def _recover(self, url: str, reason: str) -> None:
        if self._restarter is None or self.policy.max_restarts == 0:
            await self._wait_for_return(url)
            return
        last = "no try made"
        for attempt in range(self.policy.max_restarts):
            if attempt:
                await anyio.sleep(self.policy.restart_backoff * 2 ** (attempt - 1))
            try:
                await self._restarter(url)
                self.counters.restarts += 1
                await self.readmit(url)
                return
            except (EngineError, OSError) as exc:  # e.g. the port still taken: try again, bounded
                last = str(exc)
                log.warning("engine restart failed", url=url, attempt=attempt + 1, error=last)
        log.error("engine left out for good", url=url, tries=self.policy.max_restarts)
        if (live := len(self._fleet.workers)) < self.policy.min_live:
            self._lose(
                url,
                f"evicted ({reason}) and not back after {self.policy.max_restarts} restart tries (last: {last}); "
                + self._below_min(live),
            )

    async def _wait_for_return(self, url: str) -> None:
        """An engine the user runs: re-admit it once its heartbeat answers again."""
        client = self._fleet.client_for(url)
        while True:
            await anyio.sleep(self.policy.interval)
            if not self.paused and not self._updating and await self._unhealthy(client) is None:
                try:
                    await self.readmit(url)
                    return
                except EngineError as exc:
                    log.warning("engine re-admission failed", url=url, error=str(exc))

    async def readmit(self, url: str) -> None:
        """Load the current weights (or stamp the current version), put the engine back behind the
        router, then into the fan-out: it takes no work before its version is current."""
        client = self._fleet.client_for(url)
        # Not in the middle of a publish: the engine would join unpaused while the others are.
        while self._paused:
            await self._unpaused.wait()
        async with self.weights_lock:
            path, version = self.current_weights
            if path is not None and version is not None:
                await client.update_weights_from_disk(path, weight_version=version)
            elif version is not None:
                await client.update_weight_version(version)
            if version is not None and (reported := await client.weight_version()) != version:
                raise EngineError(url, f"reports weight_version {reported!r} after re-admission, expected {version!r}")
            if self._fleet.router_url is not None:
                await self._router_add(url)
            if url not in {w.url for w in self._fleet.workers}:
                self._fleet.set_workers((*self._fleet.workers, client))
            self._admissions[url] = self._admissions.get(url, 0) + 1
            self.counters.readmissions += 1
            self.counters.capacity(len(self._fleet.workers), self._total)
            self._notify_back()
        log.warning("engine re-admitted", url=url, version=version, live=len(self._fleet.workers))

    # -- the router's worker API: /workers (sglang-router >= 0.2.2), else the legacy one ----------

    async def _router_rows(self) -> list[dict[str, object]]:
        """The router's workers; up to 0.2.1 only their URLs (`/list_workers`), marked legacy."""
        router = self._fleet.router
        status, data = await router.control_raw("GET", "/workers", None)
        if status == 404:  # sglang-router <= 0.2.1
            doc = router.expect_ok("/list_workers", *await router.control_raw("GET", "/list_workers", None))
            urls = doc.get("urls") if isinstance(doc, dict) else None
            return [{"url": u, _LEGACY: True} for u in urls] if isinstance(urls, list) else []
        doc = router.expect_ok("/workers", status, data)
        rows = doc.get("workers") if isinstance(doc, dict) else None
        return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []

    async def _router_remove(self, url: str) -> None:
        """`DELETE /workers/{id}` (by URL on 2025 routers whose rows have no id, `POST
        /remove_worker?url=` up to 0.2.1); best effort: a router that cannot be reached fails
        generation visibly anyway, and the fan-out no longer reaches the engine either way."""
        try:
            for row in await self._router_rows():
                if str(row.get("url", "")).rstrip("/") != url:
                    continue
                if row.get(_LEGACY):
                    await self._router_call("POST", "/remove_worker?" + urlencode({"url": row["url"]}), None)
                else:
                    key = row.get("id") if row.get("id") is not None else row["url"]
                    await self._router_call("DELETE", "/workers/" + quote(str(key), safe=""), None)
        except EngineError as exc:
            log.warning("router did not remove worker", url=url, error=str(exc))

    async def _router_call(self, method: str, path: str, body: object) -> None:
        """The router answers 202 Accepted: it adds and removes workers in the background."""
        router = self._fleet.router
        status, data = await router.control_raw(method, path, body)
        if not 200 <= status < 300:
            router.expect_ok(path, status, data)  # raises, with the router's message

    async def _router_add(self, url: str) -> None:
        """`POST /workers` (`POST /add_worker?url=` up to 0.2.1), then wait until the router lists
        it healthy (it adds in the background)."""
        rows = await self._router_rows()
        if url not in {str(r.get("url", "")).rstrip("/") for r in rows}:
            legacy = any(r.get(_LEGACY) for r in rows)
            if not legacy:
                router = self._fleet.router
                status, data = await router.control_raw("POST", "/workers", {"url": url})
                legacy = status == 404  # a router whose /workers lists none, up to 0.2.1
                if not legacy and not 200 <= status < 300:
                    router.expect_ok("/workers", status, data)  # raises, with the router's message
            if legacy:
                await self._router_call("POST", "/add_worker?" + urlencode({"url": url}), None)
        with anyio.fail_after(_ROUTER_LIST_DEADLINE):
            delay = 0.05
            while True:
                rows = await self._router_rows()
                if any(str(r.get("url", "")).rstrip("/") == url and r.get("is_healthy", True) for r in rows):
                    return
                await anyio.sleep(delay)  # the router's own background task: nothing to wait on
                delay = min(delay * 2, 0.5)

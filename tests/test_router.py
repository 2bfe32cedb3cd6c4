"""The real sglang-router (a subprocess) in front of two fake SGLang engines."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import anyio
import pytest

from core.errors import EngineError, EngineUnavailableError
from core.types import FinishReason
from launch.router_process import RouterProcess, start_router
from stages.sglang_client import EngineFleet, GenerateResult
from tests.conftest import router_in_front_of
from tests.fakes import FakeSGLang

pytestmark = pytest.mark.anyio

PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture
async def engines() -> AsyncIterator[tuple[FakeSGLang, FakeSGLang]]:
    async with FakeSGLang(weight_version="1") as a, FakeSGLang(weight_version="1") as b:
        yield a, b


@pytest.fixture
async def router(engines) -> AsyncIterator[RouterProcess]:
    async with router_in_front_of(engines) as router:
        yield router
    assert not router.running


def fleet_behind(router: RouterProcess) -> EngineFleet:
    return EngineFleet(router_url=router.url, concurrency=8, request_timeout=20, control_timeout=5, retry_backoff=0.01)


async def test_generation_is_spread_over_both_engines_found_by_discovery(engines, router):
    a, b = engines
    async with fleet_behind(router) as fleet:
        assert fleet.generate_url == router.url
        assert set(fleet.worker_urls) == {a.url, b.url}  # from GET /workers
        for i in range(6):
            result = await fleet.generate(PROMPT, {"max_new_tokens": 3, "sampling_seed": i}, rid=f"spread-{i}")
            assert result.finish_reason is FinishReason.LENGTH and len(result.logprobs) == 3
    assert (a.calls["/generate"], b.calls["/generate"]) == (3, 3)  # round robin
    # The router forwards the request as sent: rid, token ids, sampling params, logprobs on.
    payload = a.generate_payloads[0]
    assert payload["input_ids"] == PROMPT and payload["return_logprob"] is True
    assert payload["rid"].startswith("spread-") and payload["sampling_params"]["max_new_tokens"] == 3


async def test_abort_all_through_the_fleet_reaches_every_engine(engines, router):
    a, b = engines
    a.hold_at = b.hold_at = 2
    results: list[GenerateResult] = []
    async with fleet_behind(router) as fleet, aiohttp.ClientSession() as session:
        # The router itself has no /abort_request: that is why the fleet fans out.
        async with session.post(router.url + "/abort_request", json={"abort_all": True}) as resp:
            assert resp.status == 404

        async def run(i: int) -> None:
            results.append(await fleet.generate(PROMPT, {"max_new_tokens": 10}, rid=f"held-{i}"))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for i in range(2):
                    tg.start_soon(run, i)
                await a.wait_until(lambda: a.held == 1)
                await b.wait_until(lambda: b.held == 1)
                await fleet.abort_all()
    assert len(results) == 2
    for result in results:
        assert result.finish_reason is FinishReason.ABORT
        assert len(result.token_ids) == len(result.logprobs) == 2
    assert a.calls["/abort_request"] == b.calls["/abort_request"] == 1


async def test_weight_versions_come_from_both_engines(engines, router):
    a, b = engines
    async with fleet_behind(router) as fleet:
        assert await fleet.weight_versions() == {a.url: "1", b.url: "1"}
        await fleet.update_weight_version("2")
        assert await fleet.weight_versions() == {a.url: "2", b.url: "2"}
        stamped = {(await fleet.generate(PROMPT, {"max_new_tokens": 1}, rid=f"v-{i}")).weight_version for i in range(2)}
    assert stamped == {"2"}
    assert a.calls["/generate"] == b.calls["/generate"] == 1


async def test_a_router_that_exits_reports_its_log():
    with anyio.fail_after(30), pytest.raises(EngineError, match="exited with code") as info:
        await start_router(["http://127.0.0.1:9"], policy="no_such_policy")
    assert "no_such_policy" in str(info.value)  # argparse's complaint, from the log tail


async def test_a_router_whose_workers_never_come_up_times_out_and_is_stopped():
    with anyio.fail_after(30), pytest.raises(EngineUnavailableError, match="not ready within 1 s") as info:
        await start_router(["http://127.0.0.1:9"], startup_timeout=1.0)
    assert "listed [] of ['http://127.0.0.1:9']" in str(info.value)
    assert "\x1b[" not in str(info.value)  # the log tail comes without colour codes


class LegacyRouter:
    """sglang-router up to 0.2.1's worker API (no `/workers`): `GET /list_workers`,
    `POST /add_worker?url=` and `POST /remove_worker?url=`, answered with text."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = list(urls)
        self.url = ""

    async def __aenter__(self) -> LegacyRouter:
        from aiohttp import web

        async def list_workers(request: web.Request) -> web.Response:
            return web.json_response({"urls": self.urls})

        async def add(request: web.Request) -> web.Response:
            self.urls.append(request.query["url"])
            return web.Response(text=f"Successfully added worker: {request.query['url']}")

        async def remove(request: web.Request) -> web.Response:
            self.urls.remove(request.query["url"])
            return web.Response(text=f"Successfully removed worker: {request.query['url']}")

        app = web.Application()
        app.add_routes(
            [web.get("/list_workers", list_workers), web.post("/add_worker", add), web.post("/remove_worker", remove)]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


async def test_eviction_and_readmission_speak_the_legacy_router_api(engines):
    """The fleet finds its workers on a router up to 0.2.1 (`/list_workers`); evicting and
    re-admitting an engine must take it out of and put it back into that router too."""
    from stages.sglang_client.health import FaultPolicy

    a, b = engines
    policy = FaultPolicy(interval=60.0, timeout=5.0)
    async with LegacyRouter([a.url, b.url]) as legacy:
        fleet = EngineFleet(router_url=legacy.url, control_timeout=5, fault_policy=policy)
        with anyio.fail_after(20):
            async with fleet:
                assert set(fleet.worker_urls) == {a.url, b.url}
                await fleet.evict(b.url, "test")
                assert legacy.urls == [a.url] and fleet.worker_urls == (a.url,)
                await fleet.readmit(b.url)
                assert sorted(legacy.urls) == sorted([a.url, b.url]) and set(fleet.worker_urls) == {a.url, b.url}


async def test_eviction_and_readmission_reach_the_real_router(engines, router):
    """sglang-router 0.3.2: `DELETE /workers/{id}` (it refuses a URL there) and `POST /workers`."""
    from stages.sglang_client.health import FaultPolicy

    a, b = engines
    fleet = EngineFleet(router_url=router.url, control_timeout=5, fault_policy=FaultPolicy(interval=60.0))
    with anyio.fail_after(30):
        async with fleet:
            listed = fleet._open.generator.router_workers
            await fleet.evict(b.url, "test")
            while True:  # the router removes in the background, telling no one
                if b.url not in await listed():
                    break
                await anyio.sleep(0.05)
            await fleet.readmit(b.url)
            assert set(await listed()) == {a.url, b.url} and set(fleet.worker_urls) == {a.url, b.url}

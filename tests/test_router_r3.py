"""R3 behind a router (issue 45, item 3): sglang-router 0.3.2 drops `return_routed_experts` and
`routed_experts_start_len` from every `/generate` it forwards, so the fleet sends R3 requests to
the engines itself; a router that passes them on keeps placing them.

Real parts: the real sglang-router 0.3.2 binary on loopback, in front of two built-in engines
serving the MoE toy (through the launcher) or two fake engines speaking SGLang's R3 answer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from itertools import cycle
from pathlib import Path

import aiohttp
import anyio
import pytest
from aiohttp import web

from core.errors import EngineError, EngineUnavailableError
from launch.builtin_engine import free_port
from launch.router_process import RouterProcess, start_router
from pipeline.run.cli import main
from stages.sglang_client import EngineFleet
from stages.sglang_client.dispatch import EnginePicker
from tests.conftest import router_in_front_of
from tests.fakes import FakeSGLang
from tests.fakes.fake_moe import MoeShape

pytestmark = pytest.mark.anyio

R3 = {"return_routed_experts": True, "routed_experts_start_len": 0}


@pytest.mark.slow
def test_r3_runs_through_the_real_router_in_front_of_two_builtin_engines(tmp_path: Path):
    """The issue's run: before, every sample failed for want of routes and the run stopped after
    64 failed groups; now the routes reach the trainer, which replays them (its log-probs are the
    engines' to float precision, as with one engine)."""
    out = tmp_path / "run"
    argv = ["--output-dir", str(out), "--no-progress", "--log-level", "error", "--num-rollout", "1"]
    argv += ["--rollout-num-engines", "2", "--num-experts", "8", "--moe-router-topk", "2"]
    argv += ["--use-rollout-routing-replay", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4"]
    argv += ["--rollout-max-response-len", "16"]
    assert main(argv) == 0
    [record] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert record["tokens/unrouted_total"] == 0


@pytest.fixture
async def moe_engines() -> AsyncIterator[tuple[FakeSGLang, FakeSGLang]]:
    async with FakeSGLang(weight_version="1", moe=MoeShape()) as a, FakeSGLang(weight_version="1", moe=MoeShape()) as b:
        yield a, b


@pytest.fixture
async def router(moe_engines) -> AsyncIterator[RouterProcess]:
    async with router_in_front_of(moe_engines) as router:
        yield router


def r3_fleet(router_url: str, workers: list[str] | None = None) -> EngineFleet:
    return EngineFleet(
        workers,
        router_url=router_url,
        concurrency=8,
        request_timeout=20,
        control_timeout=5,
        retry_backoff=0.01,
        routed_experts=True,
    )


async def test_r3_requests_bypass_a_router_that_drops_their_fields(moe_engines, router):
    a, b = moe_engines
    async with r3_fleet(router.url) as fleet:
        assert fleet.generates_direct  # the router's answer had no routes, an engine's did
        prompts = [[5, 6, 7 + i] for i in range(16)]  # all 16 preferring one of two engines: 2 in 65,536
        for prompt in prompts:
            for s in range(2):  # a group's samples share their prompt
                result = await fleet.generate(prompt, {"max_new_tokens": 3}, rid=f"p{prompt[-1]}-s{s}", **R3)
                assert result.routed_experts is not None
        await fleet.abort_all()  # control calls still reach every engine
    sent = [p for e in (a, b) for p in e.generate_payloads if p["rid"].startswith("p")]
    assert len(sent) == 32 and all(p["return_routed_experts"] is True for p in sent)
    where = {p["rid"]: e.url for e in (a, b) for p in e.generate_payloads}
    # Each prompt's two samples went to one engine; the prompts went to both.
    assert all(where[f"p{p[-1]}-s0"] == where[f"p{p[-1]}-s1"] for p in prompts)
    assert {where[f"p{p[-1]}-s0"] for p in prompts} == {a.url, b.url}
    assert a.calls["/abort_request"] == b.calls["/abort_request"] == 1


async def test_an_engines_eviction_ends_its_direct_r3_requests_and_the_next_go_elsewhere(moe_engines, router):
    """Through the router, a request on an engine that hangs waits for its timeout; sent directly,
    the engine's eviction ends it at once (the sample goes back to be continued), and later
    requests go to the engines left."""
    from stages.sglang_client.health import FaultPolicy

    a, b = moe_engines
    fleet = EngineFleet(
        router_url=router.url,
        concurrency=8,
        request_timeout=60,
        control_timeout=5,
        fault_policy=FaultPolicy(interval=60.0, first_wait=60.0),
        routed_experts=True,
    )
    with anyio.fail_after(30):
        async with fleet:
            assert fleet.generates_direct
            a.hold_at = b.hold_at = 1  # every request stops after one token, as on a hung engine
            async with anyio.create_task_group() as tg:
                failed: list[EngineUnavailableError] = []

                async def held() -> None:
                    with pytest.raises(EngineUnavailableError) as err:
                        await fleet.generate([5, 6, 7], {"max_new_tokens": 3}, rid="held", **R3)
                    failed.append(err.value)

                tg.start_soon(held)
                async with anyio.create_task_group() as watching:  # whichever engine it went to

                    async def watch(engine: FakeSGLang) -> None:
                        await engine.wait_until(lambda: engine.held == 1)
                        watching.cancel_scope.cancel()

                    watching.start_soon(watch, a)
                    watching.start_soon(watch, b)
                hung = a if a.held else b
                await fleet.evict(hung.url, "test: hung")
            assert failed and failed[0].url == hung.url and "evicted" in str(failed[0])
            left = b if hung is a else a
            left.hold_at = None
            result = await fleet.generate([5, 6, 7], {"max_new_tokens": 3}, rid="after", **R3)
            assert result.routed_experts is not None
    assert [p["rid"] for p in left.generate_payloads][-1] == "after"


async def test_r3_requests_stay_with_a_router_that_passes_their_fields_on(moe_engines):
    """A router that forwards the body as sent (smg >= 1.5.0 keeps unknown fields) keeps placing
    R3 requests: nothing bypasses it."""
    a, b = moe_engines
    async with _PassThroughRouter([a.url, b.url]) as proxy, r3_fleet(proxy.url, [a.url, b.url]) as fleet:
        assert not fleet.generates_direct
        for i in range(4):
            result = await fleet.generate([5, 6, i], {"max_new_tokens": 3}, rid=f"kept-{i}", **R3)
            assert result.routed_experts is not None
        assert fleet.picker_statistics() is None
    assert proxy.forwarded == 5  # the probe and the four requests


async def test_r3_behind_a_router_is_refused_by_name_when_an_engine_sends_no_routes():
    async with FakeSGLang(weight_version="1") as a, FakeSGLang(weight_version="1") as b:  # no MoE
        with anyio.fail_after(30):
            router = await start_router([a.url, b.url])
        async with router:
            with pytest.raises(EngineError) as err:
                async with r3_fleet(router.url):
                    pass
    assert err.value.url.startswith((a.url, b.url))  # the engine asked directly, in its own words
    assert "--enable-return-routed-experts" in str(err.value)


async def test_r3_on_one_engine_that_answers_no_routes_is_refused_before_the_first_sample():
    """Not the router's doing, but the same symptom: SGLang without --enable-return-routed-experts.
    Refused on entry, naming the flag, rather than sample by sample until the run gives up."""
    async with FakeSGLang(weight_version="1") as engine:
        with pytest.raises(EngineError, match="--enable-return-routed-experts") as err:
            async with EngineFleet([engine.url], concurrency=2, request_timeout=20, routed_experts=True):
                pass
    assert err.value.url.startswith(engine.url)


async def test_r3_behind_a_dropping_router_is_refused_when_its_engines_cannot_be_reached(router):
    gone = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    with pytest.raises(EngineUnavailableError) as err:
        async with r3_fleet(router.url, [gone]):
            pass
    said = str(err.value)
    assert err.value.url == router.url and gone in said
    assert "sglang-router up to 0.3.2" in said and "--sglang-url" in said


def test_the_picker_keeps_a_prompts_requests_on_one_engine_up_to_its_share():
    urls = ("http://e0", "http://e1")
    picker = EnginePicker(concurrency=4)  # a share of 2 per engine
    prompt = [1, 2, 3]
    first = picker.pick(urls, prompt)
    assert picker.pick(urls, prompt) == first  # the group's second sample: the same engine
    other = picker.pick(urls, prompt)  # that engine holds its share: the least loaded takes it
    assert other != first
    picker.release(first)
    assert picker.pick(urls, prompt) == first  # under its share again
    stats = picker.statistics()
    assert stats.in_flight == {first: 2, other: 1} and (stats.picked, stats.preferred) == (4, 3)


def test_an_engine_leaving_moves_only_the_prompts_it_had():
    urls = tuple(f"http://e{i}" for i in range(4))
    picker = EnginePicker(concurrency=10_000)  # never full: only the preference decides
    prompts = [[7, i, i * 3] for i in range(200)]
    before = {tuple(p): picker.pick(urls, p) for p in prompts}
    assert set(before.values()) == set(urls)  # spread over every engine
    after = {tuple(p): picker.pick(urls[1:], p) for p in prompts}
    moved = {p for p in before if before[p] != after[p]}
    assert moved == {p for p in before if before[p] == urls[0]}


class _PassThroughRouter:
    """A router that forwards each `/generate` body byte for byte, round robin (as smg >= 1.5.0
    forwards fields it does not declare); a stand-in, since no such router installs here."""

    def __init__(self, workers: list[str]) -> None:
        self._workers = cycle(workers)
        self.forwarded = 0
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> _PassThroughRouter:
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port("127.0.0.1")
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self._session = aiohttp.ClientSession()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._session is not None and self._runner is not None
        await self._session.close()
        await self._runner.cleanup()

    async def _generate(self, request: web.Request) -> web.Response:
        assert self._session is not None
        self.forwarded += 1
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        async with self._session.post(next(self._workers) + "/generate", data=body, headers=headers) as resp:
            return web.Response(status=resp.status, body=await resp.read(), content_type="application/json")

"""What an engine lets in (engines/guards.py), on real engine processes over real HTTP.

- `--api-key`: every endpoint but the health probes answers 401 without the key or with a wrong
  one, and the refused request has no effect (no pause, no weight load, no generation); with the
  key everything works. Every engine kind (built-in, simulated, instant), and the engines the
  launcher starts and restarts, which get the run's key.
- The body bound: a body over it gets 413 naming the bound and `--max-body-mb`, whether it says
  its length or not, and the engine goes on serving; a large body under it is parsed (off the loop).
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
import pytest

from core.types import FinishReason
from engines.builtin import _parse_args as builtin_args
from engines.builtin import open_server
from engines.guards import guard_options
from engines.http import EngineServer
from engines.scheduler import EngineCore
from engines.sim import SimModel, open_sim_server
from launch.builtin_engine import start_engine, start_engines
from launch.engine_restart import ManagedEngines
from pipeline.config import load_config
from pipeline.run.run_engines import RunEngines
from pipeline.tasks.tiny_model import make_model_folder
from pipeline.tasks.toy import encode
from stages.sglang_client import EngineFleet

pytestmark = pytest.mark.anyio

KEY = "s3cret-key"
WRONG = ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"})
PROMPT = list(encode("say a x2:"))
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("guards")
    return make_model_folder(root / "v0", seed=0), make_model_folder(root / "v1", seed=1)


def engine_routes() -> list[tuple[str, str]]:
    """Every (method, path) of the HTTP surface all aiohttp engines share, read from the app itself,
    so an endpoint added later is covered too."""
    server = EngineServer(EngineCore(SimModel()))
    routes = {(r.method, r.resource.canonical) for r in server.app.router.routes() if r.resource is not None}
    return sorted((m, p) for m, p in routes if m != "HEAD")


def effect_bodies(new_weights: Path) -> dict[str, dict[str, Any]]:
    """What each endpoint would do if the key were not checked: pause, load weights, generate."""
    return {
        "/generate": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}},
        "/pause_generation": {"mode": "abort"},
        "/update_weights_from_disk": {"model_path": str(new_weights), "weight_version": "9"},
        "/update_weight_version": {"new_version": "9"},
        "/abort_request": {"abort_all": True},
        "/sim/slowdown": {"factor": 50},
    }


async def refused_everywhere(
    http: aiohttp.ClientSession, url: str, routes: list[tuple[str, str]], bodies: dict[str, Any]
) -> list[tuple[str, str]]:
    """Sends every route without the key and with each wrong one; asserts SGLang's 401. Returns the
    routes that let the request through (the health probes)."""
    exempt = []
    for method, path in routes:
        for headers in WRONG:
            async with http.request(method, url + path, json=bodies.get(path, {}), headers=headers) as resp:
                body = await resp.read()
                if path.startswith("/health"):
                    exempt.append((method, path))
                    break
                assert resp.status == 401, (method, path, headers, resp.status, body)
                assert orjson.loads(body) == {"error": "Unauthorized"}
    return exempt


async def state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/server_info", headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status == 200
        info = await resp.json()
    return {"weight_version": info["weight_version"], **info["internal_states"][0]}


async def test_a_keyed_engine_refuses_every_endpoint_without_the_key_and_a_restart_keeps_the_key(
    models: tuple[Path, Path], http: aiohttp.ClientSession
) -> None:
    v0, v1 = models
    [proc] = await start_engines(1, v0, max_running_requests=4, api_key=KEY)
    engines = ManagedEngines([proc], v0, max_running_requests=4, api_key=KEY)
    try:
        url = proc.url
        routes = engine_routes()
        assert ("POST", "/pause_generation") in routes and ("POST", "/update_weights_from_disk") in routes
        before = await state(http, url)
        exempt = await refused_everywhere(http, url, routes, effect_bodies(v1))
        assert sorted(set(exempt)) == [("GET", "/health"), ("GET", "/health_generate")]
        # Nothing a refused request asked for happened: not paused, no weights loaded, no version
        # set, nothing generated but /health_generate's own 1-token probe.
        after = await state(http, url)
        assert after["weight_version"] == "0" and after["paused"] is None
        assert after["weight_updates"] == 0 and after["aborted_requests"] == 0
        assert after["finished_requests"] - before["finished_requests"] == 1

        async with EngineFleet([url], concurrency=2, api_key=KEY) as fleet:  # the key opens every call
            result = await fleet.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True}, rid="r0")
            assert result.finish_reason is FinishReason.LENGTH
            await fleet.pause("abort")
            assert (await state(http, url))["paused"] == "abort"
            await fleet.update_weights_from_disk(str(v1), weight_version="1")
            await fleet.continue_generation()
            assert await fleet.weight_versions() == {url: "1"}

        await engines(url)  # the restart a fault policy makes: a new process at the same URL
        assert engines.process(url).pid != proc.pid
        async with http.post(url + "/generate", json=effect_bodies(v1)["/generate"]) as resp:
            assert resp.status == 401
        async with EngineFleet([url], concurrency=2, api_key=KEY) as fleet:
            result = await fleet.generate(PROMPT, {"max_new_tokens": 3, "ignore_eos": True}, rid="r1")
            assert len(result.token_ids) == 3
    finally:
        await engines.stop()


async def test_a_body_over_the_bound_is_413_naming_the_flag_and_the_engine_keeps_serving(
    models: tuple[Path, Path], http: aiohttp.ClientSession
) -> None:
    v0, _ = models
    keyed = {"Authorization": f"Bearer {KEY}"}
    guards, problems = guard_options(builtin_args(["--model-path", str(v0), "--max-body-mb", "2", "--api-key", KEY]))
    assert guards == {"api_key": KEY, "max_body_bytes": 2 * MIB} and not problems
    async with open_server(v0, port=0, **guards) as server:  # python -m engines.builtin's server, in-process
        url = server.url + "/generate"
        big = orjson.dumps({"input_ids": PROMPT, "rid": "x" * (3 * MIB)})

        async with http.post(url, data=io.BytesIO(big), headers=keyed) as resp:  # says its length: refused unread
            assert resp.status == 413
            message = (await resp.json())["error"]["message"]
        assert f"the request body is {len(big)} bytes" in message
        assert f"at most {2 * MIB} bytes (2 MiB" in message and "--max-body-mb" in message

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: cut off while it is read
            for i in range(0, len(big), 64 * 1024):
                yield big[i : i + 64 * 1024]

        async with http.post(url, data=chunked(), headers=keyed) as resp:
            assert resp.status == 413
            assert "--max-body-mb" in (await resp.json())["error"]["message"]
        async with http.post(url, data=io.BytesIO(big)) as resp:  # the key is checked first
            assert resp.status == 401

        # Under the bound but over a megabyte: parsed on a worker thread, answered as any other.
        # ignore_eos: the random model may sample its end token before the third (it did, once in CI).
        sampling = {"max_new_tokens": 3, "ignore_eos": True}
        padded = orjson.dumps({"input_ids": PROMPT, "sampling_params": sampling}) + b" " * (MIB + 10)
        async with http.post(url, data=io.BytesIO(padded), headers=keyed) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["meta_info"]["completion_tokens"] == 3
        bad = orjson.dumps({"input_ids": [list(range(40))] * 12000 + [[*PROMPT, "x"]]})
        assert MIB < len(bad) < 2 * MIB
        async with http.post(url, data=io.BytesIO(bad), headers=keyed) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]["message"]
        assert error.startswith("input_ids must be a list of integers") and len(error) < 500  # a line, not a megabyte


async def test_the_run_starts_its_engines_with_its_key(models: tuple[Path, Path], tmp_path: Path) -> None:
    v0, _ = models
    config = load_config(["--output-dir", str(tmp_path / "run"), "--api-key", KEY, "--use-fault-tolerance"])
    async with RunEngines(config, v0) as fleet, aiohttp.ClientSession() as http:
        [url] = fleet.worker_urls
        async with http.post(url + "/pause_generation", json={}) as resp:  # from anyone but the run: refused
            assert resp.status == 401
        result = await fleet.generate(PROMPT, {"max_new_tokens": 2, "ignore_eos": True}, rid="r0")
        assert len(result.token_ids) == 2


async def test_the_simulated_engine_enforces_the_key_on_its_own_routes_too(http: aiohttp.ClientSession) -> None:
    async with open_sim_server(time_scale=1e-3, api_key=KEY) as server:
        routes = sorted({(r.method, r.resource.canonical) for r in server.app.router.routes() if r.method != "HEAD"})
        assert ("POST", "/sim/slowdown") in routes
        await refused_everywhere(http, server.url, routes, effect_bodies(Path(".")))
        assert server.core.model.slowdown == 1.0 and server.core.paused is None
        assert server.core.weight_version == "0"


async def test_the_instant_engine_enforces_the_key_and_the_bound(http: aiohttp.ClientSession) -> None:
    engine = await start_engine(
        "instant", module="engines.instant", api_key=KEY, extra_args=["--tokens", "8", "--max-body-mb", "1"]
    )
    async with engine:
        paths = [
            "/generate", "/pause_generation", "/continue_generation", "/update_weights_from_disk",
            "/update_weight_version", "/abort_request", "/flush_cache", "/model_info", "/instant/stats",
        ]  # fmt: skip
        routes = [("POST", p) for p in paths] + [("GET", "/health"), ("GET", "/health_generate")]
        exempt = await refused_everywhere(http, engine.url, routes, effect_bodies(Path(".")))
        assert sorted(set(exempt)) == [("GET", "/health"), ("GET", "/health_generate")]
        big = orjson.dumps({"input_ids": [1] * (MIB // 2)})
        keyed = {"Authorization": f"Bearer {KEY}"}
        async with http.post(engine.url + "/generate", data=io.BytesIO(big), headers=keyed) as resp:
            assert resp.status == 413
            assert "--max-body-mb" in (await resp.json())["error"]["message"]
        async with EngineFleet([engine.url], concurrency=2, api_key=KEY) as fleet:
            assert await fleet.weight_versions() == {engine.url: "0"}  # the refused updates did nothing
            with anyio.fail_after(30):  # not paused: answered at once
                result = await fleet.generate([1, 2], {"max_new_tokens": 4}, rid="r0")
            assert len(result.token_ids) == 4
        async with http.post(engine.url + "/instant/stats", headers=keyed) as resp:
            assert (await resp.json())["requests"] == 1  # only the keyed generation was served

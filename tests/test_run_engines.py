"""`RunEngines` over the user's engines: several `--sglang-url`s get a router this process starts
and stops on exit (or at once, when entering fails); a `--sglang-router-url` is used as given, and
left running.

Real parts: two fake SGLang engines on loopback speaking SGLang's HTTP, the real sglang-router
0.3.2 binary in front of them.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import anyio
import pytest

from core.errors import EngineError
from launch.router_process import start_router
from pipeline.config import load_config
from pipeline.run.run_engines import RunEngines
from tests.fakes import FakeSGLang

pytestmark = pytest.mark.anyio

PROMPT = [5, 6, 7]


@pytest.fixture
async def engines() -> AsyncIterator[tuple[FakeSGLang, FakeSGLang]]:
    async with FakeSGLang(weight_version="1") as a, FakeSGLang(weight_version="1") as b:
        yield a, b


async def _answers(url: str) -> bool:
    async with aiohttp.ClientSession() as http:
        try:
            async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return resp.status == 200
        except aiohttp.ClientConnectionError:
            return False


def _child_commands() -> list[str]:
    """The command lines of this process's children (Linux /proc): a started router is one."""
    me, found = str(os.getpid()), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = stat.read_text().rsplit(")", 1)[1].split()[1]
            if ppid == me:
                found.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError):
            continue  # a process that ended while we looked
    return found


async def test_several_given_engines_get_a_router_that_stops_with_the_run(engines, tmp_path: Path) -> None:
    a, b = engines
    argv = ["--output-dir", str(tmp_path / "run"), "--sglang-url", a.url, "--sglang-url", b.url]
    run_engines = RunEngines(load_config(argv), tmp_path)
    with anyio.fail_after(60):
        async with run_engines as fleet:
            router_url = fleet.router_url
            assert router_url is not None and router_url not in (a.url, b.url)
            assert sorted(fleet.worker_urls) == sorted([a.url, b.url])
            assert not run_engines.started_here  # the user's engines: their weights are not known
            result = await fleet.generate(PROMPT, {"max_new_tokens": 2, "ignore_eos": True}, rid="r0")
            assert len(result.token_ids) == 2
            assert await _answers(router_url)
        assert not await _answers(router_url)  # the router this process started is stopped
    assert (tmp_path / "run" / "logs" / "router.log").is_file()


async def test_a_given_router_is_used_and_left_running(engines, tmp_path: Path) -> None:
    a, b = engines
    with anyio.fail_after(60):
        router = await start_router([a.url, b.url])
        async with router:
            argv = ["--output-dir", str(tmp_path / "run"), "--sglang-router-url", router.url]
            async with RunEngines(load_config(argv), tmp_path) as fleet:
                assert fleet.router_url == router.url.rstrip("/")
                assert sorted(fleet.worker_urls) == sorted([a.url, b.url])  # discovered from the router
                result = await fleet.generate(PROMPT, {"max_new_tokens": 2, "ignore_eos": True}, rid="r0")
                assert len(result.token_ids) == 2
            assert router.running and await _answers(router.url)  # the user's router: not ours to stop


async def test_one_given_engine_is_used_without_a_router(engines, tmp_path: Path) -> None:
    a, _ = engines
    argv = ["--output-dir", str(tmp_path / "run"), "--sglang-url", a.url]
    with anyio.fail_after(30):
        async with RunEngines(load_config(argv), tmp_path) as fleet:
            assert fleet.router_url is None and fleet.worker_urls == (a.url,)
            result = await fleet.generate(PROMPT, {"max_new_tokens": 2, "ignore_eos": True}, rid="r0")
            assert len(result.token_ids) == 2


async def test_a_failed_entry_stops_the_router_it_started(engines, tmp_path: Path) -> None:
    """R3 refused on entry (the engines answer no routes) after the router is up: the router goes."""
    a, b = engines
    argv = ["--output-dir", str(tmp_path / "run"), "--sglang-url", a.url, "--sglang-url", b.url]
    argv += ["--use-rollout-routing-replay", "--num-experts", "8", "--moe-router-topk", "2"]
    assert not any("router" in c for c in _child_commands())
    with anyio.fail_after(60), pytest.raises(EngineError, match="return_routed_experts"):
        async with RunEngines(load_config(argv), tmp_path):
            pass
    assert (tmp_path / "run" / "logs" / "router.log").is_file()  # it was started
    assert not any("router" in c for c in _child_commands())

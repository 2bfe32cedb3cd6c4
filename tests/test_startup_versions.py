"""Before the first request, every engine reports the clock's version, or the run names the fix."""

import pytest
from aiohttp import web

from core.errors import EngineError
from pipeline.run.engines import align_weight_versions
from stages.sglang import EngineFleet
from tests.fakes import FakeSGLang

pytestmark = pytest.mark.anyio


async def test_a_fresh_engine_is_told_the_version_and_an_aligned_one_is_left_alone():
    async with FakeSGLang(weight_version="default") as fresh, EngineFleet([fresh.url], concurrency=2) as fleet:
        await align_weight_versions(fleet, 0)
        assert fresh.weight_version == "0" and fresh.calls["/update_weight_version"] == 1
        await align_weight_versions(fleet, 0)
        assert fresh.calls["/update_weight_version"] == 1  # already aligned: nothing sent


async def test_an_engine_without_the_endpoint_is_named_with_the_launch_flag():
    async def model_info(request):
        return web.json_response({"model_path": "m", "weight_version": "default"})

    app = web.Application()
    app.router.add_get("/model_info", model_info)  # an older SGLang: no /update_weight_version
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with EngineFleet([url], concurrency=2, max_retries=0) as fleet:
            with pytest.raises(EngineError, match="start it with --weight-version 3"):
                await align_weight_versions(fleet, 3)
    finally:
        await runner.cleanup()

"""The instant engine speaks enough SGLang for the pipeline's client, at once and exactly."""

import pytest

from core.types import FinishReason
from launch.builtin_engine import start_engine
from stages.sglang_client import EngineFleet

pytestmark = pytest.mark.anyio


async def test_instant_engine_serves_the_client_and_a_publish():
    engine = await start_engine("instant", module="engines.instant", extra_args=["--tokens", "64"])
    async with engine, EngineFleet([engine.url], concurrency=4) as fleet:
        await fleet.update_weight_version("3")
        result = await fleet.generate([1, 2, 3], {"max_new_tokens": 16}, rid="r1")
        assert len(result.token_ids) == len(result.logprobs) == 16
        assert result.finish_reason is FinishReason.LENGTH and result.weight_version == "3"
        capped = await fleet.generate([1], {"max_new_tokens": 1000}, rid="r2")
        assert len(capped.token_ids) == 64
        await fleet.pause("abort")
        await fleet.update_weights_from_disk(".", weight_version="4")
        await fleet.continue_generation()
        assert (await fleet.weight_versions()) == {engine.url: "4"}

"""Truthful token versions end to end: the generator pool against the real built-in engine (a real
tiny Qwen3 over real HTTP), with a retract or in_place publish crossing requests in flight.

The samples' spans must follow what the engine reports in `meta_info.weight_versions`: two spans,
the boundary where the engine loaded the new weights, never the newer version for the prefix.
Ordering comes from the engine's own state (running requests, decode steps), never sleeps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from core.clock import VersionClock
from core.types import PromptTask, SampleStatus, VersionSpan
from engines.builtin import open_server
from pipeline.tasks.tiny_model import CHARS, make_model_folder
from stages.publisher import publish_weights
from stages.sglang_client import EngineFleet, GenerateResult
from storage import GroupState, MemoryStore
from tests.conftest import PoolRig

pytestmark = pytest.mark.anyio

LONG = 24  # response tokens (ignore_eos): the publish lands after the first few
N_SAMPLES = 2


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spans")
    return (
        make_model_folder(root / "v0", hidden_size=32, num_layers=2, seed=0),
        make_model_folder(root / "v1", hidden_size=32, num_layers=2, seed=1),
    )


class Recording:
    """The fleet, passed through, keeping each answer as the engine sent it (what the spans of the
    samples are compared against)."""

    def __init__(self, fleet: EngineFleet) -> None:
        self.fleet = fleet
        self.answers: dict[str, GenerateResult] = {}

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], *, rid: str) -> Any:
        result = await self.fleet.generate(input_ids, sampling_params, rid=rid)
        self.answers[rid] = result
        return result

    async def abort_all(self) -> None:
        await self.fleet.abort_all()


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_spans_follow_the_engine_across_a_publish(mode: str, model_dirs: tuple[Path, Path]) -> None:
    v0, v1 = model_dirs
    store, clock = MemoryStore(), VersionClock()
    prompt = tuple(3 + CHARS.index(c) for c in "1+2=")
    async with (
        open_server(v0, port=0, weight_version="0", health_check_timeout=0.5) as server,
        EngineFleet([server.url], concurrency=8) as fleet,
        anyio.create_task_group() as tg,
    ):
        engine = Recording(fleet)
        rig = PoolRig(
            engine,
            store,
            clock,
            tasks=[PromptTask(index=0, prompt_ids=prompt)],
            n_samples=N_SAMPLES,
            max_len=LONG,
            slots=8,
            sampling_params={"ignore_eos": True},
        )
        await rig.start(tg)
        with anyio.fail_after(120):  # a shared CPU decodes this tiny model at a few steps a second
            rig.admission.grant(1)
            while server.core.statistics().num_running < N_SAMPLES:
                await server.core.wait_step()
            await server.core.wait_step()  # both have decoded at least one token under v0
            # Pause first, so the publish finds both mid-response however fast the engine decodes;
            # the publish pauses again (same mode), loads v1 and continues.
            await fleet.pause(mode)
            await publish_weights(clock, fleet, v1, pause_mode=mode)
            await rig.admission.wait_settled()
        tg.cancel_scope.cancel()

    [group] = store.groups(GroupState.READY)
    assert clock.version == 1
    for sample in group.samples:
        assert sample.status is SampleStatus.TRUNCATED and sample.response_len == LONG
        assert not sample.resumed_at  # one request each: the engine kept it across the publish
        [answer] = [a for rid, a in engine.answers.items() if rid.startswith(f"{group.group_id}-s{sample.index}-")]
        reported = answer.weight_versions
        assert reported is not None and [s.version for s in reported] == ["0", "1"]
        boundary = reported[0].end
        assert 0 < boundary < LONG
        assert sample.spans == (VersionSpan(0, boundary, 0), VersionSpan(boundary, LONG, 1))

"""The launcher's garbage collection hand-over (`--rollout-gc-keep-steps`): bounded, and losing nothing."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from pipeline.run.parts import garbage_collector

pytestmark = pytest.mark.anyio


class _SlowStore:
    """A store whose collections wait for the test: it records what it was asked to collect."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.started = anyio.Event()
        self.release = anyio.Event()

    async def collect_garbage(self, up_to_step: int) -> int:
        self.calls.append(up_to_step)
        self.started.set()
        await self.release.wait()
        return 0


async def test_requests_made_during_a_slow_collection_coalesce_into_the_newest() -> None:
    store = _SlowStore()
    seen: list[int] = []
    async with garbage_collector(store, 1, lambda record: seen.append(record["step"])) as step_done:  # type: ignore[arg-type]
        step_done({"step": 1})  # collects up to step 0
        await store.started.wait()
        # The first collection is still running: eight more steps end. The hand-over holds one
        # request; each newer one replaces it, and the step callback never blocks or fails.
        for step in range(2, 10):
            step_done({"step": step})
        store.release.set()
    # Leaving the block waited for the last collection, which covers every step up to 8.
    assert store.calls == [0, 8]
    assert seen == list(range(1, 10))


async def test_steps_younger_than_keep_steps_are_not_collected() -> None:
    store = _SlowStore()
    store.release.set()
    async with garbage_collector(store, 3, lambda record: None) as step_done:  # type: ignore[arg-type]
        for step in range(3):
            step_done({"step": step})
            await anyio.wait_all_tasks_blocked()
        step_done({"step": 3})
    assert store.calls == [0]


async def test_without_keep_steps_the_callback_is_passed_through() -> None:
    store = _SlowStore()
    seen: list[dict[str, Any]] = []
    async with garbage_collector(store, None, seen.append) as step_done:  # type: ignore[arg-type]
        step_done({"step": 7})
    assert seen == [{"step": 7}] and store.calls == []

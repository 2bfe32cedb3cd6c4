"""One round of the real rollout stages against a built-in engine, for tests of what an engine's
answer becomes in a sample (R3 routes, SC heads, version spans).

Dispenser -> generator pool -> collector, joined by bounded streams as `pipeline.graph` joins
them, over real HTTP to a built-in engine serving `model`, with an in-memory store: every task is
granted at once and the round ends when the admission has settled (all groups stored).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from core.clock import VersionClock
from core.types import Group, PromptTask
from engines.builtin import EngineServer, open_server
from pipeline.tasks.toy import toy_reward
from stages.sglang_client import EngineFleet
from stages.sglang_client.payloads import TokenPayloads
from storage import GroupState, MemoryStore
from tests.conftest import PoolRig

__all__ = ["engine_rollout", "toy_rewarded"]

# What a test may do while the round runs: given the engine server, the fleet and the clock.
During = Callable[[EngineServer, EngineFleet, VersionClock], Awaitable[None]]


async def engine_rollout(
    model: Path,
    tasks: Sequence[PromptTask],
    *,
    n_samples: int,
    payloads: TokenPayloads,
    max_response_len: int,
    sampling_params: Mapping[str, Any] | None = None,
    dtype: str = "float32",
    slots: int = 16,
    during: During | None = None,
    deadline: float = 120.0,
) -> list[Group]:
    """The READY groups of one round over `tasks` (`n_samples` each); `during`, if given, runs
    once the tasks are granted, before the round is waited for (a publish mid-request, say)."""
    store, clock = MemoryStore(), VersionClock()
    async with (
        open_server(model, port=0, dtype=dtype, weight_version="0", health_check_timeout=0.5) as server,
        EngineFleet([server.url], concurrency=slots) as fleet,
        anyio.create_task_group() as tg,
    ):
        rig = PoolRig(
            fleet,
            store,
            clock,
            tasks=list(tasks),
            n_samples=n_samples,
            max_len=max_response_len,
            slots=slots,
            payloads=payloads,
            sampling_params=dict(sampling_params or {}),
            collect_buffer=len(tasks),
        )
        await rig.start(tg)
        with anyio.fail_after(deadline):
            rig.admission.grant(len(tasks))
            if during is not None:
                await during(server, fleet, clock)
            await rig.admission.wait_settled()
        tg.cancel_scope.cancel()
    groups = list(store.groups(GroupState.READY))
    assert len(groups) == len(tasks), f"{len(groups)} of {len(tasks)} groups ready"
    return groups


def toy_rewarded(groups: Sequence[Group]) -> list[Group]:
    """`groups` with each sample's toy-task reward."""
    return [g.with_samples([dataclasses.replace(s, reward=toy_reward(g.task, s)) for s in g.samples]) for g in groups]

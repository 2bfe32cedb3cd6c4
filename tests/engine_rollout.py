"""One round of the real rollout stages against a built-in engine, for tests of what an engine's
answer becomes in a sample (R3 routes, SC heads, version spans).

Dispenser -> generator pool -> collector, joined by bounded streams as `pipeline.graph` joins
them, over real HTTP to a built-in engine serving `model`, with an in-memory store: every task is
granted at once and the round ends when the admission has settled (all groups stored).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from core.clock import VersionClock
from core.types import Group, PromptTask
from engines.builtin import EngineServer, open_server
from pipeline.tasks.toy import toy_reward
from stages.admission import Admission
from stages.collector import Collector
from stages.dispenser import Dispenser
from stages.generator import GeneratorPool
from stages.sglang import EngineFleet
from stages.sglang.payloads import TokenPayloads
from storage import AsyncStore, GroupState, MemoryStore

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
    store, clock, admission = MemoryStore(), VersionClock(), Admission()
    astore = AsyncStore(store)
    async with (
        open_server(model, port=0, dtype=dtype, weight_version="0", health_check_timeout=0.5) as server,
        EngineFleet([server.url], concurrency=slots) as fleet,
        anyio.create_task_group() as tg,
    ):
        dispenser = Dispenser(astore, list(tasks), n_samples=n_samples, clock=clock, admission=admission)
        pool = GeneratorPool(
            fleet,
            slots=slots,
            sampling_params=dict(sampling_params or {}),
            max_response_len=max_response_len,
            clock=clock,
            store=astore,
            admission=admission,
            payloads=payloads,
        )
        collector = Collector(store=astore, admission=admission, capacity=math.inf)
        to_pool_send, to_pool = anyio.create_memory_object_stream(0)
        to_collect_send, to_collect = anyio.create_memory_object_stream(len(tasks))
        await tg.start(dispenser.run, to_pool_send)
        await tg.start(pool.run, to_pool, to_collect_send)
        await tg.start(collector.run, to_collect)
        with anyio.fail_after(deadline):
            admission.grant(len(tasks))
            if during is not None:
                await during(server, fleet, clock)
            await admission.wait_settled()
        tg.cancel_scope.cancel()
    groups = list(store.groups(GroupState.READY))
    assert len(groups) == len(tasks), f"{len(groups)} of {len(tasks)} groups ready"
    return groups


def toy_rewarded(groups: Sequence[Group]) -> list[Group]:
    """`groups` with each sample's toy-task reward."""
    return [g.with_samples([dataclasses.replace(s, reward=toy_reward(g.task, s)) for s in g.samples]) for g in groups]

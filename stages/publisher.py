"""Publishing new weights to the engines, coordinated with the version clock.

    close admission -> pause engines (abort | retract | in_place) -> flush cache (not in_place)
    -> update weights -> version += 1 -> continue engines -> open admission

The version moves only if every engine took the weights. Whatever happens, the engines are told to
continue: a failed publish leaves the old version serving, and says why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import anyio

from pipeline.clock import VersionClock
from pipeline.errors import EngineError, PublishError
from pipeline.types import PauseMode

__all__ = ["PublishReport", "WeightTarget", "publish_weights"]

CONTINUE_DEADLINE = 30.0


class WeightTarget(Protocol):
    """The engine-side operations a publish needs (an `EngineFleet`)."""

    async def pause(self, mode: PauseMode) -> None: ...
    async def continue_generation(self) -> None: ...
    async def flush_cache(self, deadline: float) -> None: ...
    async def update_weights_from_disk(self, path: str, *, weight_version: str) -> None: ...


@dataclass(frozen=True, slots=True)
class PublishReport:
    """What one weight publish did: the version it made serve, and how long admission was held."""

    version: int
    gate_closed_seconds: float
    update_seconds: float  # the weight transfer itself; the rest of the gate time is coordination


async def publish_weights(
    clock: VersionClock, engines: WeightTarget, weights: Path, *, pause_mode: PauseMode, flush_deadline: float = 10.0
) -> PublishReport:
    started = time.perf_counter()
    update_seconds = 0.0
    with clock.publish() as version:
        try:
            await engines.pause(pause_mode)
            if pause_mode == PauseMode.ABORT:
                # Only abort empties the engines: retract keeps requests waiting and in_place keeps
                # them running, and SGLang refuses to flush then. The engines flush after a disk
                # update anyway; this frees the KV cache early, so a busy engine is no failure.
                try:
                    await engines.flush_cache(flush_deadline)
                except EngineError:
                    pass
            t0 = time.perf_counter()
            await engines.update_weights_from_disk(str(weights), weight_version=str(version))
            update_seconds = time.perf_counter() - t0
        except EngineError as exc:
            raise PublishError(version, str(exc)) from exc
        finally:
            with anyio.move_on_after(CONTINUE_DEADLINE, shield=True):
                await engines.continue_generation()
    return PublishReport(version, time.perf_counter() - started, update_seconds)

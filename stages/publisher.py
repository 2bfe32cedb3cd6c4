"""Publishing new weights to the engines, coordinated with the version clock.

    close admission -> pause engines (abort | retract | in_place) -> flush cache (not in_place)
    -> update weights -> version += 1 -> continue engines -> open admission

The weights travel as a saved folder (`/update_weights_from_disk`) or, given a `WeightTransfer`,
over torch.distributed (`publish_distributed.py`) or by CUDA IPC to engines colocated on the
trainer's GPU (`publish_tensor.py`, which first takes back the memory the engines released). The
version moves only if every engine took the weights. Whatever happens, the engines are told to
continue: a failed publish leaves the old version serving, and says why.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import anyio
import structlog

from core.clock import VersionClock
from core.errors import EngineError, EngineUnavailableError, PublishError
from core.types import PauseMode

__all__ = ["AdmissionGates", "EngineMemory", "PublishReport", "WeightTarget", "WeightTransfer", "publish_weights"]

# The backstop on telling the engines to continue, which runs shielded (a publish cancelled midway
# must still leave the engines generating). Each engine's call has its own deadline, the fleet's
# control timeout (30 s by default), and with fault tolerance an engine that misses it is evicted:
# the backstop is longer, so that the engine's own timeout, which names it, comes first.
CONTINUE_DEADLINE = 60.0

log = structlog.get_logger("publisher")


class WeightTarget(Protocol):
    """The engine-side operations a publish needs (an `EngineFleet`)."""

    async def pause(self, mode: PauseMode) -> None: ...
    async def continue_generation(self) -> None: ...
    async def flush_cache(self, deadline: float) -> None: ...
    async def update_weights_from_disk(self, path: str, *, weight_version: str, flush_cache: bool = True) -> None: ...


class WeightTransfer(Protocol):
    """Another way to move the weights than a saved folder (`publish_distributed.DistributedWeightSender`,
    `publish_tensor.ColocatedWeights`)."""

    async def prepare(self) -> None:
        """Before the admission gate closes, while the engines still generate: whatever can be
        readied without them (reading the weights into buckets), so that the stall is the move
        alone. The next `send` takes it; may do nothing."""

    def discard(self) -> None:
        """Drop what `prepare` readied when no `send` followed (the publish failed before it)."""

    async def send(self, weight_version: str, *, flush_cache: bool) -> None:
        """Move the weights and stamp `weight_version`; `flush_cache` only while the engines hold
        no request (SGLang's scheduler asserts the flush after the update, and refuses it then)."""


class EngineMemory(Protocol):
    """GPU memory the engines give the trainer while it trains, colocated on its GPU
    (`publish_tensor.ColocatedWeights`, slime's `--colocate`): released after a round, taken back
    by the next publish's weight transfer."""

    async def release(self) -> None:
        """The engines are idle (the round is over): flush their cache and release their memory."""


class AdmissionGates(Protocol):
    """Admission gates beyond the clock's: producers in other processes, each with its own clock
    copy (`launch.ray_producers`). `close` returns once every producer stopped admitting (and, in
    abort mode, returned its partial groups) or was given up on; `open` tells them the version
    that serves after the publish, whether it moved or not."""

    async def close(self, version: int, pause_mode: PauseMode) -> None: ...
    async def open(self, version: int) -> None: ...


@dataclass(frozen=True, slots=True)
class PublishReport:
    """What one weight publish did: the version it made serve, and how long admission was held."""

    version: int
    gate_closed_seconds: float
    update_seconds: float  # the weight transfer itself; the rest of the gate time is coordination


async def publish_weights(
    clock: VersionClock,
    engines: WeightTarget,
    weights: Path,
    *,
    pause_mode: PauseMode,
    flush_deadline: float = 10.0,
    transfer: WeightTransfer | None = None,
    overlap: bool = False,
    gates: AdmissionGates | None = None,
) -> PublishReport:
    """Publish `weights` (a saved folder), or with `transfer` send them its way instead (the folder
    then is only the checkpoint); the same pause, flush and version steps either way.

    `overlap`: do not pause the engines at all. Engines that stage an update (the built-in and
    simulated ones) receive it while they keep decoding and swap between two decode steps, which
    is an in_place pause one step long; their version spans mark that step. The admission gate and
    the version move exactly as for a paused publish.

    `gates`: producers with clocks of their own close their admission after the clock's gate
    closes and before the engines pause, and learn the serving version once the publish ends."""
    if transfer is not None:  # before the gate: the engines keep generating meanwhile
        await transfer.prepare()
    started = time.perf_counter()
    update_seconds = 0.0
    try:
        with clock.publish() as version:
            if gates is not None:
                await gates.close(version, pause_mode)
            update_seconds = await _move_weights(
                engines,
                weights,
                version,
                pause_mode=pause_mode,
                flush_deadline=flush_deadline,
                transfer=transfer,
                overlap=overlap,
            )
    finally:
        if transfer is not None:
            transfer.discard()
        if gates is not None:
            with anyio.move_on_after(CONTINUE_DEADLINE, shield=True):
                await gates.open(clock.version)
    return PublishReport(version, time.perf_counter() - started, update_seconds)


async def _move_weights(
    engines: WeightTarget,
    weights: Path,
    version: int,
    *,
    pause_mode: PauseMode,
    flush_deadline: float,
    transfer: WeightTransfer | None,
    overlap: bool,
) -> float:
    """Pause, flush, update, continue; returns the seconds the update itself took."""
    update_seconds = 0.0
    try:
        if not overlap:
            await engines.pause(pause_mode)
        if pause_mode == PauseMode.ABORT and not overlap:
            # Only abort empties the engines: retract keeps requests waiting and in_place keeps
            # them running, and SGLang refuses to flush then. The engines flush after a disk
            # update anyway; this frees the KV cache early, so a busy engine is no failure.
            try:
                await engines.flush_cache(flush_deadline)
            except EngineError:
                pass
        # Only an abort pause empties the engines, and SGLang asserts that its flush after an
        # update succeeded: ask for none otherwise. The prefix cache then keeps entries computed
        # by the old weights, as the requests kept in place keep their KV cache.
        flush = pause_mode == PauseMode.ABORT and not overlap
        t0 = time.perf_counter()
        if transfer is None:
            await engines.update_weights_from_disk(str(weights), weight_version=str(version), flush_cache=flush)
        else:
            await transfer.send(str(version), flush_cache=flush)
        update_seconds = time.perf_counter() - t0
    except EngineError as exc:
        raise PublishError(version, str(exc)) from exc
    finally:
        if not overlap:
            await _continue(engines, quiet=sys.exc_info()[1] is not None)
    return update_seconds


async def _continue(engines: WeightTarget, *, quiet: bool) -> None:
    """Tell the engines to continue. An engine that does not answer is as loud as one that refuses
    the connection: an error (with fault tolerance the fleet evicts it instead, and this returns),
    never a silent shrug; a paused engine holds its requests until they time out. `quiet`: an error
    already ends the publish (or a cancellation), so this one is logged instead of replacing it."""
    failure: BaseException | None = None
    with anyio.move_on_after(CONTINUE_DEADLINE, shield=True) as scope:
        try:
            await engines.continue_generation()
        except EngineError as exc:
            failure = exc
    if scope.cancelled_caught:
        failure = EngineUnavailableError(
            "continue_generation",
            f"the engines did not answer within {CONTINUE_DEADLINE:g} s; they stay paused and hold their requests",
        )
    if failure is None:
        return
    if quiet:
        log.warning("telling the engines to continue failed as well", error=str(failure))
        return
    raise failure

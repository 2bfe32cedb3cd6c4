"""A generation request as the engines see it, how it ends, and the errors that refuse one.

Shared by the scheduler (which mutates requests), the wire protocol (which builds and renders them)
and the HTTP surface.
"""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio

from core.errors import PipelineError
from core.types import PauseMode  # one home for the pause modes; re-exported for the engines
from engines.seam import SamplingParams

__all__ = [
    "EngineClosedError",
    "Finish",
    "FinishKind",
    "GenerationHeldError",
    "InvalidRequestError",
    "PauseMode",
    "Request",
    "RequestState",
]


class InvalidRequestError(PipelineError):
    """A request the engine refuses (SGLang answers these with HTTP 400). `value` is the culprit."""

    def __init__(self, message: str, value: object = None) -> None:
        self.value = value
        super().__init__(message)


class EngineClosedError(PipelineError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


class GenerationHeldError(PipelineError):
    """The engine runs no request now: its GPU memory is released (`release_memory_occupation`),
    or its weights are undefined until the next update (HTTP 503, the reason as the message)."""


class FinishKind(enum.StrEnum):
    STOP_TOKEN = "stop_token"
    STOP_STR = "stop_str"
    LENGTH = "length"
    ABORT = "abort"  # aborted while running
    ABORT_WAITING = "abort_waiting"  # aborted while in the waiting queue
    ERROR = "error"  # the forward pass failed


@dataclass(frozen=True, slots=True)
class Finish:
    kind: FinishKind
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    def to_json(self) -> dict[str, Any]:
        """SGLang's `FINISH_*.to_json()` shapes (sglang-protocol.md 1.3)."""
        match self.kind:
            case FinishKind.STOP_TOKEN | FinishKind.STOP_STR:
                return {"type": "stop", "matched": self.matched}
            case FinishKind.LENGTH:
                return {"type": "length", "length": self.length}
            case FinishKind.ABORT:
                return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
            case FinishKind.ABORT_WAITING:
                return {"type": "abort", "message": "Abort in waiting queue"}
            case FinishKind.ERROR:
                return {
                    "type": "abort",
                    "message": self.message,
                    "status_code": 500,
                    "err_type": "InternalServerError",
                }


class RequestState(enum.Enum):
    """Where the scheduler holds a request."""

    NEW = "new"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    """One generation request. Mutated only by the core, on the event loop."""

    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    return_logprob: bool = False
    seed: int = 0  # filled from params.sampling_seed, or drawn at submit
    created: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # R3 (`return_routed_experts`): the routes of positions [0, routed_positions), int32 rows as
    # bytes, each from the forward that first read the position (engines/moe_routes.py); the answer
    # carries those from `routed_start_len` on.
    return_routed_experts: bool = False
    routed_start_len: int = 0
    routes: bytearray = field(default_factory=bytearray)
    routed_positions: int = 0
    # SC (`top_logprobs_num`): per output token, its step's top (token id, log-prob) pairs.
    top_logprobs_num: int = 0
    output_top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    finish: Finish | None = None
    finished_at: float | None = None
    updates: int = 0  # bumped on every change a client could see
    serial: int = 0  # unique per request for the engine's life (rids are reused); set at submit
    end_at: int | None = None  # where a length tail ends it (length_tail.py); set at submit
    # (first output index, weight version) for each run of tokens decoded under one version;
    # the scheduler adds a mark whenever the serving version changes while it tracks the request.
    version_marks: list[tuple[int, str]] = field(default_factory=list)
    state: RequestState = RequestState.NEW
    # Made by whoever waits and set by `_notify`: a stream's writer waits for every change, a whole
    # answer's handler for the finish alone. One event for both woke every non-streaming handler
    # at every token (each decode step, once per request in flight), for it to see no finish yet.
    _changed: anyio.Event | None = None
    _finished: anyio.Event | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    async def wait_finished(self) -> None:
        if self.finish is None:
            if self._finished is None:
                self._finished = anyio.Event()
            await self._finished.wait()

    async def changes(self) -> AsyncIterator[Request]:
        """Yield the request each time it gained tokens or finished (coalescing bursts); end once finished."""
        seen = 0
        while True:
            if self.updates != seen:
                seen = self.updates
                yield self
                if self.finish is not None:
                    return
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    def mark_version(self, version: str) -> None:
        """Tokens from here on are decoded under `version` (SGLang's per-token version spans)."""
        at = len(self.output_ids)
        if self.version_marks and self.version_marks[-1][1] == version:
            return
        if self.version_marks and self.version_marks[-1][0] == at:
            self.version_marks.pop()  # no token was decoded under the version it replaces
            if self.version_marks and self.version_marks[-1][1] == version:
                return
        self.version_marks.append((at, version))

    def version_spans(self) -> list[tuple[str, int, int]]:
        """(version, start, end) over output-token indices: contiguous from 0, the last end is the
        number of output tokens. A request with no tokens has one empty span."""
        marks = self.version_marks or [(0, "")]
        ends = [start for start, _ in marks[1:]] + [len(self.output_ids)]
        return [(version, start, end) for (start, version), end in zip(marks, ends, strict=True)]

    def _notify(self) -> None:
        self.updates += 1
        if self._changed is not None:
            changed, self._changed = self._changed, None
            changed.set()
        if self.finish is not None and self._finished is not None:
            self._finished.set()

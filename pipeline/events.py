"""The run's event log: what each engine slot did when, and when the trainer trained and published.

One JSON object per line in `events.jsonl` beside the metrics. Spans are recorded once, when they
end, with both their start and end, so a log cut by a crash holds only complete spans. Times are
seconds since the log was opened (`time.perf_counter` based, so they never go backwards).

    {"kind": "request", "slot": 3, "group": "e0000-p000000012", "sample": 5, "start": 1.20, "end": 1.94,
     "prefix": 0, "tokens": 41, "finish": "stop", "version": 2}
    {"kind": "train", "step": 4, "start": 2.00, "end": 2.31}
    {"kind": "publish", "version": 5, "start": 2.31, "end": 2.35}
    {"kind": "stop", "step": 4, "start": 1.96, "end": 1.99}     # partial rollout's "enough": abort + drain
    {"kind": "run", "started_at": 1796012345.6}                  # first line of each process's events
    {"kind": "regenerated", "count": 2, "groups": ["e0000-p000000004.requeued", ...], "why": {...}}
                                   # prompts a resume generates again after damage to the store

Recording costs one dict and one buffered write per request; `EventLog(None)` keeps the events in
memory only (benchmarks draw them without touching disk).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import IO, Any

import orjson

__all__ = ["EventLog", "read_events", "span"]


class EventLog:
    def __init__(self, path: Path | None = None, *, keep: bool = False) -> None:
        self._t0 = time.perf_counter()
        self._file: IO[bytes] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("ab")
        self._keep = keep or path is None
        self.events: list[dict[str, Any]] = []
        # Times restart at 0 with every process; a resumed run appends to the same file, so each
        # run first says when it started (wall clock) and the timeline lays runs end to end.
        self.record("run", started_at=time.time())

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def since(self, perf_counter_time: float) -> float:
        """A `time.perf_counter()` reading as seconds since the log was opened."""
        return perf_counter_time - self._t0

    def record(self, kind: str, **fields: Any) -> None:
        event = {"kind": kind, **fields}
        if self._keep:
            self.events.append(event)
        if self._file is not None:
            self._file.write(orjson.dumps(event) + b"\n")

    def span(self, kind: str, **fields: Any) -> _Span:
        """`with log.span("train", step=3):` records the span when the block ends."""
        return _Span(self, kind, fields)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def span(events: EventLog | None, kind: str, **fields: Any) -> AbstractContextManager[Any]:
    """`events.span(kind, ...)`, or nothing when the run keeps no event log."""
    return events.span(kind, **fields) if events is not None else nullcontext()


class _Span:
    def __init__(self, log: EventLog, kind: str, fields: dict[str, Any]) -> None:
        self._log, self._kind, self._fields = log, kind, fields

    def __enter__(self) -> _Span:
        self._start = self._log.now()
        return self

    def __exit__(self, *exc: object) -> None:
        self._log.record(self._kind, start=round(self._start, 6), end=round(self._log.now(), 6), **self._fields)


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """The events of a log file; a last line cut short by a crash is skipped."""
    with path.open("rb") as f:
        for line in f:
            try:
                yield orjson.loads(line)
            except orjson.JSONDecodeError:
                continue

"""Engine faults: which engines are live, the heartbeat that finds a dead or hung one, and the
counters a run reports.

An engine leaves the fleet on the first evidence that it cannot serve: a `/health_generate` that
does not answer 200 within the timeout (a hung engine, e.g. SIGSTOP, is found this way, not only a
dead one), a control call that found it unreachable, or (the only engine, no router in front) a
`/generate` it did not answer. It comes back only through `EngineFleet.readmit`, which makes its
weights and version current before it takes work.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["EngineRestarter", "FaultCounters", "FaultPolicy", "FaultStatistics"]


@dataclass(frozen=True, slots=True)
class FaultPolicy:
    """slime's `--use-fault-tolerance` knobs (same names, same defaults), plus what slime lacks:
    the fewest live engines the run goes on with (below it, the run waits while a restart is
    under way, and stops once none is left), and how often a restart is tried."""

    interval: float = 30.0  # --rollout-health-check-interval
    timeout: float = 30.0  # --rollout-health-check-timeout
    first_wait: float = 0.0  # --rollout-health-check-first-wait
    min_live: int = 1  # --min-live-engines
    max_restarts: int = 3  # tries per eviction before the engine is left out for good
    restart_backoff: float = 1.0  # seconds before the second try; doubles per try
    # While a publish has the engines quiet (paused, or loading weights), a probe that timed out
    # is asked again with this much patience: longer than SGLang's own 20 s health wait, so a live
    # engine answers (503) and only a hung one stays silent (`FleetFaults._unhealthy`).
    quiet_wait: float = 25.0

    def __post_init__(self) -> None:
        for name in ("interval", "timeout", "quiet_wait"):
            if getattr(self, name) <= 0:
                raise ValueError(f"health check {name} must be > 0 seconds, got {getattr(self, name)}")
        if self.first_wait < 0 or self.restart_backoff < 0:
            raise ValueError(
                f"first_wait and restart_backoff must be >= 0, got {self.first_wait}, {self.restart_backoff}"
            )
        if self.min_live < 1:
            raise ValueError(f"min_live must be >= 1, got {self.min_live}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")


class EngineRestarter(Protocol):
    """Restarts an engine the pipeline started, at the same URL, and returns once it is healthy.

    The fleet calls it after eviction; it must stop what is left of the old process first (a hung
    engine is alive, and holds its port and its in-flight connections)."""

    def __call__(self, url: str) -> Awaitable[None]: ...


@dataclass(frozen=True, slots=True)
class FaultStatistics:
    evictions_total: int
    restarts_total: int
    readmissions_total: int
    live: int
    reduced_capacity_seconds: float

    def as_metrics(self) -> dict[str, float]:
        return {
            "engines/evictions_total": float(self.evictions_total),
            "engines/restarts_total": float(self.restarts_total),
            "engines/live": float(self.live),
            "time/reduced_capacity": self.reduced_capacity_seconds,
        }


@dataclass(slots=True)
class FaultCounters:
    """Counts evictions, restarts and re-admissions, and the time spent with any engine out."""

    evictions: int = 0
    restarts: int = 0
    readmissions: int = 0
    _reduced_since: float | None = None
    _reduced_total: float = field(default=0.0)

    def capacity(self, live: int, total: int) -> None:
        """Record the fleet's size after a change; the clock runs while `live < total`."""
        now = time.monotonic()
        if live < total and self._reduced_since is None:
            self._reduced_since = now
        elif live >= total and self._reduced_since is not None:
            self._reduced_total += now - self._reduced_since
            self._reduced_since = None

    def snapshot(self, live: int) -> FaultStatistics:
        reduced = self._reduced_total
        if self._reduced_since is not None:
            reduced += time.monotonic() - self._reduced_since
        return FaultStatistics(self.evictions, self.restarts, self.readmissions, live, reduced)

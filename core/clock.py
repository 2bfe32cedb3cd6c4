"""The version clock: which policy version serves, and the gate that stops admission while a new
one is published to the engines.

    serving(v) --begin_publish--> publishing(v -> v+1) --commit--> serving(v+1)
                                                       --fail----> serving(v)

The version moves only on `commit`, i.e. after every engine took the new weights. Waiting is
event based: `wait_serving()` parks until the gate opens, nothing polls.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import anyio

__all__ = ["ClockStatistics", "VersionClock"]


@dataclass(frozen=True, slots=True)
class ClockStatistics:
    version: int
    publishing: bool
    publishes: int
    failed_publishes: int
    gate_closed_seconds: float  # total time admission was closed
    last_gate_closed_seconds: float


class VersionClock:
    """The serving policy version and the publish gate (see the module docstring)."""

    def __init__(self, version: int = 0) -> None:
        self._version = version
        self._publishing = False
        self._opened = anyio.Event()
        self._opened.set()
        self._closed_at = 0.0
        self._publishes = 0
        self._failed = 0
        self._closed_total = 0.0
        self._closed_last = 0.0

    @property
    def version(self) -> int:
        return self._version

    def start_at(self, version: int) -> None:
        """Serve `version` from now on, without a publish: a resumed run's engines were loaded with
        the weights of its last trained step, outside the clock."""
        if self._publishing:
            publishing = self._version + 1
            raise RuntimeError(f"the clock cannot start at version {version} while version {publishing} publishes")
        self._version = version

    @property
    def publishing(self) -> bool:
        return self._publishing

    async def wait_serving(self) -> int:
        """Wait until the admission gate is open; return the version that serves."""
        while self._publishing:
            await self._opened.wait()
        return self._version

    def begin_publish(self) -> int:
        """Close the admission gate. Returns the version being published."""
        if self._publishing:
            raise RuntimeError(f"version {self._version + 1} is already being published")
        self._publishing = True
        self._opened = anyio.Event()
        self._closed_at = time.perf_counter()
        return self._version + 1

    def end_publish(self, *, committed: bool) -> None:
        """Open the gate; bump the version only if the new weights were taken by every engine."""
        if not self._publishing:
            raise RuntimeError("end_publish without begin_publish")
        if committed:
            self._version += 1
            self._publishes += 1
        else:
            self._failed += 1
        self._closed_last = time.perf_counter() - self._closed_at
        self._closed_total += self._closed_last
        self._publishing = False
        self._opened.set()

    @contextmanager
    def publish(self) -> Iterator[int]:
        """`with clock.publish() as new_version:` commits on a clean exit, rolls back on an error."""
        new_version = self.begin_publish()
        try:
            yield new_version
        except BaseException:
            self.end_publish(committed=False)
            raise
        self.end_publish(committed=True)

    def statistics(self) -> ClockStatistics:
        return ClockStatistics(
            version=self._version,
            publishing=self._publishing,
            publishes=self._publishes,
            failed_publishes=self._failed,
            gate_closed_seconds=self._closed_total,
            last_gate_closed_seconds=self._closed_last,
        )

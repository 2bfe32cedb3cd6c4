"""The producers' mailbox: one Ray actor on the controller's node through which groups go out to
every producer and results come back from every producer, so that the controller makes one Ray
call each way per round whatever the number of producers (`--producer-mailbox`, the default).

    controller ── post({p: [group bytes]}) ──► mailbox ◄── collect(p) ── producer p (one per node)
        ▲                                          │  ▲
        └── take() ◄── (p, outcome, bytes)... ─────┘  └── deliver(p, results, statistics) ── producer p

Why: a Ray call costs the driver about a millisecond of CPU whatever it carries (BENCHMARKS.md
section 11). With a call to each producer each way, W producers cost the controller W calls a round,
so its CPU per sample could not fall as producers were added. Through the mailbox it makes one post
and one take a round in all: the producers' calls land on the mailbox's process, not the
controller's, and the busier the run, the more each of the controller's calls carries.

The mailbox holds nothing that is not also in the controller's store: a group it holds for a
producer is leased to that producer, and a result it holds is committed only when the controller
takes it, fenced by the lease like any result. Losing it loses no work (the store's leases expire and
the groups are served again from their stored state); the controller stops the run with a clear
error, and the next start resumes. It is placed on the controller's node, so it shares the
controller's fate, and takes no CPU reservation.

Plain asyncio: a Ray async actor runs every method on one event loop, so nothing here needs a lock.
This module does not import Ray (`launch.ray_cluster` wraps the class).
"""

from __future__ import annotations

import asyncio

__all__ = ["Mailbox"]

Result = tuple[str, str, bytes]  # (producer, outcome, group bytes)


class Mailbox:
    """Parcels of groups for each producer, and the results of all of them, oldest first."""

    def __init__(self) -> None:
        self._parcels: dict[str, list[bytes]] = {}
        self._posted: dict[str, asyncio.Event] = {}
        self._results: list[Result] = []
        self._statistics: dict[str, bytes] = {}
        self._failures: dict[str, str] = {}
        self._delivered = asyncio.Event()
        self._dropped: set[str] = set()

    # -- the controller's side ----------------------------------------------------------------
    async def post(self, parcels: dict[str, list[bytes]]) -> None:
        """Groups leased to each producer named, as codec bytes, in the order they were leased."""
        for name, data in parcels.items():
            if name in self._dropped or not data:
                continue  # given up on: its leases end at the controller, nobody collects these
            self._parcels.setdefault(name, []).extend(data)
            self._event(name).set()

    async def take(self) -> tuple[list[Result], dict[str, bytes], dict[str, str]]:
        """Once anything has come back: every result waiting, oldest first; the latest statistics
        of each producer that delivered since; and why any producer's stages failed."""
        while not self._results and not self._failures:
            self._delivered.clear()
            await self._delivered.wait()
        results, self._results = self._results, []
        statistics, self._statistics = self._statistics, {}
        failures, self._failures = self._failures, {}
        return results, statistics, failures

    async def drop(self, name: str) -> None:
        """The controller gave producer `name` up: forget what waits for it, take nothing more of it."""
        self._dropped.add(name)
        self._parcels.pop(name, None)
        if (event := self._posted.get(name)) is not None:
            event.set()  # a collect in flight answers with nothing

    # -- the producers' side ------------------------------------------------------------------
    async def collect(self, name: str) -> list[bytes]:
        """Once something waits for producer `name`: all of it (nothing once it was dropped)."""
        while not self._parcels.get(name) and name not in self._dropped:
            event = self._event(name)
            event.clear()
            await event.wait()
        return self._parcels.pop(name, [])

    async def deliver(
        self, name: str, results: list[tuple[str, bytes]], statistics: bytes | None, failure: str | None = None
    ) -> None:
        """Producer `name`'s finished groups as (outcome, bytes), its statistics as of now (None: none
        to give, its stages having failed), and, when its stages failed, why (the controller gives it up)."""
        if name in self._dropped:
            return  # anything of it would be fenced anyway
        self._results.extend((name, kind, data) for kind, data in results)
        if statistics is not None:
            self._statistics[name] = statistics
        if failure is not None:
            self._failures[name] = failure
        self._delivered.set()

    def _event(self, name: str) -> asyncio.Event:
        return self._posted.setdefault(name, asyncio.Event())

"""Admission: how many groups the dispenser may start, and how many are still out.

The controller's rollout policy (sync, sync + partial, async) decides *how many* groups to start by
granting tickets; the dispenser decides *which* ones. Every ticket stays "outstanding" until the group
it admitted reaches a final place for this round: ready, rejected, failed, or back in the store as a
partial group. Waiters are woken by events, never by polling.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import anyio

__all__ = ["Admission", "AdmissionStatistics", "Outcome"]


class Outcome(enum.Enum):
    READY = "ready"
    REJECTED = "rejected"
    FAILED = "failed"
    PARTIAL = "partial"


@dataclass(frozen=True, slots=True)
class AdmissionStatistics:
    tickets: int  # granted, not yet taken by the dispenser
    outstanding: int  # granted and not yet settled (includes `tickets`)
    ready: int
    rejected: int
    failed: int
    partial: int


class Admission:
    def __init__(self) -> None:
        self._tickets = 0
        self._outstanding = 0
        self._counts = {o: 0 for o in Outcome}
        self._changed = anyio.Event()

    # -- the policy's side ------------------------------------------------------------------
    def grant(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"cannot grant {n} tickets")
        self._tickets += n
        self._outstanding += n
        self._notify()

    def revoke(self) -> int:
        """Take back every ticket the dispenser has not used yet; return how many."""
        n, self._tickets = self._tickets, 0
        self._outstanding -= n
        self._notify()
        return n

    @property
    def outstanding(self) -> int:
        return self._outstanding

    @property
    def tickets(self) -> int:
        """Granted tickets the dispenser has not used yet."""
        return self._tickets

    def count(self, outcome: Outcome) -> int:
        return self._counts[outcome]

    async def wait_change(self) -> None:
        """Wait until a ticket is granted, used or settled."""
        await self._changed.wait()

    async def wait_settled(self) -> None:
        """Wait until nothing is outstanding: every admitted group has reached its final place."""
        while self._outstanding:
            await self._changed.wait()

    # -- the dispenser's side ---------------------------------------------------------------
    async def take_ticket(self) -> None:
        await self.take_tickets(1)

    async def take_tickets(self, limit: int) -> int:
        """Wait for a ticket, then take every granted one up to `limit`; returns how many (>= 1).

        The dispenser admits that many groups in one store call instead of one call each."""
        if limit < 1:
            raise ValueError(f"take_tickets(limit={limit}): the limit is at least 1")
        while not self._tickets:
            await self._changed.wait()
        n = min(limit, self._tickets)
        self._tickets -= n
        self._notify()
        return n

    # -- the stages' side -------------------------------------------------------------------
    def settle(self, outcome: Outcome) -> None:
        """A group reached `outcome`. Called once per admitted group."""
        if self._outstanding <= self._tickets:
            raise RuntimeError(f"settle({outcome.value}) with no admitted group outstanding")
        self._outstanding -= 1
        self._counts[outcome] += 1
        self._notify()

    def _notify(self) -> None:
        # A fresh event per change: everyone waiting on the old one wakes and re-checks.
        self._changed.set()
        self._changed = anyio.Event()

    def statistics(self) -> AdmissionStatistics:
        c = self._counts
        return AdmissionStatistics(
            self._tickets,
            self._outstanding,
            c[Outcome.READY],
            c[Outcome.REJECTED],
            c[Outcome.FAILED],
            c[Outcome.PARTIAL],
        )

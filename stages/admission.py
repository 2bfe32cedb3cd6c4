"""Admission: how many groups the dispenser may start, and how many are still out.

The controller's rollout policy (sync, sync + partial, async) decides *how many* groups to start by
granting tickets; the dispenser decides *which* ones. Every ticket stays "outstanding" until the group
it admitted reaches a final place for this round: ready, rejected, failed, or back in the store as a
partial group. Waiters are woken by events, never by polling.

Failed groups are stored with their error and counted (the stage that failed one also logs its
first group of each distinct error: `stages.failures`). When a long run of groups in a row
all failed (`failing_limit`, with no ready or rejected group in between), `grant` refuses to start
more: a cause that fails every group (prompts longer than the engine's context, a reward that
always raises) would otherwise turn the whole dataset into failed groups, round after round,
without ever filling a batch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import anyio

from core.errors import GroupsFailingError
from core.types import Group

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
    def __init__(self, *, failing_limit: int | None = None) -> None:
        if failing_limit is not None and failing_limit < 1:
            raise ValueError(f"failing_limit={failing_limit}: must be >= 1 (or None: no limit)")
        self._tickets = 0
        self._outstanding = 0
        self._counts = {o: 0 for o in Outcome}
        self._changed = anyio.Event()
        self._failing_limit = failing_limit
        self._failed_in_a_row = 0  # reset by a ready or rejected group; a partial one says nothing
        self._last_failure: str | None = None

    # -- the policy's side ------------------------------------------------------------------
    def grant(self, n: int) -> None:
        """Allow `n` more groups to start. Raises `GroupsFailingError` once the last
        `failing_limit` groups all failed: more of the same would fail too."""
        if n < 0:
            raise ValueError(f"cannot grant {n} tickets")
        if n and self._failing_limit is not None and self._failed_in_a_row >= self._failing_limit:
            raise GroupsFailingError(self._failed_in_a_row, self._last_failure)
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
    def settle(self, outcome: Outcome, group: Group | None = None) -> None:
        """A group reached `outcome`. Called once per admitted group; a failed one is passed as
        `group`, so that its error can be named if the run stops for failures."""
        if self._outstanding <= self._tickets:
            raise RuntimeError(f"settle({outcome.value}) with no admitted group outstanding")
        self._outstanding -= 1
        self._counts[outcome] += 1
        if outcome is Outcome.FAILED:
            self._failed_in_a_row += 1
            if group is not None:
                self._last_failure = f"group {group.group_id}: {first_error(group)}"
        elif outcome is not Outcome.PARTIAL:
            self._failed_in_a_row = 0
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


def first_error(group: Group) -> str:
    """The error of the group's first failed sample (what `replay group ID` shows for each)."""
    return next((s.error for s in group.samples if s.error), "no error recorded")

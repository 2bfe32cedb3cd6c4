"""An LMDB store's leases: who runs a RUNNING group, and the fence on a producer's results.

Leases live in their own database (see `storage.keys`); the store's `clock` (default `time.time`)
is what expiry is measured against, injectable so tests can stand exactly on an expiry boundary.
Each method is one transaction."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lmdb

from core.errors import StoreError
from core.types import Group

from . import codec, keys
from . import transitions as tr
from .lmdb_ready import ReadyCache
from .lmdb_transactions import LmdbTransactions
from .lmdb_txn import Txn
from .protocol import DEFAULT_LEASE_SECONDS, DEFAULT_OWNER, GroupState, Lease
from .transitions import check_hand_over, check_lease

__all__ = ["LeaseMoves"]

_RUNNING, _PARTIAL, _READY = GroupState.RUNNING, GroupState.PARTIAL, GroupState.READY


class LeaseMoves:
    """The leases of `tx`'s RUNNING groups, measured against `clock`; a result accepted as READY
    joins `ready`."""

    def __init__(self, tx: LmdbTransactions, ready: ReadyCache, clock: Callable[[], float]) -> None:
        self._tx, self._ready, self._clock = tx, ready, clock

    def lease(self, group_id: str) -> Lease | None:
        def fn(txn: lmdb.Transaction) -> Lease | None:
            found = self._tx.view(txn).lease_of(group_id)
            return None if found is None else Lease(*found)

        return self._tx.read(fn)

    def renew_leases(self, owner: str, lease_seconds: float) -> int:
        check_lease(owner, lease_seconds)

        def fn(w: Txn) -> int:
            value = keys.lease_value(owner, self._clock() + lease_seconds)
            mine = [gid for gid, holder, _ in w.all_leases() if holder == owner]
            for gid in mine:
                w.put(keys.LEASES, keys.group_key(gid), value)
            return len(mine)

        return self._tx.write(fn)

    def hand_over(self, group_id: str, *, owner: str, to: str, lease_seconds: float) -> None:
        self.hand_over_groups([group_id], owner=owner, to=to, lease_seconds=lease_seconds)

    def hand_over_groups(self, group_ids: Sequence[str], *, owner: str, to: str, lease_seconds: float) -> None:
        check_lease(to, lease_seconds)
        if not group_ids:
            return
        tr.check_distinct_ids(group_ids, f"hand-over to {to!r}")

        def fn(w: Txn) -> None:
            # A refused group raises here, and the transaction with the leases moved before it aborts.
            value = keys.lease_value(to, self._clock() + lease_seconds)
            for gid in group_ids:
                old = w.state_of(gid)
                held = w.lease_of(gid) if old is not None and old[0] is _RUNNING else None
                check_hand_over(gid, None if old is None else old[0], owner, None if held is None else held[0], to)
                w.put(keys.LEASES, keys.group_key(gid), value)

        self._tx.write(fn)

    def accept_results(
        self,
        owner: str,
        results: Sequence[tuple[GroupState, Group]],
        *,
        to: str = DEFAULT_OWNER,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> dict[str, str]:
        check_lease(to, lease_seconds)
        if not results:
            return {}
        tr.check_distinct_ids([g.group_id for _, g in results], f"batch of results from {owner!r}")
        for state, group in results:
            tr.check_result_state(group.group_id, state)
        # Encode before the transaction (a lease handed back keeps its record: nothing to encode).
        records = [
            (state, g, keys.group_key(g.group_id), None if state is _RUNNING else codec.encode_group(g))
            for state, g in results
        ]

        def fn(w: Txn) -> dict[str, str]:
            refused: dict[str, str] = {}
            lease = keys.lease_value(to, self._clock() + lease_seconds)
            for state, group, key, data in records:
                gid = group.group_id
                old = w.state_of(gid)
                held = w.lease_of(gid) if old is not None and old[0] is _RUNNING else None
                now, holder = None if old is None else old[0], None if held is None else held[0]
                try:
                    if data is None:
                        check_hand_over(gid, now, owner, holder, to)
                    else:
                        tr.check_put(gid, now, state, owner, holder)
                except StoreError as exc:  # fenced: left out, written nothing; the others go on
                    refused[gid] = str(exc)
                    continue
                assert old is not None
                if data is None:
                    w.put(keys.LEASES, key, lease)
                else:
                    w.put(keys.GROUPS, key, data)
                    w.move(gid, old, state, group.oldest_version, group.seq)
                    if state is _READY or state is GroupState.REJECTED:
                        w.note_outcome(group)
            return refused

        def committed(refused: dict[str, str]) -> None:
            for state, group in results:
                if state is _READY and group.group_id not in refused:
                    self._ready.remember(group)

        return self._tx.write(fn, committed)

    def reclaim_expired(self, now: float | None = None) -> int:
        def fn(w: Txn) -> int:
            at = self._clock() if now is None else now
            expired = [gid for gid, _, expiry in w.all_leases() if expiry <= at]
            for gid in expired:
                old = w.expect(gid, _RUNNING)
                w.move(gid, old, _PARTIAL, old[1], old[2])
            return len(expired)

        return self._tx.write(fn)

"""An LMDB store's group states and their moves: `admit`, `claim_partial`, and the `put_*` moves
out of RUNNING (`put`: the store's `put_*`). Each is one transaction; the state table and every
refusal's message are `storage.transitions`'."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from core.types import Group

from . import codec, keys
from . import transitions as tr
from .lmdb_ready import ReadyCache
from .lmdb_transactions import LmdbTransactions
from .lmdb_txn import Txn
from .protocol import DEFAULT_LEASE_SECONDS, DEFAULT_OWNER, Cursor, GroupState
from .transitions import check_lease

__all__ = ["GroupMoves"]

_RUNNING, _PARTIAL, _READY, _REJECTED = GroupState.RUNNING, GroupState.PARTIAL, GroupState.READY, GroupState.REJECTED


class GroupMoves:
    """The moves of `tx`'s groups into and out of RUNNING; a group put in READY joins `ready`."""

    def __init__(self, tx: LmdbTransactions, ready: ReadyCache, clock: Callable[[], float]) -> None:
        self._tx, self._ready, self._clock = tx, ready, clock

    def admit(
        self,
        groups: Sequence[Group],
        cursor: Cursor,
        *,
        owner: str = DEFAULT_OWNER,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        skipped: Sequence[Group] = (),
    ) -> None:
        check_lease(owner, lease_seconds)
        tr.check_skipped(skipped)
        # Encode before the transaction: the write lock is held only for the writes themselves.
        records = []
        seen: set[str] = set()
        for group, to in [*((g, _RUNNING) for g in groups), *((g, _REJECTED) for g in skipped)]:
            gid = group.group_id
            if gid in seen:
                raise tr.duplicate_in_admit(gid)
            seen.add(gid)
            records.append((gid, keys.group_key(gid), codec.encode_group(group), group.oldest_version, group.seq, to))
        cursor_record = codec.encode_cursor(cursor)

        def fn(w: Txn) -> None:
            lease = keys.lease_value(owner, self._clock() + lease_seconds)
            for gid, key, data, version, seq, to in records:
                if (step := w.get(keys.TOMBSTONES, key)) is not None:
                    raise tr.already_collected(gid, keys.parse_i64(step, key=keys.describe(keys.TOMBSTONES, key)))
                if not w.put(keys.GROUPS, key, data, overwrite=False):
                    state = w.state_of(gid)
                    raise tr.already_exists(gid, None if state is None else state[0])
                w.move(gid, None, to, version, seq, lease if to is _RUNNING else None)
            w.put(keys.META, keys.META_CURSOR, cursor_record)
            w.cursor = cursor

        self._tx.write(fn)

    def claim_partial(
        self, limit: int, *, owner: str = DEFAULT_OWNER, lease_seconds: float = DEFAULT_LEASE_SECONDS
    ) -> list[Group]:
        check_lease(owner, lease_seconds)

        def fn(w: Txn) -> list[Group]:
            lease = keys.lease_value(owner, self._clock() + lease_seconds)
            claimed = []
            for gid, old, group in w.serve(_PARTIAL, limit, self._ready):
                claimed.append(group)
                w.move(gid, old, _RUNNING, old[1], old[2], lease)
            return claimed

        return self._tx.write(fn)

    def put(self, groups: Sequence[Group], to: GroupState, owner: str | None) -> None:
        """Every group RUNNING -> `to` in one transaction: a refused one raises inside it, and the
        transaction, with whatever it wrote of the groups before, is aborted."""
        if not groups:
            return
        if len(groups) > 1:
            tr.check_distinct(groups, to)
        # Encode before the transaction: the write lock is held only for the writes themselves.
        records = [
            (g.group_id, keys.group_key(g.group_id), codec.encode_group(g), g.oldest_version, g.seq) for g in groups
        ]

        def fn(w: Txn) -> None:
            for gid, key, data, version, seq in records:
                old = w.state_of(gid)
                holder = w.lease_of(gid) if owner is not None and old is not None and old[0] is _RUNNING else None
                tr.check_put(gid, None if old is None else old[0], to, owner, None if holder is None else holder[0])
                assert old is not None
                w.put(keys.GROUPS, key, data)
                w.move(gid, old, to, version, seq)
            if to is _READY or to is _REJECTED:
                for group in groups:
                    w.note_outcome(group)

        def committed(_: None) -> None:
            if to is not _READY:
                return
            for group in groups:
                self._ready.remember(group)

        self._tx.write(fn, committed)

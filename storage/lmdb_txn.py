"""`Txn`: one LMDB transaction as the store sees it: sealed reads and writes, the indexes moved
together, and the store's counters as they will be if it commits.

Every store method is one `Txn` (or, under group commit, one call inside a shared one): a method
reads and moves groups through it, and `storage.lmdb_transactions` commits it or throws it away.
The counters are copies: a transaction that aborts (an error, or a full map that is retried)
leaves the store's own counters untouched.

Layout (see `storage.keys`): a record per group, a small state entry per group, a by-state index
and two ordering indexes, so serving k groups (`serve`) reads the first k keys of an index
(O(k log n)) instead of scanning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import lmdb

from core.errors import CorruptRecordError, StoreError
from core.types import Batch, Group

from . import codec, keys
from . import transitions as tr
from .history import PromptHistory, decode_history, encode_history, outcome_of, updated_history
from .protocol import Cursor, GroupState
from .seal import seal, unseal

__all__ = ["ORDER_DB", "StateEntry", "Txn"]

_RUNNING = GroupState.RUNNING
ORDER_DB = {GroupState.PARTIAL: keys.PARTIAL_ORDER, GroupState.READY: keys.READY_ORDER}
StateEntry = tuple[GroupState, int, int]  # (state, oldest version, seq)


class Txn:
    """One transaction plus the store's counters as they will be if it commits."""

    __slots__ = ("collected", "counts", "cursor", "dbs", "sealed", "trained_step", "txn")

    def __init__(
        self,
        txn: lmdb.Transaction,
        dbs: dict[bytes, lmdb._Database],
        *,
        sealed: bool,
        counts: Mapping[GroupState, int],
        cursor: Cursor,
        trained_step: int,
        collected: tuple[int, int],
    ) -> None:
        self.txn, self.dbs = txn, dbs
        self.sealed = sealed
        self.counts = dict(counts)
        self.cursor = cursor
        self.trained_step = trained_step
        self.collected = collected  # (groups collected, last step collected)

    def get(self, db: bytes, key: bytes) -> bytes | None:
        """The payload stored under `key` in `db`, its checksum checked; None if there is none."""
        raw = self.txn.get(key, db=self.dbs[db])
        return None if raw is None else unseal(key, raw, where=keys.describe(db, key), sealed=self.sealed)

    def put(self, db: bytes, key: bytes, payload: bytes, *, overwrite: bool = True) -> bool:
        value = seal(key, payload) if self.sealed else payload
        return bool(self.txn.put(key, value, db=self.dbs[db], overwrite=overwrite))

    def unseal(self, db: bytes, key: bytes, value: bytes) -> bytes:
        return unseal(bytes(key), value, where=keys.describe(db, key), sealed=self.sealed)

    # --- group states ---------------------------------------------------------------------------

    def state_of(self, gid: str) -> StateEntry | None:
        key = keys.group_key(gid)
        raw = self.get(keys.STATE, key)
        return None if raw is None else keys.parse_state_entry(raw, key=keys.describe(keys.STATE, key))

    def expect(self, gid: str, state: GroupState) -> StateEntry:
        """The group's state entry, which an index says is `state`; StoreError if it is not."""
        entry = self.state_of(gid)
        if entry is None or entry[0] is not state:
            found = "missing" if entry is None else entry[0].value
            raise StoreError(f"group {gid!r} is indexed as {state.value} but its state is {found}")
        return entry

    def move(
        self, gid: str, old: StateEntry | None, new: GroupState, version: int, seq: int, lease: bytes | None = None
    ) -> None:
        """Point every index at the group's new state (and, for PARTIAL/READY, its serving place).

        A group entering RUNNING gets `lease`; one leaving RUNNING loses its lease.
        """
        txn, dbs = self.txn, self.dbs
        if (new is _RUNNING) != (lease is not None):
            raise AssertionError(f"group {gid!r}: a lease goes with RUNNING and only with it")
        tr.check_move(gid, None if old is None else old[0], new)
        if old is not None:
            old_state, old_version, old_seq = old
            if old_state is _RUNNING:
                txn.delete(keys.group_key(gid), db=dbs[keys.LEASES])
            removed = txn.delete(keys.by_state_key(old_state, gid), db=dbs[keys.BY_STATE])
            if old_state in ORDER_DB:
                key = keys.order_key(old_version, old_seq, gid)
                removed = txn.delete(key, db=dbs[ORDER_DB[old_state]]) and removed
            if not removed:
                raise StoreError(f"group {gid!r}: the indexes do not agree with its state {old_state.value}")
            self.counts[old_state] -= 1
        self.put(keys.STATE, keys.group_key(gid), keys.state_entry(new, version, seq))
        txn.put(keys.by_state_key(new, gid), b"", db=dbs[keys.BY_STATE])
        if new in ORDER_DB:
            txn.put(keys.order_key(version, seq, gid), b"", db=dbs[ORDER_DB[new]])
        if lease is not None:
            self.put(keys.LEASES, keys.group_key(gid), lease)
        self.counts[new] += 1

    def ids_in_state(self, state: GroupState) -> list[str]:
        prefix = keys.by_state_prefix(state)
        found = []
        cursor = self.txn.cursor(db=self.dbs[keys.BY_STATE])
        if cursor.set_range(prefix):
            for key in cursor.iternext(keys=True, values=False):
                if not bytes(key).startswith(prefix):
                    break
                found.append(keys.group_id_of_by_state_key(bytes(key)))
        return found

    # --- prompt histories -----------------------------------------------------------------------

    def history(self, index: int) -> PromptHistory | None:
        if keys.HISTORY not in self.dbs:  # a reader of a store from before histories
            return None
        key = keys.history_key(index)
        raw = self.get(keys.HISTORY, key)
        return None if raw is None else decode_history(raw, key=keys.describe(keys.HISTORY, key))

    def note_outcome(self, group: Group) -> None:
        """A group leaving RUNNING for READY or REJECTED: its outcome joins its prompt's history,
        in this transaction (a group without every reward adds nothing)."""
        outcome = outcome_of(group)
        if outcome is None:
            return
        index = group.task.index
        updated = updated_history(self.history(index), index, outcome)
        self.put(keys.HISTORY, keys.history_key(index), encode_history(updated))

    # --- leases ---------------------------------------------------------------------------------

    def lease_of(self, gid: str) -> tuple[str, float] | None:
        key = keys.group_key(gid)
        raw = self.get(keys.LEASES, key)
        return None if raw is None else keys.parse_lease(raw, key=keys.describe(keys.LEASES, key))

    def all_leases(self) -> list[tuple[str, str, float]]:
        """(group id, owner, expiry) of every RUNNING group."""
        out = []
        for raw_key, value in self.txn.cursor(db=self.dbs[keys.LEASES]).iternext(keys=True, values=True):
            key = bytes(raw_key)
            where = keys.describe(keys.LEASES, key)
            owner, expiry = keys.parse_lease(unseal(key, bytes(value), where=where, sealed=self.sealed), key=where)
            out.append((key.decode(), owner, expiry))
        return out

    # --- group records and serving order --------------------------------------------------------

    def group(self, gid: str) -> Group:
        key = keys.group_key(gid)
        raw = self.get(keys.GROUPS, key)
        if raw is None:
            raise CorruptRecordError(keys.describe(keys.GROUPS, key), "indexed, but the record is missing")
        return codec.decode_group(raw, key=keys.describe(keys.GROUPS, key))

    def readable(self, ids: Sequence[str], damaged: list[CorruptRecordError] | None) -> list[Group]:
        """The groups `ids`; with `damaged`, a record that fails its checksum is appended there and
        skipped instead of raising."""
        if damaged is None:
            return [self.group(gid) for gid in ids]
        out = []
        for gid in ids:
            try:
                out.append(self.group(gid))
            except CorruptRecordError as exc:
                damaged.append(exc)
        return out

    def first_in_order(self, state: GroupState, limit: int) -> list[str]:
        out: list[str] = []
        if limit <= 0:
            return out
        for key in self.txn.cursor(db=self.dbs[ORDER_DB[state]]).iternext(keys=True, values=False):
            out.append(keys.group_id_of_order_key(bytes(key)))
            if len(out) == limit:
                break
        return out

    def serve(self, state: GroupState, limit: int, decoded: Mapping[str, Group]) -> list[tuple[str, StateEntry, Group]]:
        """Up to `limit` groups of `state` (PARTIAL or READY) in serving order, read and checked;
        a READY group found in `decoded` (the writer's ready cache) is not read again.

        A group whose record fails its checksum is never served: it moves to QUARANTINED in this
        same transaction (record kept as it is) and the next one in order is served instead."""
        served: list[tuple[str, StateEntry, Group]] = []
        seen: set[str] = set()
        while len(served) < limit:
            new = [gid for gid in self.first_in_order(state, limit) if gid not in seen]
            if not new:
                break
            for gid in new[: limit - len(served)]:
                seen.add(gid)
                old = self.expect(gid, state)
                try:
                    group = decoded.get(gid) if state is GroupState.READY else None
                    served.append((gid, old, group if group is not None else self.group(gid)))
                except CorruptRecordError:
                    self.move(gid, old, GroupState.QUARANTINED, old[1], old[2])
        return served

    # --- batches --------------------------------------------------------------------------------

    def first_open_step(self) -> int | None:
        """The first step with a batch record after the trained step; None if there is none."""
        cursor = self.txn.cursor(db=self.dbs[keys.BATCHES])
        if not cursor.set_range(keys.step_key(self.trained_step + 1)):
            return None
        return keys.parse_step_key(bytes(cursor.key()))

    def batch_from_ref(self, step_key: bytes, raw: bytes) -> Batch:
        step, ids = codec.decode_batch_ref(raw, key=keys.describe(keys.BATCHES, step_key))
        return Batch(step=step, groups=tuple(self.group(gid) for gid in ids))

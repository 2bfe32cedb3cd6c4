"""`LmdbStore.verify()`: every record read and checked, every index checked against the states.

The check on open is cheap (meta pages, layout, counters against LMDB's entry counts, the run
record: microseconds, whatever the store holds); this one reads everything, so it costs about as
much as reading the store once (see BENCHMARKS.md, "store costs"). `python -m pipeline.replay
RUN_DIR verify` runs it. It never stops at the first problem: a damaged record is named and the
walk goes on; a damaged page that ends a database's walk is named, and the next database is
walked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import lmdb

from core.errors import StoreError

from . import codec, keys
from .history import decode_history
from .migrate import SEALED_DATABASES, Databases, counter_problems
from .protocol import GroupState, VerifyReport
from .seal import unseal

__all__ = ["verify_records"]

_ORDER_DB = {GroupState.PARTIAL: keys.PARTIAL_ORDER, GroupState.READY: keys.READY_ORDER}


def _checker(db: bytes, key: bytes) -> Callable[[bytes, str], object]:
    """How a payload of `db` (under `key`) is decoded, to check it is what this code writes."""
    if db == keys.GROUPS:
        return lambda raw, where: codec.decode_group(raw, key=where)
    if db == keys.STATE:
        return lambda raw, where: keys.parse_state_entry(raw, key=where)
    if db == keys.BATCHES:
        return lambda raw, where: codec.decode_batch_ref(raw, key=where)
    if db == keys.LEASES:
        return lambda raw, where: keys.parse_lease(raw, key=where)
    if db == keys.HISTORY:
        return lambda raw, where: decode_history(raw, key=where)
    if db == keys.TOMBSTONES or key in (keys.META_TRAINED_STEP,):
        return lambda raw, where: keys.parse_i64(raw, key=where)
    meta = {
        keys.META_RUN: lambda raw, where: codec.decode_meta(raw, key=where),
        keys.META_CURSOR: lambda raw, where: codec.decode_cursor(raw, key=where),
        keys.META_COUNTS: lambda raw, where: keys.parse_counts(raw),
        keys.META_COLLECTED: lambda raw, where: keys.parse_collected(raw),
    }
    return meta.get(key, lambda raw, where: raw)


def verify_records(
    env: lmdb.Environment, dbs: Databases, *, sealed: bool, counts: dict[GroupState, int]
) -> VerifyReport:
    damaged: list[str] = []
    records = 0
    states: dict[str, tuple[GroupState, int, int]] = {}
    for db in (*SEALED_DATABASES, *(name for name in keys.OPTIONAL_DATABASES if name in dbs)):
        # A fresh transaction each: an LMDB error poisons its transaction, not the next database.
        with env.begin() as txn:
            records += _walk_values(txn, dbs, db, sealed=sealed, damaged=damaged, states=states)
    try:
        with env.begin() as txn:
            damaged += _index_problems(txn, dbs, states, counts)
    except lmdb.Error as exc:
        damaged.append(f"the indexes cannot be walked: LMDB: {exc}")
    return VerifyReport(records=records, damaged=tuple(damaged))


def _walk_values(
    txn: lmdb.Transaction,
    dbs: Databases,
    db: bytes,
    *,
    sealed: bool,
    damaged: list[str],
    states: dict[str, tuple[GroupState, int, int]],
) -> int:
    """Every value of `db` unsealed and decoded; damage appended to `damaged`. Returns values read."""
    records = 0
    try:
        for raw_key, value in txn.cursor(db=dbs[db]).iternext(keys=True, values=True):
            key = bytes(raw_key)
            if db == keys.META and key == keys.META_LAYOUT:
                continue  # checked on open, in its own form
            records += 1
            where = keys.describe(db, key)
            try:
                decoded = _checker(db, key)(unseal(key, value, where=where, sealed=sealed), where)
            except StoreError as exc:
                damaged.append(str(exc))
                continue
            if db == keys.STATE:
                states[key.decode(errors="replace")] = decoded  # type: ignore[assignment]
    except lmdb.Error as exc:
        damaged.append(f"database {db.decode()!r} is damaged after {records} records: LMDB: {exc}")
    return records


def _index_problems(
    txn: lmdb.Transaction,
    dbs: Databases,
    states: dict[str, tuple[GroupState, int, int]],
    counts: dict[GroupState, int],
) -> list[str]:
    """Each state entry has its record and index entries, and the counters match the states."""
    problems: list[str] = []
    try:
        for gid, (state, version, seq) in states.items():
            key = keys.group_key(gid)
            if txn.get(key, db=dbs[keys.GROUPS]) is None:
                problems.append(f"group {gid!r} ({state.value}) has a state entry but no record")
            if txn.get(keys.by_state_key(state, gid), db=dbs[keys.BY_STATE]) is None:
                problems.append(f"group {gid!r} ({state.value}) is missing from the by-state index")
            if state in _ORDER_DB and txn.get(keys.order_key(version, seq, gid), db=dbs[_ORDER_DB[state]]) is None:
                problems.append(f"group {gid!r} ({state.value}) is missing from its serving order")
            if state is GroupState.RUNNING and txn.get(key, db=dbs[keys.LEASES]) is None:
                problems.append(f"group {gid!r} is running but has no lease")
        entries = {name: txn.stat(dbs[name])["entries"] for name in keys.DATABASES}
    except lmdb.Error as exc:
        return [*problems, f"the indexes cannot be walked: LMDB: {exc}"]
    found = Counter(state for state, _, _ in states.values())
    if dict(found) != {s: n for s, n in counts.items() if n}:
        shown = ", ".join(
            f"{s.value} {counts.get(s, 0)} counted, {found.get(s, 0)} found"
            for s in GroupState
            if counts.get(s, 0) != found.get(s, 0)
        )
        problems.append(f"the per-state counters disagree with the state entries: {shown}")
    return problems + counter_problems(counts, entries)

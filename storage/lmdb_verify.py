"""`LmdbStore.verify()`: every record read and checked, every index checked against the states.

The check on open is cheap (meta pages, layout, counters against LMDB's entry counts, the run
record: microseconds, whatever the store holds); this one reads everything, so it costs about as
much as reading the store once (see BENCHMARKS.md, "store costs"). `python -m pipeline.replay
RUN_DIR verify` runs it. It never stops at the first problem: a damaged record is named and the
walk goes on; a damaged page that ends a database's walk is named, and the next database is
walked.

It streams: one record in memory at a time (the largest record bounds what it holds, never the
store's size), each state entry's index entries checked as the entry is read, and `progress`
told the bytes of every value read (`replay verify`'s progress bar). LMDB's map is file-backed:
the pages read count in the process's RSS as page cache the kernel takes back, not as its own.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import lmdb

from core.errors import StoreError

from . import codec, keys
from .history import decode_history
from .lmdb_checksums import CHECK_THREADS
from .migrate import SEALED_DATABASES, Databases, counter_problems
from .protocol import GroupState, VerifyReport
from .seal import sealed_payload, unseal

__all__ = ["verify_records"]

_ORDER_DB = {GroupState.PARTIAL: keys.PARTIAL_ORDER, GroupState.READY: keys.READY_ORDER}
_VIEW_DECODED = (keys.GROUPS, keys.BATCHES)
_AHEAD = 2 * CHECK_THREADS  # records checked ahead of the one reported: bounded memory (views, one decode each)


def _checker(db: bytes, key: bytes) -> Callable[[Any, str], object]:
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
    env: lmdb.Environment,
    dbs: Databases,
    *,
    sealed: bool,
    counts: dict[GroupState, int],
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """`progress(n)`: called with the bytes of each value read."""
    damaged: list[str] = []
    records = 0
    found: Counter[GroupState] = Counter()
    for db in (*SEALED_DATABASES, *(name for name in keys.OPTIONAL_DATABASES if name in dbs)):
        # A fresh transaction each: an LMDB error poisons its transaction, not the next database.
        # Values as views of the map (`buffers`): each record is read where LMDB keeps it, once,
        # by its checksum and its decoder, with no copy first (at disk speed, not a copy's).
        with env.begin(buffers=True) as txn:
            records += _walk_values(txn, dbs, db, sealed=sealed, damaged=damaged, found=found, progress=progress)
    try:
        with env.begin() as txn:
            entries = {name: txn.stat(dbs[name])["entries"] for name in keys.DATABASES}
        damaged += _count_problems(found, counts, entries)
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
    found: Counter[GroupState],
    progress: Callable[[int], None] | None,
) -> int:
    """Every value of `db` unsealed and decoded, a state entry's index entries checked as it is
    read (`found` counts the states); damage appended to `damaged`, in the order read. Returns
    values read.

    The bulky records (groups, batches) are checked and decoded on worker threads, at most
    `_AHEAD` at a time, while this thread goes on through LMDB: a checksum lets go of the GIL, so
    reading, summing and decoding overlap (a single thread reached half the disk's rate)."""
    records = 0
    pending: deque[Future[str | None]] = deque()

    def settle(keep: int) -> None:
        while len(pending) > keep:
            if (problem := pending.popleft().result()) is not None:
                damaged.append(problem)

    with ThreadPoolExecutor(max_workers=CHECK_THREADS) as pool:
        try:
            for raw_key, value in txn.cursor(db=dbs[db]).iternext(keys=True, values=True):
                if progress is not None:
                    progress(len(value))
                key = bytes(raw_key)
                if db == keys.META and key == keys.META_LAYOUT:
                    continue  # checked on open, in its own form
                records += 1
                if db in _VIEW_DECODED:
                    pending.append(pool.submit(_check_bulky, db, key, value, sealed))
                    settle(_AHEAD)
                    continue
                where = keys.describe(db, key)
                try:
                    decoded = _checker(db, key)(unseal(key, value, where=where, sealed=sealed), where)
                except StoreError as exc:
                    damaged.append(str(exc))
                    continue
                if db == keys.STATE:
                    entry: tuple[GroupState, int, int] = decoded  # type: ignore[assignment]  # the STATE checker's
                    state, version, seq = entry
                    found[state] += 1
                    damaged += _index_problems(txn, dbs, key.decode(errors="replace"), state, version, seq)
            settle(0)
        except lmdb.Error as exc:
            settle(0)
            damaged.append(f"database {db.decode()!r} is damaged after {records} records: LMDB: {exc}")
    return records


def _check_bulky(db: bytes, key: bytes, value: bytes | memoryview, sealed: bool) -> str | None:
    """A group or batch record checked and decoded from its view of the map (msgpack copies
    what it keeps): what is wrong with it, or None."""
    where = keys.describe(db, key)
    try:
        _checker(db, key)(sealed_payload(key, value, where=where, sealed=sealed), where)
    except StoreError as exc:
        return str(exc)
    return None


def _index_problems(
    txn: lmdb.Transaction, dbs: Databases, gid: str, state: GroupState, version: int, seq: int
) -> list[str]:
    """A state entry has its record and index entries."""
    problems: list[str] = []
    key = keys.group_key(gid)
    if not _has(txn, dbs[keys.GROUPS], key):
        problems.append(f"group {gid!r} ({state.value}) has a state entry but no record")
    if not _has(txn, dbs[keys.BY_STATE], keys.by_state_key(state, gid)):
        problems.append(f"group {gid!r} ({state.value}) is missing from the by-state index")
    if state in _ORDER_DB and not _has(txn, dbs[_ORDER_DB[state]], keys.order_key(version, seq, gid)):
        problems.append(f"group {gid!r} ({state.value}) is missing from its serving order")
    if state is GroupState.RUNNING and not _has(txn, dbs[keys.LEASES], key):
        problems.append(f"group {gid!r} is running but has no lease")
    return problems


def _has(txn: lmdb.Transaction, db: Any, key: bytes) -> bool:
    # A cursor finds the key without copying its value (a group record can be tens of MB).
    found: bool = txn.cursor(db=db).set_key(key)
    return found


def _count_problems(found: Counter[GroupState], counts: dict[GroupState, int], entries: dict[bytes, int]) -> list[str]:
    """The counters against the states found and LMDB's entry counts."""
    problems: list[str] = []
    if dict(found) != {s: n for s, n in counts.items() if n}:
        shown = ", ".join(
            f"{s.value} {counts.get(s, 0)} counted, {found.get(s, 0)} found"
            for s in GroupState
            if counts.get(s, 0) != found.get(s, 0)
        )
        problems.append(f"the per-state counters disagree with the state entries: {shown}")
    return problems + counter_problems(counts, entries)

"""`LmdbStore`: the `Store` protocol in one LMDB environment, durable across crashes and restarts.

(Over 400 lines on purpose, about 1,150 with group commit and the batched moves: one class, each public method one
transaction over the same private helpers; group commit (`_Write`, `_Group`, `run_grouped`) drives
those helpers' transactions and is the piece to move out next if it grows.
What does not need those helpers lives beside it: `transitions` (the rules and their
messages), `seal` (checksums), `lmdb_pages` (LMDB's own pages), `lmdb_verify`, `migrate`, `salvage`.)

Integrity: every value is sealed (`storage.seal`: layout version + CRC-32 over key and payload)
and checked on every read. Opening checks LMDB's meta pages and walks every tree's pages in
Python before LMDB reads them (`storage.lmdb_pages`), checks the counters against LMDB's entry
counts, and refuses a newer layout naming both versions; a layout-1 store (no checksums) is
migrated by a writer and read as it is by a reader. A group whose record fails its checksum is
never served: `claim_partial` and `take_batch` move it to QUARANTINED and serve the next one.

Layout (see `storage.keys`): a record per group, a small state entry per group, a by-state index
and two ordering indexes, so `claim_partial(k)` and `take_batch(step, k)` read the first k keys of
an index (O(k log n)) instead of scanning. Each public method is one LMDB transaction: either all
of it is on disk or none of it is.

One writer. LMDB allows one write transaction at a time per environment, but nothing stops two
processes from each believing they own the run, so a writer holds an exclusive `flock` on
`writer.lock` in the store directory (which records who holds it) for as long as it is open. A
read-only store takes no lock and never writes; it is for replay and inspection.

Where the cost hides: with `sync=True` every transaction ends in an fsync (about a millisecond on a
local SSD); `sync=False` trades durability of the last transactions on an OS crash for speed (a
process crash still loses nothing committed). The map is a virtual reservation: it starts at
`map_size` and doubles whenever a transaction finds it full (the transaction is aborted, the map
grown, and the transaction run again from the start, so a full map never loses a write).
Decoding a group costs about twice encoding it (building 16k Python numbers for 8 x 1k tokens), so
the writer keeps the groups it put in READY and `take_batch` hands those out instead of decoding
them again: a group is encoded once on its way in and never decoded in a process that stays up.

Leases live in their own database (see `storage.keys`); `clock` (default `time.time`) is what
lease expiry is measured against, injectable so tests can stand exactly on an expiry boundary.

Group commit (`run_grouped`): several calls share one write transaction and so one fsync, which
is what a synced store spends most of its time on. Each call stays all-or-nothing: a call that
raises after writing aborts the shared transaction, which is then run again without it (the
others are deterministic in the store's state, so their second run writes what the first did);
every other call gets its own result, and nothing is acknowledged before the commit is on disk.
Reads and counters inside a group see the writes of the calls before them, as they would one
transaction after another.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import lmdb

from core.errors import (
    CorruptRecordError,
    IncompatibleStoreError,
    StoreCorruptionError,
    StoreError,
    StoreLockedError,
)
from core.types import Batch, Group

from . import codec, keys
from . import transitions as tr
from .lmdb_pages import DAMAGE_ERRORS, check_data_file, is_damage, walk_pages
from .lmdb_verify import verify_records
from .migrate import counter_problems, layout_value, migrate_to_sealed, parse_layout
from .protocol import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_OWNER,
    Cursor,
    GroupState,
    Lease,
    RecoveryReport,
    RunMeta,
    StoreStatistics,
    VerifyReport,
    decode_step_metrics,
    encode_step_metrics,
)
from .seal import LAYOUT_VERSION, LEGACY_LAYOUT, seal, unseal
from .transitions import PutMoves, check_hand_over, check_lease

__all__ = ["LmdbStore"]

T = TypeVar("T")

_RUNNING, _PARTIAL, _READY, _BATCHED = GroupState.RUNNING, GroupState.PARTIAL, GroupState.READY, GroupState.BATCHED
_ORDER_DB = {_PARTIAL: keys.PARTIAL_ORDER, _READY: keys.READY_ORDER}
_LOCK_FILE = "writer.lock"
_MAX_MAP_SIZE = 1 << 40  # 1 TiB: past this, a full map is a bug or a disk problem, not growth
_StateEntry = tuple[GroupState, int, int]
# Ready groups kept decoded for `take_batch`; past this many the rest are read back from the map.
_READY_CACHE_MAX = 4096
_SCALARS = (str, int, float, bool, bytes)
# One call's outcome in a group: (its result, None) or (None, what it raised).
Outcome = tuple[Any, Exception | None]


class _Write:
    """One write transaction plus the store's counters as they will be if it commits.

    The counters are copies: a transaction that aborts (an error, or a full map that is retried)
    leaves the store's own counters untouched.
    """

    __slots__ = ("collected", "counts", "cursor", "dbs", "sealed", "trained_step", "txn")

    def __init__(self, txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database], store: LmdbStore) -> None:
        self.txn, self.dbs = txn, dbs
        self.sealed = store._sealed
        self.counts = dict(store._counts)
        self.cursor = store._cursor
        self.trained_step = store._trained_step
        self.collected = store._collected  # (groups collected, last step collected)

    def get(self, db: bytes, key: bytes) -> bytes | None:
        """The payload stored under `key` in `db`, its checksum checked; None if there is none."""
        raw = self.txn.get(key, db=self.dbs[db])
        return None if raw is None else unseal(key, raw, where=keys.describe(db, key), sealed=self.sealed)

    def put(self, db: bytes, key: bytes, payload: bytes, *, overwrite: bool = True) -> bool:
        value = seal(key, payload) if self.sealed else payload
        return bool(self.txn.put(key, value, db=self.dbs[db], overwrite=overwrite))

    def state_of(self, gid: str) -> _StateEntry | None:
        key = keys.group_key(gid)
        raw = self.get(keys.STATE, key)
        return None if raw is None else keys.parse_state_entry(raw, key=keys.describe(keys.STATE, key))

    def move(
        self, gid: str, old: _StateEntry | None, new: GroupState, version: int, seq: int, lease: bytes | None = None
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
            if old_state in _ORDER_DB:
                key = keys.order_key(old_version, old_seq, gid)
                removed = txn.delete(key, db=dbs[_ORDER_DB[old_state]]) and removed
            if not removed:
                raise StoreError(f"group {gid!r}: the indexes do not agree with its state {old_state.value}")
            self.counts[old_state] -= 1
        self.put(keys.STATE, keys.group_key(gid), keys.state_entry(new, version, seq))
        txn.put(keys.by_state_key(new, gid), b"", db=dbs[keys.BY_STATE])
        if new in _ORDER_DB:
            txn.put(keys.order_key(version, seq, gid), b"", db=dbs[_ORDER_DB[new]])
        if lease is not None:
            self.put(keys.LEASES, keys.group_key(gid), lease)
        self.counts[new] += 1

    def unseal(self, db: bytes, key: bytes, value: bytes) -> bytes:
        return unseal(bytes(key), value, where=keys.describe(db, key), sealed=self.sealed)

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

    def group(self, gid: str) -> Group:
        key = keys.group_key(gid)
        raw = self.get(keys.GROUPS, key)
        if raw is None:
            raise CorruptRecordError(keys.describe(keys.GROUPS, key), "indexed, but the record is missing")
        return codec.decode_group(raw, key=keys.describe(keys.GROUPS, key))

    def first_in_order(self, state: GroupState, limit: int) -> list[str]:
        out: list[str] = []
        if limit <= 0:
            return out
        for key in self.txn.cursor(db=self.dbs[_ORDER_DB[state]]).iternext(keys=True, values=False):
            out.append(keys.group_id_of_order_key(bytes(key)))
            if len(out) == limit:
                break
        return out


class _Group:
    """The write transaction that several calls share (`LmdbStore.run_grouped`)."""

    __slots__ = ("committed", "w", "wrote")

    def __init__(self, w: _Write) -> None:
        self.w = w
        self.wrote = False  # whether the call running now entered a write (else its failure aborts nothing)
        self.committed: list[tuple[Callable[[Any], None], Any]] = []


class LmdbStore(PutMoves):
    """The durable store. Thread-safe: every method holds one lock for its transaction."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = 1 << 30,
        sync: bool = True,
        readonly: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._path = os.fspath(path)
        self._readonly = readonly
        self._clock = clock
        self._collected = (0, -1)
        # Group id -> the group as put in READY by this writer (see the module docstring).
        self._ready_cache: dict[str, Group] = {}
        # Reentrant: `run_grouped` holds it across the calls it runs, which take it again.
        self._lock = threading.RLock()
        self._group: _Group | None = None
        self._lock_fd: int | None = None
        self._transactions = 0
        self._bytes_used = 0
        self._map_size = 0
        if readonly:
            if not os.path.exists(os.path.join(self._path, "data.mdb")):
                raise StoreError(f"there is no rollout store at {self._path}")
        else:
            try:
                os.makedirs(self._path, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot create the rollout store directory {self._path}: {exc}") from exc
            self._lock_fd = _take_writer_lock(self._path)
        self._env: lmdb.Environment | None = None
        self._sealed = True
        self._counts: dict[GroupState, int] = dict.fromkeys(GroupState, 0)
        self._cursor, self._trained_step = Cursor(), -1
        data_file = os.path.join(self._path, "data.mdb")
        # The page checks read the file outside LMDB's reader table, so they run only when no writer
        # is changing it: a writer (this one holds the lock), or a reader of a store nobody writes.
        problems = [] if readonly and _writer_alive(self._path) else check_data_file(data_file)
        main_keys: list[str] | None = None
        if not problems and os.path.exists(data_file) and not (readonly and _writer_alive(self._path)):
            main_keys = []
            walked = walk_pages(data_file, main_keys=main_keys)
            problems = [f"the {tree} tree is damaged: {why}" for tree, why in walked.items()]
        if problems:
            self.close()
            raise StoreCorruptionError(data_file, "; ".join(problems))
        if main_keys is not None and (foreign := _not_a_rollout_store(self._path, main_keys, readonly=readonly)):
            self.close()
            raise foreign
        try:
            self._env = _open_env(self._path, map_size=map_size, sync=sync, readonly=readonly)
            self._dbs = {name: self._env.open_db(name, create=not readonly) for name in keys.DATABASES}
            self._page_size = self._env.stat()["psize"]
        except lmdb.Error as exc:
            self.close()
            if is_damage(exc):
                raise StoreCorruptionError(data_file, f"LMDB cannot open it: {exc}") from exc
            raise StoreError(f"cannot open the rollout store at {self._path}: {exc}") from exc
        try:
            self._check_layout()
            self._counts, self._cursor, self._trained_step = self._read(self._load_counters)
            self._collected = self._read(self._load_collected)
            self._read(self._check_counters)
            self._note_size()
        except BaseException:
            self.close()
            raise

    @property
    def path(self) -> str:
        return self._path

    # --- run metadata and cursor ----------------------------------------------------------------

    def read_meta(self) -> RunMeta | None:
        def fn(txn: lmdb.Transaction) -> RunMeta | None:
            raw = self._reader(txn).get(keys.META, keys.META_RUN)
            return None if raw is None else codec.decode_meta(raw, key=keys.describe(keys.META, keys.META_RUN))

        return self._read(fn)

    def write_meta(self, meta: RunMeta) -> None:
        """Records what the store is for. Refuses (IncompatibleStoreError) to change what names the run
        once written (`codec.meta_difference`); `extra`, the settings and their changes, may change."""
        data = codec.encode_meta(meta)

        def fn(w: _Write) -> None:
            raw = w.get(keys.META, keys.META_RUN)
            if raw is not None:
                stored = codec.decode_meta(raw, key=keys.describe(keys.META, keys.META_RUN))
                if (diff := codec.meta_difference(stored, meta)) is not None:
                    raise IncompatibleStoreError(*diff)
            w.put(keys.META, keys.META_RUN, data)

        self._write(fn)

    def cursor(self) -> Cursor:
        return self._counters()[1]

    # --- the state machine ----------------------------------------------------------------------

    def admit(
        self,
        groups: Sequence[Group],
        cursor: Cursor,
        *,
        owner: str = DEFAULT_OWNER,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> None:
        check_lease(owner, lease_seconds)
        # Encode before the transaction: the write lock is held only for the writes themselves.
        records = []
        seen: set[str] = set()
        for group in groups:
            gid = group.group_id
            if gid in seen:
                raise tr.duplicate_in_admit(gid)
            seen.add(gid)
            records.append((gid, keys.group_key(gid), codec.encode_group(group), group.oldest_version, group.seq))
        cursor_record = codec.encode_cursor(cursor)

        def fn(w: _Write) -> None:
            lease = keys.lease_value(owner, self._clock() + lease_seconds)
            for gid, key, data, version, seq in records:
                if (step := w.get(keys.TOMBSTONES, key)) is not None:
                    raise tr.already_collected(gid, keys.parse_i64(step, key=keys.describe(keys.TOMBSTONES, key)))
                if not w.put(keys.GROUPS, key, data, overwrite=False):
                    state = w.state_of(gid)
                    raise tr.already_exists(gid, None if state is None else state[0])
                w.move(gid, None, _RUNNING, version, seq, lease)
            w.put(keys.META, keys.META_CURSOR, cursor_record)
            w.cursor = cursor

        self._write(fn)

    def claim_partial(
        self, limit: int, *, owner: str = DEFAULT_OWNER, lease_seconds: float = DEFAULT_LEASE_SECONDS
    ) -> list[Group]:
        check_lease(owner, lease_seconds)

        def fn(w: _Write) -> list[Group]:
            lease = keys.lease_value(owner, self._clock() + lease_seconds)
            claimed = []
            for gid, old, group in self._serve(w, _PARTIAL, limit):
                claimed.append(group)
                w.move(gid, old, _RUNNING, old[1], old[2], lease)
            return claimed

        return self._write(fn)

    # put_partial, put_ready, ...: transitions.PutMoves, through `_put`

    # --- leases ---------------------------------------------------------------------------------

    def lease(self, group_id: str) -> Lease | None:
        def fn(txn: lmdb.Transaction) -> Lease | None:
            found = self._reader(txn).lease_of(group_id)
            return None if found is None else Lease(*found)

        return self._read(fn)

    def renew_leases(self, owner: str, lease_seconds: float) -> int:
        check_lease(owner, lease_seconds)

        def fn(w: _Write) -> int:
            value = keys.lease_value(owner, self._clock() + lease_seconds)
            mine = [gid for gid, holder, _ in w.all_leases() if holder == owner]
            for gid in mine:
                w.put(keys.LEASES, keys.group_key(gid), value)
            return len(mine)

        return self._write(fn)

    def hand_over(self, group_id: str, *, owner: str, to: str, lease_seconds: float) -> None:
        self.hand_over_groups([group_id], owner=owner, to=to, lease_seconds=lease_seconds)

    def hand_over_groups(self, group_ids: Sequence[str], *, owner: str, to: str, lease_seconds: float) -> None:
        check_lease(to, lease_seconds)
        if not group_ids:
            return
        tr.check_distinct_ids(group_ids, f"hand-over to {to!r}")

        def fn(w: _Write) -> None:
            # A refused group raises here, and the transaction with the leases moved before it aborts.
            value = keys.lease_value(to, self._clock() + lease_seconds)
            for gid in group_ids:
                old = w.state_of(gid)
                held = w.lease_of(gid) if old is not None and old[0] is _RUNNING else None
                check_hand_over(gid, None if old is None else old[0], owner, None if held is None else held[0], to)
                w.put(keys.LEASES, keys.group_key(gid), value)

        self._write(fn)

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

        def fn(w: _Write) -> dict[str, str]:
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
            return refused

        def committed(refused: dict[str, str]) -> None:
            for state, group in results:
                gid = group.group_id
                if state is _READY and gid not in refused and len(self._ready_cache) < _READY_CACHE_MAX:
                    if _decodes_equal(group):
                        self._ready_cache[gid] = group

        return self._write(fn, committed)

    def reclaim_expired(self, now: float | None = None) -> int:
        def fn(w: _Write) -> int:
            at = self._clock() if now is None else now
            expired = [gid for gid, _, expiry in w.all_leases() if expiry <= at]
            for gid in expired:
                old = self._expect(w, gid, _RUNNING)
                w.move(gid, old, _PARTIAL, old[1], old[2])
            return len(expired)

        return self._write(fn)

    # --- housekeeping ---------------------------------------------------------------------------

    def collect_garbage(self, up_to_step: int) -> int:
        def fn(w: _Write) -> int:
            tr.check_collect(up_to_step, w.trained_step)
            done, last = w.collected
            if up_to_step <= last:
                return 0
            batches = self._dbs[keys.BATCHES]
            cursor = w.txn.cursor(db=batches)
            steps = []
            if cursor.set_range(keys.step_key(last + 1)):
                for step_key, raw in cursor.iternext(keys=True, values=True):
                    if keys.parse_step_key(bytes(step_key)) > up_to_step:
                        break
                    steps.append((bytes(step_key), w.unseal(keys.BATCHES, bytes(step_key), bytes(raw))))
            deleted = 0
            for step_key, raw in steps:
                step, ids = codec.decode_batch_ref(raw, key=keys.describe(keys.BATCHES, step_key))
                for gid in ids:
                    old = self._expect(w, gid, GroupState.TRAINED)
                    key = keys.group_key(gid)
                    w.txn.delete(key, db=self._dbs[keys.GROUPS])
                    w.txn.delete(key, db=self._dbs[keys.STATE])
                    w.txn.delete(keys.by_state_key(old[0], gid), db=self._dbs[keys.BY_STATE])
                    w.put(keys.TOMBSTONES, key, keys.i64_value(step))
                    w.counts[GroupState.TRAINED] -= 1
                    deleted += 1
                w.txn.delete(step_key, db=batches)
            w.collected = (done + deleted, up_to_step)
            w.put(keys.META, keys.META_COLLECTED, keys.collected_value(*w.collected))
            return deleted

        return self._write(fn)

    def take_batch(self, step: int, size: int) -> Batch | None:
        tr.check_batch_size(size)
        step_key = keys.step_key(step)

        def fn(w: _Write) -> Batch | None:
            existing = w.get(keys.BATCHES, step_key)
            if existing is not None:
                return self._batch_from_ref(w, step_key, existing)
            if step <= w.trained_step:
                raise tr.already_trained(step, w.trained_step)
            if w.counts[_READY] < size:
                return None
            served = self._serve(w, _READY, size)
            if len(served) < size:  # damaged records were quarantined: too few are left
                return None
            ids, groups = [gid for gid, _, _ in served], [group for _, _, group in served]
            for gid, old, _ in served:
                w.move(gid, old, _BATCHED, old[1], old[2])
            w.put(keys.BATCHES, step_key, codec.encode_batch_ref(step, ids))
            return Batch(step=step, groups=tuple(groups))

        def committed(batch: Batch | None) -> None:  # these groups are BATCHED now, no longer READY
            for group in batch.groups if batch is not None else ():
                self._ready_cache.pop(group.group_id, None)

        return self._write(fn, committed)

    def finish_batch(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        step_key = keys.step_key(step)
        record = None if metrics is None else encode_step_metrics(step, metrics)

        def fn(w: _Write) -> None:
            raw = w.get(keys.BATCHES, step_key)
            if raw is None and 0 <= step <= w.collected[1]:  # finished, then collected: a late retry
                return
            if raw is None:
                raise tr.no_batch(step)
            if step <= w.trained_step:  # finished already: a retry after a crash
                return
            earliest = self._first_open_step(w)
            if earliest is not None and earliest < step:
                raise tr.out_of_order(step, earliest)
            _, ids = codec.decode_batch_ref(raw, key=keys.describe(keys.BATCHES, step_key))
            for gid in ids:
                old = self._expect(w, gid, _BATCHED)
                w.move(gid, old, GroupState.TRAINED, old[1], old[2])
            w.put(keys.META, keys.META_TRAINED_STEP, keys.i64_value(step))
            if record is not None:  # with the commit: a step is trained exactly when its record is stored
                w.put(keys.META, keys.step_metrics_key(step), record)
            w.trained_step = step

        self._write(fn)

    def step_metrics(self, first: int = 0) -> dict[int, dict[str, Any]]:
        def fn(txn: lmdb.Transaction) -> dict[int, dict[str, Any]]:
            out: dict[int, dict[str, Any]] = {}
            cursor = txn.cursor(db=self._dbs[keys.META])
            if cursor.set_range(keys.step_metrics_key(first)):
                for key, raw in cursor.iternext(keys=True, values=True):
                    if not bytes(key).startswith(keys.META_STEP_METRICS):
                        break
                    step = keys.parse_step_key(bytes(key)[len(keys.META_STEP_METRICS) :])
                    where = keys.describe(keys.META, bytes(key))
                    payload = unseal(bytes(key), bytes(raw), where=where, sealed=self._sealed)
                    out[step] = decode_step_metrics(payload, key=where)
            return out

        return self._read(fn)

    def trained_step(self) -> int:
        return self._counters()[2]

    def recover(self) -> RecoveryReport:
        def fn(w: _Write) -> RecoveryReport:
            running = self._ids_in_state(w.txn, _RUNNING)
            for gid in running:  # leased or not: after a restart no producer holds anything
                old = self._expect(w, gid, _RUNNING)
                w.move(gid, old, _PARTIAL, old[1], old[2])
            # Batches after the trained step never reached a checkpoint: their groups go back to READY.
            open_batches = []
            cursor = w.txn.cursor(db=self._dbs[keys.BATCHES])
            if cursor.set_range(keys.step_key(w.trained_step + 1)):
                open_batches = [(bytes(k), bytes(v)) for k, v in cursor.iternext(keys=True, values=True)]
            requeued = 0
            for step_key, value in open_batches:
                raw = w.unseal(keys.BATCHES, step_key, value)
                _, ids = codec.decode_batch_ref(raw, key=keys.describe(keys.BATCHES, step_key))
                for gid in ids:
                    old = self._expect(w, gid, _BATCHED)
                    w.move(gid, old, _READY, old[1], old[2])
                    requeued += 1
                w.txn.delete(step_key, db=self._dbs[keys.BATCHES])
            return RecoveryReport(running_to_partial=len(running), batched_to_ready=requeued)

        return self._write(fn)

    def seed(
        self, cursor: Cursor, trained_step: int, *, partial: Sequence[Group] = (), ready: Sequence[Group] = ()
    ) -> None:
        records = [(g, _PARTIAL, codec.encode_group(g)) for g in partial]
        records += [(g, _READY, codec.encode_group(g)) for g in ready]
        cursor_record = codec.encode_cursor(cursor)

        def fn(w: _Write) -> None:
            held = sum(w.counts.values()) + w.txn.stat(self._dbs[keys.TOMBSTONES])["entries"]
            tr.check_seed(trained_step, held, w.trained_step)
            for group, state, data in records:
                gid = group.group_id
                if not w.put(keys.GROUPS, keys.group_key(gid), data, overwrite=False):
                    raise tr.duplicate_in_admit(gid)
                w.move(gid, None, state, group.oldest_version, group.seq)
            w.put(keys.META, keys.META_CURSOR, cursor_record)
            w.put(keys.META, keys.META_TRAINED_STEP, keys.i64_value(trained_step))
            w.collected = (0, trained_step)  # the seeded steps have no batches here: nothing to collect
            w.put(keys.META, keys.META_COLLECTED, keys.collected_value(*w.collected))
            w.cursor, w.trained_step = cursor, trained_step

        self._write(fn)

    def quarantine_damaged(self) -> int:
        """Every group that can still be served (RUNNING, PARTIAL, READY, BATCHED) read and checked;
        those whose records are damaged move to QUARANTINED. Returns how many moved. A launcher
        runs it on open, so a damaged prompt is requeued before the run, not found mid-run."""

        def fn(w: _Write) -> int:
            moved = 0
            for state in (_RUNNING, _PARTIAL, _READY, _BATCHED):
                for gid in self._ids_in_state(w.txn, state):
                    try:  # the checksum only: decoding every group would cost 10x more
                        if w.get(keys.GROUPS, keys.group_key(gid)) is None:
                            raise CorruptRecordError(keys.describe(keys.GROUPS, gid.encode()), "missing")
                    except CorruptRecordError:
                        old = self._expect(w, gid, state)
                        w.move(gid, old, GroupState.QUARANTINED, old[1], old[2])
                        moved += 1
            return moved

        return self._write(fn)

    def _ids_in_state(self, txn: lmdb.Transaction, state: GroupState) -> list[str]:
        prefix = keys.by_state_prefix(state)
        found = []
        cursor = txn.cursor(db=self._dbs[keys.BY_STATE])
        if cursor.set_range(prefix):
            for key in cursor.iternext(keys=True, values=False):
                if not bytes(key).startswith(prefix):
                    break
                found.append(keys.group_id_of_by_state_key(bytes(key)))
        return found

    def requeue_quarantined(self, fresh: Callable[[str], Group | None]) -> int:
        return self._requeue(GroupState.QUARANTINED, fresh)

    def requeue_failed(self, fresh: Callable[[str], Group | None]) -> int:
        return self._requeue(GroupState.FAILED, fresh)

    def _requeue(self, state: GroupState, fresh: Callable[[str], Group | None]) -> int:
        def fn(w: _Write) -> int:
            requeued = 0
            for gid in self._ids_in_state(w.txn, state):
                new_id = tr.requeue_id(gid)
                key = keys.group_key(new_id)
                if w.state_of(new_id) is not None or w.get(keys.TOMBSTONES, key) is not None:
                    continue
                if (group := fresh(gid)) is None:
                    continue
                group = dataclasses.replace(group, group_id=new_id)
                w.put(keys.GROUPS, key, codec.encode_group(group))
                w.move(new_id, None, _PARTIAL, group.oldest_version, group.seq)
                requeued += 1
            return requeued

        return self._write(fn)

    # --- reading --------------------------------------------------------------------------------

    def count(self, state: GroupState) -> int:
        return self._counters()[0][state]

    def get(self, group_id: str) -> tuple[GroupState, Group] | None:
        def fn(txn: lmdb.Transaction) -> tuple[GroupState, Group] | None:
            w = self._reader(txn)
            entry = w.state_of(group_id)
            return None if entry is None else (entry[0], w.group(group_id))

        return self._read(fn)

    def verify(self) -> VerifyReport:
        """Every record read and checked, every index checked (see `storage.lmdb_verify`)."""
        data_file = os.path.join(self._path, "data.mdb")
        pages = [f"{data_file}: {p}" for p in check_data_file(data_file)]
        if not pages:
            pages = [f"the {tree} tree is damaged: {why}" for tree, why in walk_pages(data_file).items()]
        if pages:  # LMDB must not walk a damaged tree (it reads past pages): report only these
            return VerifyReport(0, tuple(pages))
        counts = self._counters()[0]
        with self._lock:  # (a live writer may move on between the two reads: verify a stopped run)
            report = verify_records(self._open_env(), self._dbs, sealed=self._sealed, counts=counts)
        return VerifyReport(report.records, (*pages, *report.damaged))

    def groups(self, state: GroupState, *, damaged: list[CorruptRecordError] | None = None) -> Iterator[Group]:
        """A snapshot, read in one transaction (no transaction stays open while the caller iterates).

        With `damaged`, a record that fails its checksum is appended there and skipped (replay
        reports it and goes on); without, it raises CorruptRecordError."""

        def fn(txn: lmdb.Transaction) -> list[Group]:
            w = self._reader(txn)
            if state in _ORDER_DB:
                ids = w.first_in_order(state, 1 << 62)
            else:
                ids = self._ids_in_state(txn, state)
            return _readable(w.group, ids, damaged)

        return iter(self._read(fn))

    def batch(self, step: int, *, damaged: list[CorruptRecordError] | None = None) -> Batch | None:
        """With `damaged`, as in `groups`: damaged groups are listed there and left out of the batch."""
        step_key = keys.step_key(step)

        def fn(txn: lmdb.Transaction) -> Batch | None:
            w = self._reader(txn)
            raw = w.get(keys.BATCHES, step_key)
            if raw is None:
                return None
            step_read, ids = codec.decode_batch_ref(raw, key=keys.describe(keys.BATCHES, step_key))
            return Batch(step=step_read, groups=tuple(_readable(w.group, ids, damaged)))

        return self._read(fn)

    def statistics(self) -> StoreStatistics:
        """Cheap for a writer: its counters live in memory, so no transaction (and no lock wait)."""
        if self._readonly:
            counts, cursor, trained = self._counters()
            collected = self._read(self._load_collected)
            self._note_size()
        else:
            self._open_env()
            counts, cursor, trained, collected = self._counts, self._cursor, self._trained_step, self._collected
        return StoreStatistics(
            counts=dict(counts),
            cursor=cursor,
            trained_step=trained,
            transactions=self._transactions,
            bytes_used=self._bytes_used,
            collected=collected[0],
            collected_step=collected[1],
            map_size=self._map_size,
        )

    def close(self) -> None:
        with self._lock:
            self._ready_cache.clear()
            env, self._env = self._env, None
            if env is not None:
                env.close()
            self._release_writer_lock()

    def __enter__(self) -> LmdbStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "readonly" if self._readonly else "writer"
        return f"LmdbStore({self._path!r}, {mode})"

    # --- transactions ---------------------------------------------------------------------------

    def _write(self, fn: Callable[[_Write], T], committed: Callable[[T], None] | None = None) -> T:
        """Run `fn` in one write transaction; on a full map, double it and run `fn` again.

        `committed` runs once the transaction is on disk, still under the store's lock."""
        if self._readonly:
            raise StoreError(f"the rollout store {self._path} is open read-only")
        with self._lock:
            if (group := self._group) is not None:
                group.wrote = True
                try:
                    result = fn(group.w)
                except lmdb.MapFullError:
                    raise  # `run_grouped` grows the map and runs the group again
                except lmdb.Error as exc:
                    raise self._translate(exc) from exc
                if committed is not None:
                    group.committed.append((committed, result))
                return result
            env = self._open_env()
            while True:
                try:
                    with env.begin(write=True) as txn:
                        w = _Write(txn, self._dbs, self)
                        result = fn(w)
                        if w.counts != self._counts:
                            w.put(keys.META, keys.META_COUNTS, keys.counts_value(w.counts))
                    break
                except lmdb.MapFullError:
                    self._grow(env)  # the transaction was aborted; nothing of it is stored
                except lmdb.Error as exc:
                    raise self._translate(exc) from exc
            self._counts, self._cursor, self._trained_step = w.counts, w.cursor, w.trained_step
            self._collected = w.collected
            self._transactions += 1
            self._bytes_used = self._used_bytes(env)
            if committed is not None:
                committed(result)
            return result

    def _read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        with self._lock:
            if self._group is not None:  # read the group's own transaction: it sees the calls before
                try:
                    return fn(self._group.w.txn)
                except lmdb.Error as exc:
                    raise self._translate(exc) from exc
            env = self._open_env()
            for _ in range(3):
                try:
                    with env.begin() as txn:
                        return fn(txn)
                except lmdb.MapResizedError:
                    env.set_mapsize(0)  # the writer (another process) grew the map: adopt its size
                except lmdb.Error as exc:
                    raise self._translate(exc) from exc
            raise StoreError(f"rollout store {self._path}: the map keeps being resized under a reader")

    def run_grouped(self, calls: Sequence[Callable[[], Any]]) -> list[Outcome]:
        """Run `calls` (this store's methods, bound to their arguments) in order in one write
        transaction, committed (and synced) once. Returns each call's (result, None) or (None,
        error); see "Group commit" in the module docstring for what a failing call does."""
        if self._readonly or len(calls) < 2:
            return [_outcome(call) for call in calls]
        failed: dict[int, Exception] = {}
        with self._lock:
            while True:
                outcomes = self._try_group(self._open_env(), calls, failed)
                if outcomes is not None:
                    return outcomes

    def _try_group(
        self, env: lmdb.Environment, calls: Sequence[Callable[[], Any]], failed: dict[int, Exception]
    ) -> list[Outcome] | None:
        """One attempt at the group. None: it was aborted (a call failed after writing, or the
        map was full and has grown) and must run again; `failed` then holds the calls left out."""
        outcomes: list[Outcome] = []
        txn = env.begin(write=True)
        self._group = group = _Group(_Write(txn, self._dbs, self))
        try:
            for i, call in enumerate(calls):
                if i in failed:
                    outcomes.append((None, failed[i]))
                    continue
                group.wrote = False
                try:
                    outcomes.append((call(), None))
                except lmdb.MapFullError:
                    raise
                except Exception as exc:
                    outcomes.append((None, exc))
                    if group.wrote:  # it may have written part of itself: run the rest without it
                        failed[i] = exc
                        txn.abort()
                        return None
            if group.w.counts != self._counts:
                group.w.put(keys.META, keys.META_COUNTS, keys.counts_value(group.w.counts))
            txn.commit()
        except lmdb.MapFullError:
            txn.abort()
            self._grow(env)
            return None
        except lmdb.Error as exc:  # the commit itself failed: no call in the group happened
            txn.abort()
            error = self._translate(exc)
            return [(None, error if e is None else e) for _, e in outcomes]
        except BaseException:
            txn.abort()
            raise
        finally:
            self._group = None
        w = group.w
        self._counts, self._cursor, self._trained_step = w.counts, w.cursor, w.trained_step
        self._collected = w.collected
        self._transactions += 1
        self._bytes_used = self._used_bytes(env)
        for committed, result in group.committed:
            committed(result)
        return outcomes

    def _grow(self, env: lmdb.Environment) -> None:
        size = env.info()["map_size"]
        if size * 2 > _MAX_MAP_SIZE:
            raise StoreError(f"rollout store {self._path}: the map is full at {size} bytes and may not grow further")
        try:
            env.set_mapsize(size * 2)
        except lmdb.Error as exc:
            raise StoreError(f"rollout store {self._path}: cannot grow the map past {size} bytes: {exc}") from exc

    def _reader(self, txn: lmdb.Transaction) -> _Write:
        # The read helpers of `_Write` work on any transaction; a reader never writes through it.
        return _Write(txn, self._dbs, self)

    # --- internals ------------------------------------------------------------------------------

    def _open_env(self) -> lmdb.Environment:
        if self._env is None:
            raise StoreError(f"the rollout store {self._path} is closed")
        return self._env

    def _translate(self, exc: lmdb.Error) -> StoreError:
        """An lmdb error as this library's: damaged bytes are a StoreCorruptionError, whatever the code."""
        if isinstance(exc, DAMAGE_ERRORS):
            return StoreCorruptionError(os.path.join(self._path, "data.mdb"), f"LMDB: {exc}")
        return StoreError(f"rollout store {self._path}: {exc}")

    def _check_layout(self) -> None:
        """Stamp a new store with its layout version, migrate a layout-1 store (writer only), and
        refuse a store of a newer layout, naming both versions."""
        meta = self._dbs[keys.META]
        where = keys.describe(keys.META, keys.META_LAYOUT)
        raw = self._read(lambda txn: txn.get(keys.META_LAYOUT, db=meta))
        stored = None if raw is None else parse_layout(bytes(raw), where=where)
        if stored is not None and stored > LAYOUT_VERSION:
            raise IncompatibleStoreError(
                "layout_version",
                stored,
                LAYOUT_VERSION,
                reason=f"the rollout store {self._path} was written by a newer rollout-pipeline (store layout "
                f"{stored}); this version reads layouts {LEGACY_LAYOUT} to {LAYOUT_VERSION}: "
                "open it with the newer version",
            )
        if stored is not None and stored < LEGACY_LAYOUT:
            raise CorruptRecordError(where, f"layout version {stored} was never written by any version")
        if self._readonly:
            if stored is None:
                raise StoreError(f"{self._path} holds no rollout store layout record: it was never opened by a writer")
            self._sealed = stored == LAYOUT_VERSION
            return
        if stored is None:
            self._write(lambda w: w.txn.put(keys.META_LAYOUT, layout_value(LAYOUT_VERSION), db=meta))
        elif stored == LEGACY_LAYOUT:
            self._write(lambda w: migrate_to_sealed(w.txn, self._dbs))
        self._transactions = 0  # stamping the store is not the caller's transaction

    def _check_counters(self, txn: lmdb.Transaction) -> None:
        """The counters against the records, in O(1): LMDB keeps each database's entry count."""
        entries = {name: txn.stat(self._dbs[name])["entries"] for name in keys.DATABASES}
        counts = self._load_counters(txn)[0]  # the same snapshot: a live writer may have moved on
        if problems := counter_problems(counts, entries):
            raise StoreCorruptionError(keys.describe(keys.META, keys.META_COUNTS), "; ".join(problems))

    def _load_counters(self, txn: lmdb.Transaction) -> tuple[dict[GroupState, int], Cursor, int]:
        r = self._reader(txn)
        raw_counts = r.get(keys.META, keys.META_COUNTS)
        counts = dict.fromkeys(GroupState, 0) if raw_counts is None else keys.parse_counts(raw_counts)
        raw_cursor = r.get(keys.META, keys.META_CURSOR)
        cursor = (
            Cursor()
            if raw_cursor is None
            else codec.decode_cursor(raw_cursor, key=keys.describe(keys.META, keys.META_CURSOR))
        )
        raw_step = r.get(keys.META, keys.META_TRAINED_STEP)
        trained = (
            -1 if raw_step is None else keys.parse_i64(raw_step, key=keys.describe(keys.META, keys.META_TRAINED_STEP))
        )
        return counts, cursor, trained

    def _load_collected(self, txn: lmdb.Transaction) -> tuple[int, int]:
        raw = self._reader(txn).get(keys.META, keys.META_COLLECTED)
        return (0, -1) if raw is None else keys.parse_collected(raw)

    def _counters(self) -> tuple[dict[GroupState, int], Cursor, int]:
        # The writer is the only one changing the store, so its copies are the truth. A read-only
        # store may be watching a live writer in another process: read fresh.
        if self._readonly:
            return self._read(self._load_counters)
        self._open_env()
        if (group := self._group) is not None:
            return group.w.counts, group.w.cursor, group.w.trained_step
        return self._counts, self._cursor, self._trained_step

    def _put(self, groups: Sequence[Group], to: GroupState, owner: str | None) -> None:
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

        def fn(w: _Write) -> None:
            for gid, key, data, version, seq in records:
                old = w.state_of(gid)
                holder = w.lease_of(gid) if owner is not None and old is not None and old[0] is _RUNNING else None
                tr.check_put(gid, None if old is None else old[0], to, owner, None if holder is None else holder[0])
                assert old is not None
                w.put(keys.GROUPS, key, data)
                w.move(gid, old, to, version, seq)

        def committed(_: None) -> None:
            if to is not _READY:
                return
            for group in groups:
                if len(self._ready_cache) < _READY_CACHE_MAX and _decodes_equal(group):
                    self._ready_cache[group.group_id] = group

        self._write(fn, committed)

    def _serve(self, w: _Write, state: GroupState, limit: int) -> list[tuple[str, _StateEntry, Group]]:
        """Up to `limit` groups of `state` (PARTIAL or READY) in serving order, read and checked.

        A group whose record fails its checksum is never served: it moves to QUARANTINED in this
        same transaction (record kept as it is) and the next one in order is served instead."""
        served: list[tuple[str, _StateEntry, Group]] = []
        seen: set[str] = set()
        while len(served) < limit:
            new = [gid for gid in w.first_in_order(state, limit) if gid not in seen]
            if not new:
                break
            for gid in new[: limit - len(served)]:
                seen.add(gid)
                old = self._expect(w, gid, state)
                try:
                    group = self._ready_cache.get(gid) if state is _READY else None
                    served.append((gid, old, group if group is not None else w.group(gid)))
                except CorruptRecordError:
                    w.move(gid, old, GroupState.QUARANTINED, old[1], old[2])
        return served

    def _expect(self, w: _Write, gid: str, state: GroupState) -> _StateEntry:
        entry = w.state_of(gid)
        if entry is None or entry[0] is not state:
            found = "missing" if entry is None else entry[0].value
            raise StoreError(f"group {gid!r} is indexed as {state.value} but its state is {found}")
        return entry

    def _first_open_step(self, w: _Write) -> int | None:
        cursor = w.txn.cursor(db=self._dbs[keys.BATCHES])
        if not cursor.set_range(keys.step_key(w.trained_step + 1)):
            return None
        return keys.parse_step_key(bytes(cursor.key()))

    def _batch_from_ref(self, w: _Write, step_key: bytes, raw: bytes) -> Batch:
        step, ids = codec.decode_batch_ref(raw, key=keys.describe(keys.BATCHES, step_key))
        return Batch(step=step, groups=tuple(w.group(gid) for gid in ids))

    def _note_size(self) -> None:
        with self._lock:
            if self._env is not None:
                self._bytes_used = self._used_bytes(self._env)

    def _used_bytes(self, env: lmdb.Environment) -> int:
        info = env.info()
        self._map_size = info["map_size"]
        return (info["last_pgno"] + 1) * self._page_size

    def _release_writer_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            try:
                os.ftruncate(fd, 0)  # no stale holder shown after a clean close
            finally:
                os.close(fd)  # closing the descriptor releases the flock


def _outcome(call: Callable[[], Any]) -> Outcome:
    try:
        return call(), None
    except Exception as exc:
        return None, exc


def _readable(
    read: Callable[[str], Group], ids: Sequence[str], damaged: list[CorruptRecordError] | None
) -> list[Group]:
    if damaged is None:
        return [read(gid) for gid in ids]
    out = []
    for gid in ids:
        try:
            out.append(read(gid))
        except CorruptRecordError as exc:
            damaged.append(exc)
    return out


def _decodes_equal(group: Group) -> bool:
    """Whether decoding this group's record gives back an equal group of the same shapes.

    Free-form values are the exception: tuples inside a label or metadata come back as lists (and
    mappings as dicts), so a group that has any is read back from its record, never cached."""
    task = group.task
    if task.metadata or not (task.label is None or type(task.label) in _SCALARS):
        return False
    return not any(s.metadata for s in group.samples)


def _open_env(path: str, *, map_size: int, sync: bool, readonly: bool) -> lmdb.Environment:
    options: dict[str, Any] = dict(
        map_size=map_size, max_dbs=len(keys.DATABASES), subdir=True, readonly=readonly, sync=sync
    )
    try:
        return lmdb.open(path, create=not readonly, metasync=sync, lock=True, **options)
    except lmdb.Error:
        if not readonly:
            raise
    # A reader registers itself in lock.mdb, which needs a writable directory. An archived store on
    # read-only media has no writer to guard against: read it without LMDB's reader table.
    return lmdb.open(path, create=False, lock=False, **options)


def _not_a_rollout_store(path: str, main_keys: list[str], *, readonly: bool) -> IncompatibleStoreError | None:
    """The error for an LMDB file another program wrote (its main tree holds keys no rollout store
    writes), or one a reader cannot use (it lacks the rollout databases); None for a rollout store,
    or an empty file a writer is about to fill. Checked before LMDB opens it: a writer would add
    its databases to the other program's file, a reader would fail on LMDB's MDB_NOTFOUND."""
    ours = {name.decode() for name in keys.DATABASES}
    others = sorted(set(main_keys) - ours)
    missing = sorted(ours - set(main_keys)) if readonly else []
    if not others and not missing:
        return None
    if others:
        reason = (
            f"{path} is not a rollout store: it holds {others}, which no rollout store writes; "
            "point the store at another directory (its data was left as it was)"
        )
    else:  # a store of the first layouts (fewer databases), or an empty LMDB file
        reason = f"{path} lacks the databases {missing} that a reader of this version opens"
        reason += " (a store from an early version that no writer has opened since, or not a rollout store)"
    return IncompatibleStoreError("databases", sorted(main_keys), sorted(ours), reason=reason)


def _writer_alive(path: str) -> bool:
    """Whether a writer holds `<path>/writer.lock` now (a shared flock would wait for it)."""
    try:
        fd = os.open(os.path.join(path, _LOCK_FILE), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing the descriptor releases a shared lock it got
    return False


def _take_writer_lock(path: str) -> int:
    """An exclusive, non-blocking flock on `<path>/writer.lock`, which then names its holder."""
    lock_path = os.path.join(path, _LOCK_FILE)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StoreError(f"cannot create the writer lock {lock_path}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip()
        holder = holder or "another process (it has not named itself yet)"
        os.close(fd)
        raise StoreLockedError(path, holder) from None
    except OSError as exc:
        os.close(fd)
        raise StoreError(f"cannot lock {lock_path}: {exc}") from exc
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    return fd

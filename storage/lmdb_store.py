"""`LmdbStore`: the `Store` protocol in one LMDB environment, durable across crashes and restarts.

One class, each public method one transaction, built from one module per concern:
- `lmdb_env`: opening the environment and its settings, the writer's lock, the checks before open;
- `lmdb_transactions`: one method, one transaction (`_write`, `_read`), and group commit
  (`run_grouped`); `lmdb_txn`: one transaction as the store sees it (`Txn`: sealed reads and
  writes, the indexes moved together, the counters as they will be);
- `lmdb_groups`: admit, claim and the moves out of RUNNING; `lmdb_leases`: leases and the fence
  on a producer's results; `lmdb_batches`: batches, the trainer's commits, garbage collection;
  `lmdb_recovery`: recovery, seeding, quarantine and requeue, verify;
- here: opening and closing the store, the run record and cursor, reading groups, statistics.
What does not need a transaction lives beside them: `transitions` (the rules and their messages),
`seal` (checksums), `lmdb_pages` (LMDB's own pages), `lmdb_verify`, `migrate`, `salvage`,
`lmdb_ready` (the ready groups a writer keeps decoded).

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

One writer: a writer holds an exclusive `flock` on `writer.lock` in the store directory for as
long as it is open (`lmdb_env`). A read-only store takes no lock and never writes; it is for
replay and inspection.

With `sync=True` every transaction ends in an fsync; `sync=False` trades durability of the last
transactions on an OS crash for speed (a process crash still loses nothing committed). The map
starts at `map_size` and doubles whenever a transaction finds it full (`lmdb_transactions`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence

import lmdb

from core.errors import CorruptRecordError, IncompatibleStoreError, StoreCorruptionError, StoreError
from core.types import Group

from . import codec, keys
from . import lmdb_env as env_
from .history import PromptHistory
from .lmdb_batches import BatchMoves
from .lmdb_groups import GroupMoves
from .lmdb_leases import LeaseMoves
from .lmdb_pages import is_damage
from .lmdb_recovery import Recovery
from .lmdb_txn import ORDER_DB, Txn
from .migrate import counter_problems, layout_value, migrate_to_sealed, parse_layout
from .protocol import Cursor, GroupState, RunMeta, StoreStatistics
from .seal import LAYOUT_VERSION, LEGACY_LAYOUT

__all__ = ["LmdbStore"]


class LmdbStore(GroupMoves, LeaseMoves, BatchMoves, Recovery):
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
        super().__init__(os.fspath(path), readonly=readonly, clock=clock)
        data_file = env_.data_file(self._path)
        if readonly:
            if not os.path.exists(data_file):
                raise StoreError(f"there is no rollout store at {self._path}")
        else:
            try:
                os.makedirs(self._path, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot create the rollout store directory {self._path}: {exc}") from exc
            self._lock_fd = env_.take_writer_lock(self._path)
        try:
            env_.check_before_open(self._path, readonly=readonly)
        except BaseException:
            self.close()
            raise
        try:
            self._env = env_.open_env(self._path, map_size=map_size, sync=sync, readonly=readonly)
            self._dbs = {name: self._env.open_db(name, create=not readonly) for name in keys.DATABASES}
            self._dbs.update(env_.open_optional(self._env, readonly=readonly))
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
            raw = self._txn(txn).get(keys.META, keys.META_RUN)
            return None if raw is None else codec.decode_meta(raw, key=keys.describe(keys.META, keys.META_RUN))

        return self._read(fn)

    def write_meta(self, meta: RunMeta) -> None:
        """Records what the store is for. Refuses (IncompatibleStoreError) to change what names the run
        once written (`codec.meta_difference`); `extra`, the settings and their changes, may change."""
        data = codec.encode_meta(meta)

        def fn(w: Txn) -> None:
            raw = w.get(keys.META, keys.META_RUN)
            if raw is not None:
                stored = codec.decode_meta(raw, key=keys.describe(keys.META, keys.META_RUN))
                if (diff := codec.meta_difference(stored, meta)) is not None:
                    raise IncompatibleStoreError(*diff)
            w.put(keys.META, keys.META_RUN, data)

        self._write(fn)

    def cursor(self) -> Cursor:
        return self._counters()[1]

    # --- reading --------------------------------------------------------------------------------

    def count(self, state: GroupState) -> int:
        return self._counters()[0][state]

    def prompt_history(self, indexes: Sequence[int]) -> dict[int, PromptHistory]:
        def fn(txn: lmdb.Transaction) -> dict[int, PromptHistory]:
            w = self._txn(txn)
            return {i: h for i in indexes if (h := w.history(i)) is not None}

        return self._read(fn)

    def get(self, group_id: str) -> tuple[GroupState, Group] | None:
        def fn(txn: lmdb.Transaction) -> tuple[GroupState, Group] | None:
            w = self._txn(txn)
            entry = w.state_of(group_id)
            return None if entry is None else (entry[0], w.group(group_id))

        return self._read(fn)

    def groups(self, state: GroupState, *, damaged: list[CorruptRecordError] | None = None) -> Iterator[Group]:
        """A snapshot, read in one transaction (no transaction stays open while the caller iterates).

        With `damaged`, a record that fails its checksum is appended there and skipped (replay
        reports it and goes on); without, it raises CorruptRecordError."""

        def fn(txn: lmdb.Transaction) -> list[Group]:
            w = self._txn(txn)
            ids = w.first_in_order(state, 1 << 62) if state in ORDER_DB else w.ids_in_state(state)
            return w.readable(ids, damaged)

        return iter(self._read(fn))

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

    # --- opening and closing --------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._ready_cache.clear()
            env, self._env = self._env, None
            if env is not None:
                env.close()
            fd, self._lock_fd = self._lock_fd, None
            if fd is not None:
                env_.release_writer_lock(fd)

    def __enter__(self) -> LmdbStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "readonly" if self._readonly else "writer"
        return f"LmdbStore({self._path!r}, {mode})"

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

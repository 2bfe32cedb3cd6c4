"""`LmdbStore`: the `Store` protocol in one LMDB environment, durable across crashes and restarts.

One class, each public method one transaction, composed of one part per concern, each a plain
object the store owns and hands the methods of its concern to:
- `lmdb_env`: opening the environment and its settings, the writer's lock, the checks before open;
- `lmdb_transactions`: the environment, the lock and the writer's counters, one method, one
  transaction (`write`, `read`), and group commit (`run_grouped`); every part below is given the
  store's one `LmdbTransactions`; `lmdb_txn`: one transaction as the store sees it (`Txn`: sealed
  reads and writes, the indexes moved together, the counters as they will be);
- `lmdb_groups`: admit, claim and the moves out of RUNNING; `lmdb_leases`: leases and the fence
  on a producer's results; `lmdb_batches`: batches, the trainer's commits, garbage collection;
  `lmdb_recovery`: recovery, seeding, quarantine and requeue, verify;
- here: opening and closing the store, the run record and cursor, reading groups.
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import lmdb

from core.errors import CorruptRecordError, IncompatibleStoreError, StoreCorruptionError, StoreError
from core.types import Batch, Group

from . import codec, keys
from . import lmdb_env as env_
from .history import PromptHistory
from .lmdb_batches import BatchMoves
from .lmdb_groups import GroupMoves
from .lmdb_leases import LeaseMoves
from .lmdb_pages import is_damage
from .lmdb_ready import ReadyCache
from .lmdb_recovery import Recovery
from .lmdb_transactions import LmdbTransactions, Outcome
from .lmdb_txn import ORDER_DB, Txn
from .migrate import layout_value, migrate_to_sealed, parse_layout
from .protocol import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_OWNER,
    Coverage,
    Cursor,
    GroupState,
    Lease,
    RecoveryReport,
    RunMeta,
    StoreStatistics,
    VerifyReport,
)
from .seal import LAYOUT_VERSION, LEGACY_LAYOUT

__all__ = ["LmdbStore"]

_PARTIAL, _READY, _REJECTED, _FAILED = GroupState.PARTIAL, GroupState.READY, GroupState.REJECTED, GroupState.FAILED


class LmdbStore:
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
        self._lock_fd: int | None = None
        # The ready groups this writer keeps decoded: its puts and results fill it, its batches take from it.
        self._ready = ReadyCache()
        self._tx = LmdbTransactions(self._path, readonly=readonly)
        self._groups = GroupMoves(self._tx, self._ready, clock)
        self._leases = LeaseMoves(self._tx, self._ready, clock)
        self._batches = BatchMoves(self._tx, self._ready)
        self._recovery = Recovery(self._tx)
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
            self._tx.open(env_.open_env(self._path, map_size=map_size, sync=sync, readonly=readonly))
        except lmdb.Error as exc:
            self.close()
            if is_damage(exc):
                raise StoreCorruptionError(data_file, f"LMDB cannot open it: {exc}") from exc
            raise StoreError(f"cannot open the rollout store at {self._path}: {exc}") from exc
        try:
            self._tx.load(sealed=self._check_layout())
        except BaseException:
            self.close()
            raise

    @property
    def path(self) -> str:
        return self._path

    # --- run metadata and cursor ----------------------------------------------------------------

    def read_meta(self) -> RunMeta | None:
        def fn(txn: lmdb.Transaction) -> RunMeta | None:
            raw = self._tx.view(txn).get(keys.META, keys.META_RUN)
            return None if raw is None else codec.decode_meta(raw, key=keys.describe(keys.META, keys.META_RUN))

        return self._tx.read(fn)

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

        self._tx.write(fn)

    def cursor(self) -> Cursor:
        return self._tx.counters()[1]

    def run_grouped(self, calls: Sequence[Callable[[], Any]]) -> list[Outcome]:
        """Run `calls` (this store's methods, bound to their arguments) in one write transaction,
        committed once (`LmdbTransactions.run_grouped`)."""
        return self._tx.run_grouped(calls)

    # --- groups: `lmdb_groups` ------------------------------------------------------------------

    def admit(
        self,
        groups: Sequence[Group],
        cursor: Cursor,
        *,
        owner: str = DEFAULT_OWNER,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        skipped: Sequence[Group] = (),
    ) -> None:
        self._groups.admit(groups, cursor, owner=owner, lease_seconds=lease_seconds, skipped=skipped)

    def claim_partial(
        self, limit: int, *, owner: str = DEFAULT_OWNER, lease_seconds: float = DEFAULT_LEASE_SECONDS
    ) -> list[Group]:
        return self._groups.claim_partial(limit, owner=owner, lease_seconds=lease_seconds)

    def put_partial(self, group: Group, *, owner: str | None = None) -> None:
        self._groups.put((group,), _PARTIAL, owner)

    def put_ready(self, group: Group, *, owner: str | None = None) -> None:
        self._groups.put((group,), _READY, owner)

    def put_rejected(self, group: Group, *, owner: str | None = None) -> None:
        self._groups.put((group,), _REJECTED, owner)

    def put_failed(self, group: Group, *, owner: str | None = None) -> None:
        self._groups.put((group,), _FAILED, owner)

    def put_ready_groups(self, groups: Sequence[Group], *, owner: str | None = None) -> None:
        self._groups.put(groups, _READY, owner)

    def put_rejected_groups(self, groups: Sequence[Group], *, owner: str | None = None) -> None:
        self._groups.put(groups, _REJECTED, owner)

    # --- leases: `lmdb_leases` ------------------------------------------------------------------

    def lease(self, group_id: str) -> Lease | None:
        return self._leases.lease(group_id)

    def renew_leases(self, owner: str, lease_seconds: float) -> int:
        return self._leases.renew_leases(owner, lease_seconds)

    def hand_over(self, group_id: str, *, owner: str, to: str, lease_seconds: float) -> None:
        self._leases.hand_over(group_id, owner=owner, to=to, lease_seconds=lease_seconds)

    def hand_over_groups(self, group_ids: Sequence[str], *, owner: str, to: str, lease_seconds: float) -> None:
        self._leases.hand_over_groups(group_ids, owner=owner, to=to, lease_seconds=lease_seconds)

    def accept_results(
        self,
        owner: str,
        results: Sequence[tuple[GroupState, Group]],
        *,
        to: str = DEFAULT_OWNER,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> dict[str, str]:
        return self._leases.accept_results(owner, results, to=to, lease_seconds=lease_seconds)

    def reclaim_expired(self, now: float | None = None) -> int:
        return self._leases.reclaim_expired(now)

    # --- batches and the trainer's progress: `lmdb_batches` -------------------------------------

    def take_batch(self, step: int, size: int) -> Batch | None:
        return self._batches.take_batch(step, size)

    def finish_batch(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        self._batches.finish_batch(step, metrics)

    def step_metrics(self, first: int = 0) -> dict[int, dict[str, Any]]:
        return self._batches.step_metrics(first)

    def trained_step(self) -> int:
        return self._tx.counters()[2]

    def batch(self, step: int, *, damaged: list[CorruptRecordError] | None = None) -> Batch | None:
        return self._batches.batch(step, damaged=damaged)

    def damaged_in_batch(self, step: int) -> list[tuple[str, CorruptRecordError]] | None:
        return self._batches.damaged_in_batch(step)

    def collect_garbage(self, up_to_step: int) -> int:
        return self._batches.collect_garbage(up_to_step)

    # --- recovery and integrity: `lmdb_recovery` ------------------------------------------------

    def recover(self) -> RecoveryReport:
        return self._recovery.recover()

    def seed(
        self,
        cursor: Cursor,
        trained_step: int,
        *,
        partial: Sequence[Group] = (),
        ready: Sequence[Group] = (),
        replay: Sequence[tuple[Batch, Mapping[str, Any] | None]] = (),
    ) -> None:
        self._recovery.seed(cursor, trained_step, partial=partial, ready=ready, replay=replay)

    def coverage(self, step: int) -> Coverage:
        return self._recovery.coverage(step)

    def quarantine_damaged(self) -> int:
        return self._recovery.quarantine_damaged()

    def requeue_quarantined(self, fresh: Callable[[str], Group | None]) -> int:
        return self._recovery.requeue_quarantined(fresh)

    def requeue_failed(self, fresh: Callable[[str], Group | None]) -> int:
        return self._recovery.requeue_failed(fresh)

    def requeue_trained(self, group_ids: Sequence[str], fresh: Callable[[str], Group | None]) -> list[str]:
        return self._recovery.requeue_trained(group_ids, fresh)

    def verify(self, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
        return self._recovery.verify(progress=progress)

    # --- reading --------------------------------------------------------------------------------

    def count(self, state: GroupState) -> int:
        return self._tx.counters()[0][state]

    def prompt_history(self, indexes: Sequence[int]) -> dict[int, PromptHistory]:
        def fn(txn: lmdb.Transaction) -> dict[int, PromptHistory]:
            w = self._tx.view(txn)
            return {i: h for i in indexes if (h := w.history(i)) is not None}

        return self._tx.read(fn)

    def get(self, group_id: str) -> tuple[GroupState, Group] | None:
        def fn(txn: lmdb.Transaction) -> tuple[GroupState, Group] | None:
            w = self._tx.view(txn)
            entry = w.state_of(group_id)
            return None if entry is None else (entry[0], w.group(group_id))

        return self._tx.read(fn)

    def groups(self, state: GroupState, *, damaged: list[CorruptRecordError] | None = None) -> Iterator[Group]:
        """A snapshot, read in one transaction (no transaction stays open while the caller iterates).

        With `damaged`, a record that fails its checksum is appended there and skipped (replay
        reports it and goes on); without, it raises CorruptRecordError."""

        def fn(txn: lmdb.Transaction) -> list[Group]:
            w = self._tx.view(txn)
            ids = w.first_in_order(state, 1 << 62) if state in ORDER_DB else w.ids_in_state(state)
            return w.readable(ids, damaged)

        return iter(self._tx.read(fn))

    def statistics(self) -> StoreStatistics:
        return self._tx.statistics()

    # --- opening and closing --------------------------------------------------------------------

    def close(self) -> None:
        self._tx.close(then=self._let_go)

    def _let_go(self) -> None:
        """What the store holds beside the environment (run under the transactions' lock)."""
        self._ready.clear()
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

    def _check_layout(self) -> bool:
        """Stamp a new store with its layout version, migrate a layout-1 store (writer only), and
        refuse a store of a newer layout, naming both versions. Returns whether values are sealed."""
        meta = self._tx.dbs[keys.META]
        where = keys.describe(keys.META, keys.META_LAYOUT)
        raw = self._tx.read(lambda txn: txn.get(keys.META_LAYOUT, db=meta))
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
            return stored == LAYOUT_VERSION
        if stored is None:
            self._tx.write(lambda w: w.txn.put(keys.META_LAYOUT, layout_value(LAYOUT_VERSION), db=meta))
        elif stored == LEGACY_LAYOUT:
            self._tx.write(lambda w: migrate_to_sealed(w.txn, self._tx.dbs))
        return True
